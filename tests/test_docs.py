"""The docs match the code: every path, module, class and function name README.md, docs/, the package's
docstrings and setup.py's comments mention exists; the README's banner is what the banner prints."""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from package_scan import ROOT, lazy_table, modules

DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
# the repository's own top-level names (tracked files): a runs/ folder the main job wrote is not one of them, so
# running the job before the tests does not make the docs' `runs/<name>` examples read as missing paths
TOP = {name.split("/")[0] for name in subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                                     check=True).stdout.splitlines() if not name.startswith(".")}


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
    banner = FairCast(config, [adapter], values["route"], origin=values["origin"]).banner()
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
    return names | set(lazy_table(path))


def test_every_module_and_name_the_docs_spell_with_dots_exists():
    """``faircast_ds.a.b.name`` in a doc: the longest prefix is a module, and the next part a name it has."""
    known, missing = modules(), []
    for doc in DOCS + [ROOT / "patches" / "README.md"]:
        for span in re.findall(r"`([^`\n]+)`", doc.read_text()):
            missing += [f"{doc.relative_to(ROOT)}: {dotted}" for dotted in re.findall(r"\bfaircast_ds(?:\.\w+)+", span)
                        if not resolve_dotted(dotted, known)]
    assert not missing, "\n".join(missing)


# ---- docstrings and setup.py's comments -------------------------------------------------------------------

def docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of a module's docstring and of each class's and function's."""
    tree = ast.parse(path.read_text())
    out = []
    for node in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]:
        doc = ast.get_docstring(node, clean=False)
        if doc:
            out.append((getattr(node, "lineno", 1), doc))
    return out


def setup_comments() -> list[tuple[int, str]]:
    return [(i, line.split("#", 1)[1]) for i, line in enumerate((ROOT / "setup.py").read_text().splitlines(), 1)
            if "#" in line]


def texts() -> list[tuple[str, str]]:
    """(where, text) for every docstring in the package and every comment of setup.py."""
    out = [(f"setup.py:{i}", text) for i, text in setup_comments()]
    for name, path in modules().items():
        out += [(f"{path.relative_to(ROOT)}:{line}", doc) for line, doc in docstrings(path)]
    return out


def resolve_dotted(dotted: str, known: dict[str, Path]) -> bool:
    """``faircast_ds.a.b.name``: the longest prefix is a module and the next part a name it has."""
    parts = dotted.split(".")
    k = next(k for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in known)
    return k == len(parts) or parts[k] in top_level_names(known[".".join(parts[:k])])


REPO_DIRS = ("faircast_ds", "tests", "docs", "launch", "benchmarks", "configs", "patches")


def former_module_files() -> set[str]:
    """The ``name.py`` files CHANGELOG.md says were renamed or moved away: a mention of one that exists
    nowhere in the project now is stale. (Other ``name.py`` mentions that exist nowhere here are other
    projects' files: DeepSpeed's, Megatron's, vLLM's.)"""
    section = (ROOT / "CHANGELOG.md").read_text()
    return {Path(old).name for old in re.findall(r"`([\w/]+\.py)` →", section)} | {"_autoload.py", "cli.py"}


def project_files(name: str) -> bool:
    return any(any((ROOT / folder).rglob(name)) for folder in REPO_DIRS)


def stale_mentions(where: str, text: str, known: dict[str, Path], package_dir: Path | None,
                   former: set[str]) -> list[str]:
    """The module names, dotted names and repository paths ``text`` mentions that do not exist: dotted
    ``faircast_ds.…`` names, paths under the repository's folders, former module files (``name.py``) that
    exist nowhere now, and, in a package's own docstring whose bullets list its parts, each part."""
    text = re.sub(r"\]\([^)\s]*\)", "]", text)  # markdown link targets: relative to the doc (named_paths)
    bad = [f"{where}: {d}" for d in re.findall(r"\bfaircast_ds(?:\.\w+)+", text) if not resolve_dotted(d, known)]
    for path in re.findall(r"(?<![\w./-])((?:%s)/[\w./*-]*\w)(?![\w<.-])" % "|".join(REPO_DIRS), text):
        target = ROOT / path
        if not (any(target.parent.glob(target.name)) if "*" in path else target.exists()):
            bad.append(f"{where}: {path}")
    for file in re.findall(r"(?<![\w/.-])(\w+\.py)\b", text):
        if file in former and not project_files(file) and not (package_dir and (package_dir / file).exists()):
            bad.append(f"{where}: {file}")
    if package_dir is not None:
        parts = re.findall(r"^\s*-\s+``?(\w+)``?\s*[:(]", text, re.M)

        def exists(part: str) -> bool:
            return ((package_dir / f"{part}.py").exists() or (package_dir / part / "__init__.py").exists()
                    or part in top_level_names(package_dir / "__init__.py"))

        if any((package_dir / f"{part}.py").exists() or (package_dir / part).is_dir() for part in parts):
            bad += [f"{where}: part {part!r} of {package_dir.relative_to(ROOT)}/" for part in parts if not exists(part)]
    return bad


def test_the_stale_scan_finds_what_it_should(tmp_path):
    known = modules()
    text = ("- ``engine``: the attach pipeline\n- ``hook``: the cast hook\nsee faircast_ds.deepspeed.nowhere and "
            "faircast_ds/_autoload.py, ``shard_caster.py``; faircast_ds.deepspeed.attachment.attach is fine, "
            "Megatron's ``layers.py`` is not ours, [x](modes.md) is a link")
    found = stale_mentions("x", text, known, ROOT / "faircast_ds" / "deepspeed", former_module_files())
    assert found == ["x: faircast_ds.deepspeed.nowhere", "x: faircast_ds/_autoload.py", "x: shard_caster.py", "x: part 'engine' of faircast_ds/deepspeed/"]


def test_every_name_and_path_the_docstrings_and_setup_comments_mention_exists():
    known, bad = modules(), []
    for where, text in texts():
        module_path = ROOT / where.split(":")[0]
        package_dir = module_path.parent if module_path.name == "__init__.py" and where.endswith(":1") else None
        bad += stale_mentions(where, text, known, package_dir, former_module_files())
    assert not bad, "\n".join(bad)


def test_every_path_and_py_file_the_docs_mention_exists_outside_backticks_too():
    known, bad, former = modules(), [], former_module_files()
    for doc in DOCS + [ROOT / "patches" / "README.md"]:
        text = doc.read_text()  # (the list of old names itself is CHANGELOG.md, not read here)
        bad += stale_mentions(str(doc.relative_to(ROOT)), text, known, None, former)
    assert not bad, "\n".join(bad)


def test_the_readme_stays_a_front_door():
    """What it is, the two commands, how to use it, the headline and links: at most 150 lines; the rest in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
