"""The docs match the code: every path, module, class and function name README.md, docs/, the package's
docstrings and setup.py's comments mention exists; the README's banner is what the banner prints."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from package_scan import ROOT, modules


DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}


def test_the_readme_banner_example_is_what_the_banner_prints():
    from faircast_ds.config.section import FairCastConfig
    from faircast_ds.shard.adapter import Adapter, Setup
    from faircast_ds.shard.caster import ShardCaster, ShardSlice
    from faircast_ds.shard.handle import FairCast

    class ZeroThree(Adapter):  # what a ZeRO-3 adapter tells the banner, 12544 elements on rank 0
        setup = Setup.of(zero_stage=3)

        def install(self):
            pass

        def publish(self):
            pass

        def flat_groups(self):
            yield 0, None, None, [ShardSlice("w", 0, 12544, 0)]

    example = re.search(r"^\[fair_cast\] active: .*$", (ROOT / "README.md").read_text(), re.M).group(0)
    values = dict(kv.split("=", 1) for kv in example.split("active: ", 1)[1].split())
    config = FairCastConfig(mode=values["mode"], seed=int(values["seed"]), on_nonfinite=values["on_nonfinite"])
    adapter = ZeroThree(object(), ShardCaster(config), {})
    banner = FairCast(config, [adapter], values["route"], source=values["source"]).banner()
    assert banner == example


def named_paths(doc: Path) -> list[tuple[str, Path]]:
    """(as written, the path it names) for every repository path in a backtick span or a link target."""
    text = doc.read_text()
    found = []
    for span in re.findall(r"`([^`\n]+)`", text):
        for word in re.split(r"[\s,]+", span):
            word = word.split("::")[0].rstrip(".:;)")
            if "/" in word and word.split("/")[0] in TOP and re.fullmatch(r"[\w.\-/*]+", word):
                found.append((word, ROOT / word))
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        target = target.split("#")[0]
        if target and "://" not in target and not target.startswith("mailto:"):
            found.append((target, (doc.parent / target).resolve()))
    return found


def test_the_scan_finds_the_paths_a_doc_names(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("see `faircast_ds/nowhere.py::f` and [here](../docs/none.md#a), `tests/dist/` too")
    assert [w for w, _ in named_paths(doc)] == ["faircast_ds/nowhere.py", "tests/dist/", "../docs/none.md"]


def test_every_repository_path_the_docs_name_exists():
    missing = []
    for doc in DOCS:
        for written, path in named_paths(doc):
            exists = any(path.parent.glob(path.name)) if "*" in path.name else path.exists()
            if not exists:
                missing.append(f"{doc.relative_to(ROOT)}: {written}")
    assert not missing, "\n".join(missing)


def top_level_names(path: Path) -> set[str]:
    """What a module defines or imports at its top level (a package also its lazy ``_LAZY`` names)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    lazy = re.search(r"_LAZY = \{(.*?)\}", path.read_text(), re.S)
    if lazy:
        names.update(re.findall(r'"(\w+)":', lazy.group(1)))
    return names


def test_every_module_and_name_the_docs_spell_with_dots_exists():
    """``faircast_ds.a.b.name`` in a doc: the longest prefix is a module, and the next part a name it has."""
    known, missing = modules(), []
    for doc in DOCS + [ROOT / "patches" / "README.md"]:
        for span in re.findall(r"`([^`\n]+)`", doc.read_text()):
            for dotted in re.findall(r"\bfaircast_ds(?:\.\w+)+", span):
                parts = dotted.split(".")
                k = next(k for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in known)
                if k < len(parts) and parts[k] not in top_level_names(known[".".join(parts[:k])]):
                    missing.append(f"{doc.relative_to(ROOT)}: {dotted}")
    assert not missing, "\n".join(missing)
