"""launch/trl_seeds.sh keeps every finished run's rows where git tracks them (examples/trl_grpo/summarize.py into
docs/trl_runs) and does not run a run recorded there as finished: runs/ is ignored by git and does not outlive
the checkout that wrote it, so the four runs, taken in different sessions, meet in the committed folder.

The script runs for real in a copy of its files, with ``accelerate`` replaced on PATH by a program that writes
a run's rows the way the recipe does (``steps.jsonl``, steps 1..N) and records each call; the recipe itself is
run by tests/transformers_tests/test_trl_colocate.py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

FAKE_ACCELERATE = r"""#!/usr/bin/env bash
set -u
while [ $# -gt 0 ]; do
  case "$1" in --output) out="$2"; shift 2;; --seed) seed="$2"; shift 2;; --steps) steps="$2"; shift 2;; *) shift;; esac
done
echo "$(basename "$out")" >> "$CALLS"
[ "$(basename "$out")" = "${FAIL:-}" ] && exit 1
for i in $(seq 1 "$steps"); do echo '{"step": '"$i"', "reward": 0.'"$seed"'}'; done > "$out/steps.jsonl"
"""


def copy_repo(tmp: Path) -> Path:
    repo = tmp / "repo"
    (repo / "launch").mkdir(parents=True)
    shutil.copy(ROOT / "launch" / "trl_seeds.sh", repo / "launch")
    shutil.copytree(ROOT / "examples" / "trl_grpo", repo / "examples" / "trl_grpo",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp / "bin").mkdir()
    (tmp / "bin" / "accelerate").write_text(FAKE_ACCELERATE)
    (tmp / "bin" / "accelerate").chmod(0o755)
    return repo


def seeds(repo: Path, tmp: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "CALLS": str(tmp / "calls"), "RETRIES": "1", "PAUSE": "0", "STEPS": "3", "KEPT": str(tmp / "kept"),
               "PYTHON": sys.executable, "PATH": os.pathsep.join([str(tmp / "bin"), os.environ["PATH"]]), **env}
    return subprocess.run(["bash", "launch/trl_seeds.sh"], cwd=repo, env=environ, capture_output=True, text=True,
                          timeout=300)


def test_finished_runs_are_kept_and_a_later_checkout_runs_only_what_is_not(tmp_path):
    repo = copy_repo(tmp_path)
    proc = seeds(repo, tmp_path, FAIL="dither-seed1")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "calls").read_text().split() == ["nearest-seed0", "dither-seed0", "nearest-seed1",
                                                        "dither-seed1"]
    kept = tmp_path / "kept"
    assert json.loads((kept / "runs.json").read_text()) == {
        f"{m}-seed{s}": {"steps": 3, "finished": True} for s in (0, 1) for m in ("nearest", "dither")
        if (m, s) != ("dither", 1)}
    assert (kept / "nearest-seed1.jsonl").read_text() == (repo / "runs/trl/nearest-seed1/steps.jsonl").read_text()
    # the next checkout: runs/ is gone; only the run that did not finish runs, and then all four are kept
    shutil.rmtree(repo / "runs")
    (tmp_path / "calls").unlink()
    proc = seeds(repo, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "calls").read_text().split() == ["dither-seed1"]
    assert json.loads((kept / "runs.json").read_text())["dither-seed1"] == {"steps": 3, "finished": True}
    assert "| 1 | 3 | +0.000 | +0.000 |" in (kept / "table.md").read_text()
