"""The code's names, checked statically by ruff (installed with the test extra, pinned in setup.py): no
undefined name, no unused import or variable, no syntax error, in the package, the tests, the benchmarks and the examples
(pyflakes' rules F and E9; style is not checked). A name a refactor left undefined fails here, before a
run reaches the line."""
from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

SELECT = "F,E9"


def ruff(*paths: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--select", SELECT,
                           "--output-format", "concise", *paths], cwd=ROOT, capture_output=True, text=True)


def test_the_code_has_no_undefined_or_unused_names():
    done = ruff("faircast_ds", "tests", "benchmarks", "examples")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_check_finds_an_undefined_name(tmp_path):
    """The check itself, on a file with one undefined name: it must fail, naming the line."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    return undefined_name\n")
    done = ruff(str(bad))
    assert done.returncode == 1 and "bad.py:2:12: F821" in done.stdout, done.stdout + done.stderr
