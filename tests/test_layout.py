"""The package's layout, read from the files (tests/package_scan.py), against the map in docs/layout.md:
no module at the package root but ``__init__.py``; each folder imports only the folders its row allows
(lazy public names count as imports); no import cycle; no framework import outside the integrations;
no library module outside the mode registry, the config and the oracle tells modes apart by name."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from package_scan import (
    PACKAGE,
    ROOT,
    cycles_in,
    folder_of,
    import_graph,
    imported,
    lazy_table,
    lazy_targets,
    modules,
    within,
)

INTEGRATIONS = ("faircast_ds.deepspeed", "faircast_ds.megatron")
FRAMEWORKS = ("deepspeed", "megatron")
# may import a framework: the integrations themselves (the model builders, ZeRO-3's zero.Init build and the
# benchmark workers launched under DeepSpeed live beside the package, in faircast_bench/: BESIDE)
MAY_IMPORT_A_FRAMEWORK = INTEGRATIONS


def layout_map(text: str) -> dict[str, set[str]]:
    """docs/layout.md's map: ``| `folder/` | may import: `a/`, `b/` | what |`` rows -> {folder: {a, b}}."""
    rows = {}
    for folder, allowed in re.findall(r"^\| `(\w+)/` \| ([^|]*) \|", text, re.M):
        rows[folder] = set(re.findall(r"`(\w+)/`", allowed))
    return rows


def test_the_map_reader_reads_rows():
    text = "| folder | may import | what |\n|---|---|---|\n| `cast/` | nothing | x |\n| `shard/` | `cast/`, `_util/` | y |\n"
    assert layout_map(text) == {"cast": set(), "shard": {"cast", "_util"}}


def full_graph() -> dict[str, set[str]]:
    """Every import, function-level ones and lazy public names included."""
    graph, known = import_graph(function_level=True), modules()
    for name, path in known.items():
        if path.name == "__init__.py":
            graph[name] |= {t for t in lazy_targets(path) if t in known}
    return graph


def test_no_module_at_the_package_root_but_init():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"modules at the package root: {loose}"


def test_each_folder_imports_only_what_its_row_in_docs_layout_allows():
    allowed = layout_map((ROOT / "docs" / "layout.md").read_text())
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert set(allowed) == folders, f"docs/layout.md's map and the package's folders differ: {set(allowed) ^ folders}"
    offenders = []
    for module, targets in sorted(full_graph().items()):
        source = folder_of(module)
        for target in sorted(targets):
            dest = folder_of(target)
            if source not in ("(root)", dest) and dest not in allowed[source]:
                offenders.append(f"{module} imports {target}: {source}/ may import only {sorted(allowed[source])}")
    assert not offenders, "\n".join(offenders)


def test_the_map_has_no_upward_edge():
    """The rows, read as a graph of folders, have no cycle: each folder sits above all it may import."""
    allowed = layout_map((ROOT / "docs" / "layout.md").read_text())
    assert not cycles_in({f: {t for t in ts if t in allowed} for f, ts in allowed.items()})


def test_the_scan_sees_function_level_and_relative_imports():
    """The oracle itself: a function-level import and a relative one are found."""
    tree = ast.parse("def f():\n    from deepspeed.utils import logger\nfrom ..deepspeed import compat\n")
    found = [n for node in ast.walk(tree) for n in imported(node, "faircast_ds.export.served", False)]
    assert "deepspeed.utils" in found and "faircast_ds.deepspeed.compat" in found


def test_the_cycle_scan_finds_a_cycle():
    """The oracle itself: a two-module circle and a longer one are reported, a chain is not."""
    assert cycles_in({"a": {"b"}, "b": {"a"}})
    assert cycles_in({"a": {"b"}, "b": {"c"}, "c": {"a"}})
    assert not cycles_in({"a": {"b"}, "b": set()})


def test_the_package_import_graph_has_no_cycle():
    """Imports between faircast_ds modules form no cycle: neither the top-level ones (what runs when a
    module is imported) nor those inside functions (a circle deferred to call time is still a circle)."""
    for function_level in (False, True):
        cycles = cycles_in(import_graph(function_level=function_level))
        assert not cycles, ("with function-level imports:\n" if function_level else "") + "\n".join(cycles)


def test_no_module_outside_the_integrations_imports_deepspeed_or_megatron():
    """Outside faircast_ds/deepspeed/ and faircast_ds/megatron/, no module imports DeepSpeed or Megatron, at any level of the file (which folder may import
    an integration is the map's business)."""
    offenders = []
    for name, path in modules().items():
        if within(name, MAY_IMPORT_A_FRAMEWORK) or name == "faircast_ds":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target in imported(node, name, path.name == "__init__.py"):
                if within(target, FRAMEWORKS):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {target}")
    assert not offenders, "\n".join(offenders)


def integration_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """Lines of ``source`` that import an integration (faircast_ds.deepspeed, faircast_ds.megatron): import
    statements at any level of the file, relative ones resolved, and ``importlib.import_module`` /
    ``__import__`` of a literal name."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        targets = imported(node, module, is_package)
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and (
                    getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) in (
                        "import_module", "__import__")):
            targets = [node.args[0].value]
        hits += [f"{node.lineno}: {t}" for t in targets if within(t, INTEGRATIONS)]
    return sorted(set(hits))


def test_the_integration_import_scan_finds_one():
    source = ("import torch\nfrom faircast_ds.export.served import ParamSpec\n"
              "def f():\n    from faircast_ds.deepspeed import reader\n"
              "def g():\n    import importlib\n    return importlib.import_module('faircast_ds.megatron.reader')\n"
              "from ..deepspeed.params import full_shape\n")
    assert integration_imports(source, "faircast_ds.export.source") == [
        "4: faircast_ds.deepspeed", "4: faircast_ds.deepspeed.reader", "7: faircast_ds.megatron.reader",
        "8: faircast_ds.deepspeed.params", "8: faircast_ds.deepspeed.params.full_shape"]
    assert integration_imports("from faircast_ds.export import source\n", "faircast_ds.export.hf") == []


def test_export_imports_no_integration():
    """export/ is handed each integration's served-weight reader (``faircast_ds.export.source.provide``, called
    by the attach): it never imports faircast_ds.deepspeed or faircast_ds.megatron, at any level of a file,
    through a lazy public name or by importlib, so nothing there depends on an integration or its import order."""
    offenders = []
    for name, path in modules().items():
        if not within(name, ("faircast_ds.export",)):
            continue
        offenders += [f"{path.relative_to(ROOT)}:{hit}"
                      for hit in integration_imports(path.read_text(), name, path.name == "__init__.py")]
        if path.name == "__init__.py":
            offenders += [f"{path.relative_to(ROOT)}: lazy {t}" for t in lazy_targets(path) if within(t, INTEGRATIONS)]
    assert not offenders, "\n".join(offenders)


def test_nothing_but_megatron_compat_reads_the_megatron_release():
    """Megatron's release check lives in faircast_ds/megatron/compat.py, as DeepSpeed's does in its compat."""
    offenders = [str(path.relative_to(ROOT)) for name, path in modules().items()
                 if name != "faircast_ds.megatron.compat" and ("package_info" in path.read_text()
                                                              or "VERIFIED_MEGATRON" in path.read_text())]
    assert offenders == [], offenders


def test_deepspeed_and_megatron_name_their_roles_alike():
    """One name per role in both integrations (docs/layout.md)."""
    for integration in ("deepspeed", "megatron"):
        present = {p.stem for p in (PACKAGE / integration).glob("*.py")}
        missing = {"attachment", "hook", "checkpoint", "guard", "compat", "support"} - present
        assert not missing, f"faircast_ds/{integration}/ lacks {sorted(missing)}"


BUILT_IN_MODES = {"nearest", "stochastic", "dither", "error_feedback"}  # spelled here: the scan's own list
MAY_NAME_MODES = ("faircast_ds.casting", "faircast_ds.config")  # the registry, the rules, the oracle, the config


def _literals(node: ast.AST) -> set[str]:
    """The string literals a comparison operand spells: one constant, or a tuple, list or set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_literals(e) for e in node.elts)) if node.elts else set()
    return set()


def literal_comparisons(source: str, names: set[str] | frozenset[str]) -> list[int]:
    """Lines where a comparison (==, !=, in, not in) has one of ``names`` as a literal on either side."""
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Compare)
            and (_literals(node.left).union(*(_literals(c) for c in node.comparators)) & names)]


def mode_name_comparisons(source: str) -> list[int]:
    """Lines where a comparison has a built-in mode's name as a literal on either side."""
    return literal_comparisons(source, BUILT_IN_MODES)


def test_the_mode_scan_finds_comparisons():
    assert mode_name_comparisons('if cfg.mode == "error_feedback":\n    pass\nx = m in ("dither", "x")\n') == [1, 3]
    assert mode_name_comparisons('GOALS = {"dither": 1}\nif spec(m).residual:\n    pass\n') == []


def test_no_library_module_outside_the_registry_and_the_config_tells_modes_apart_by_name():
    """What a mode means is asked of its spec (faircast_ds.casting.modes), never of its name."""
    offenders = [f"{path.relative_to(ROOT)}:{line}" for name, path in modules().items()
                 if not within(name, MAY_NAME_MODES) for line in mode_name_comparisons(path.read_text())]
    assert not offenders, "compare a mode's spec, not its name:\n" + "\n".join(offenders)


def test_no_submodule_shadows_a_public_name_of_its_package():
    """Importing ``pkg.x`` sets the attribute ``pkg.x`` to the module: a package whose public name (a lazy
    one, or a function or class its ``__init__`` defines) is also a submodule's name loses that name."""
    clashes = []
    for init in PACKAGE.rglob("__init__.py"):
        tree = ast.parse(init.read_text())
        public = set(lazy_table(init)) | {n.name for n in tree.body
                                     if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))}
        parts = {p.stem for p in init.parent.glob("*.py")} | {p.name for p in init.parent.iterdir() if p.is_dir()}
        clashes += [f"{init.parent.relative_to(ROOT)}/: {name}" for name in sorted(public & parts)]
    assert not clashes, clashes


PUSH_PATH = ("faircast_ds._util", "faircast_ds.export", "faircast_ds.vllm")  # the cast's bits on their way to an engine


def private_imports(source: str, module: str) -> list[str]:
    """``from faircast_ds.x import _name`` in ``source`` where ``faircast_ds.x`` is not ``module`` itself."""
    return [f"{node.lineno}: from {node.module} import {alias.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("faircast_ds")
            and node.module != module for alias in node.names if alias.name.startswith("_")]


def test_the_private_import_scan_finds_one():
    assert private_imports("def f():\n    from faircast_ds.vllm.engine_weights import _x, y\n", "faircast_ds.a") == [
        "2: from faircast_ds.vllm.engine_weights import _x"]
    assert private_imports("from faircast_ds.vllm.engine_weights import read_back\n", "faircast_ds.a") == []


def test_the_push_path_imports_no_private_name_across_modules():
    """A helper two modules of the push path share is public in the module that owns it."""
    offenders = [f"{path.relative_to(ROOT)}:{hit}" for name, path in modules().items() if within(name, PUSH_PATH)
                 for hit in private_imports(path.read_text(), name)]
    assert not offenders, "\n".join(offenders)


def fused_layer_literals(source: str) -> list[int]:
    """Lines where a string literal in code (not a docstring) names a vLLM fused layer."""
    tree = ast.parse(source)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docstrings and re.search(r"\b(qkv_proj|gate_up_proj)\b", n.value)]


def test_the_fused_literal_scan_finds_one():
    assert fused_layer_literals('"""qkv_proj in a docstring"""\nX = {"qkv_proj": 1}\n') == [2]


def test_only_vllm_fused_names_the_fused_layers():
    """The HF<->vLLM names of fused layers are written once, in faircast_ds/vllm/fused.py."""
    offenders = [f"{path.relative_to(ROOT)}:{line}" for name, path in modules().items()
                 if within(name, ("faircast_ds.vllm",)) and name != "faircast_ds.vllm.fused"
                 for line in fused_layer_literals(path.read_text())]
    assert not offenders, offenders


def shadowing_names(tests: Path, installed: set[str]) -> list[str]:
    """Every folder or module under ``tests`` named like an installed top-level package or a standard-library
    module. pytest's default import mode puts each test folder on ``sys.path`` (the suite has no
    ``__init__.py``), and the workers under tests/dist/ run with their own folder first, so such a name can
    shadow the real package: a folder named after a namespace package (megatron-core's ``megatron``) joins it
    and comes first in its search path."""
    found = []
    for folder in [tests, *sorted(p for p in tests.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        for child in sorted(folder.iterdir()):
            name = child.stem if child.suffix == ".py" else child.name if child.is_dir() else None
            if name in installed and name != "__pycache__":
                found.append(str(child.relative_to(tests.parent)))
    return found


def installed_top_level_names() -> set[str]:
    import sys
    from importlib.metadata import packages_distributions

    return set(packages_distributions()) | set(sys.stdlib_module_names)


def test_the_shadow_scan_finds_a_folder_and_a_module(tmp_path):
    (tmp_path / "tests" / "megatron").mkdir(parents=True)
    (tmp_path / "tests" / "dist").mkdir()
    (tmp_path / "tests" / "dist" / "json.py").write_text("")
    (tmp_path / "tests" / "dist" / "worker.py").write_text("")
    assert shadowing_names(tmp_path / "tests", {"megatron", "json"}) == ["tests/megatron", "tests/dist/json.py"]


def test_the_installed_names_include_the_frameworks_the_suite_imports():
    names = installed_top_level_names()
    assert {"deepspeed", "megatron", "vllm", "transformers", "torch", "json"} <= names


def test_no_test_folder_or_module_shadows_an_installed_package():
    found = shadowing_names(ROOT / "tests", installed_top_level_names())
    assert found == [], f"named like an installed package or a standard-library module (rename them): {found}"


# the names ServedPush(plane=...) and the engine's init_info take, and those they took once (tcp)
PLANE_NAMES = frozenset({"shm", "net", "group", "tcp"})
MAY_NAME_PLANES = ("faircast_ds.vllm.transfer.planes",)  # the registry that builds each plane's two ends


def plane_name_comparisons(source: str) -> list[int]:
    """Lines where a comparison has a push plane's name as a literal on either side."""
    return sorted(literal_comparisons(source, PLANE_NAMES))


def test_the_plane_scan_finds_comparisons():
    route = ('if self.plane == "group":\n    self.writer.close()\n'
             'fd = recv() if self.transport == "shm" else None\n'
             'ok = plane not in ("shm", "net")\n'
             'x = "net" != way\n')
    assert plane_name_comparisons(route) == [1, 3, 4, 5]
    assert plane_name_comparisons('PLANES = {"shm": 1}\nway.writer.failed()\ntransport = "net"\n'
                                  'if kind == "sends":\n    pass\n') == []


def test_the_scan_knows_every_plane_the_registry_builds():
    from faircast_ds.vllm.transfer.planes import NAMES, RETIRED

    assert set(NAMES) | set(RETIRED) == PLANE_NAMES


def test_no_module_outside_the_plane_registry_tells_planes_apart_by_name():
    """What a plane does is asked of its ends or its record (faircast_ds.vllm.transfer.planes), never of its name."""
    offenders = [f"{path.relative_to(ROOT)}:{line}" for name, path in modules().items()
                 if not within(name, MAY_NAME_PLANES) for line in plane_name_comparisons(path.read_text())]
    assert not offenders, "ask the plane (faircast_ds/vllm/transfer/planes.py), not its name:\n" + "\n".join(offenders)


BESIDE = ("faircast_jobs", "faircast_bench", "faircast_prepared")  # the folders beside the package, not installed


def imports_of_folders_beside(source: str) -> list[int]:
    """The lines of ``source`` that import a folder beside the package (any import, function-level too)."""
    tree = ast.parse(source)
    return [node.lineno for node in ast.walk(tree)
            if any(within(target, BESIDE) for target in imported(node, "x", False))]


def test_the_beside_scan_finds_an_import():
    assert imports_of_folders_beside("def f():\n    from faircast_prepared import buckets\n") == [2]
    assert imports_of_folders_beside("import faircast_jobs.grpo\n") == [1]
    assert imports_of_folders_beside("from faircast_ds.export import plane\n") == []


def test_the_installed_package_imports_nothing_beside_it():
    """The GRPO jobs (faircast_jobs), the benchmarks (faircast_bench) and the GPU code prepared for no push yet
    (faircast_prepared: the bucket planner and stream) are not installed: no module of the package may import
    them, so the push path stays readable without them and an installed package without a checkout loads."""
    offenders = [f"{path.relative_to(ROOT)}:{line}" for path in modules().values()
                 for line in imports_of_folders_beside(path.read_text())]
    assert not offenders, offenders
    assert {"buckets", "bucket_stream"} <= {p.stem for p in (ROOT / "faircast_prepared").glob("*.py")}


# ---- one meaning per name (docs/layout.md, "One meaning per name") ---------------------------------------

# a module or folder named so lives in this one folder only
ONE_HOME = {"source": "faircast_ds.export", "kernels": "faircast_ds.casting", "routes": "faircast_ds.shard"}
# "route" is the way a refresh reaches the cast (runtime or hook, faircast_ds/shard/routes.py); the push
# side names an engine setup, an HTTP endpoint or a push, never a route
NO_ROUTE_WORD = ("faircast_ds.vllm", "faircast_ds.export")
ROUTE_WORD = re.compile(r"\broute(s|d)?\b", re.I)


def homes_elsewhere(names: dict[str, Path]) -> list[str]:
    """Modules (``x.py`` or the package ``x/``) whose last name is in ONE_HOME outside its one folder."""
    out = []
    for name in names:
        parent, _, last = name.rpartition(".")
        if last in ONE_HOME and parent != ONE_HOME[last]:
            out.append(name)
    return out


def route_word_lines(source: str) -> list[int]:
    return [i for i, text in enumerate(source.splitlines(), 1) if ROUTE_WORD.search(text)]


def test_the_name_scans_find_offenders():
    assert homes_elsewhere({"faircast_ds.vllm.kernels": Path(), "faircast_ds.casting.kernels": Path(),
                            "faircast_ds.config.source": Path(), "faircast_ds.export.source": Path()}) == [
        "faircast_ds.vllm.kernels", "faircast_ds.config.source"]
    assert route_word_lines("a\nthe colocated Route:\nroutes\nrouter\nrouted\nen route") == [2, 3, 5, 6]


def test_each_of_route_source_kernels_means_one_thing():
    """``source`` is the served-weight source (export/), ``kernels`` the compute kernels of the cast
    (casting/), ``routes`` the ways a refresh reaches the cast (shard/); the push side never says route."""
    found = modules()
    assert not homes_elsewhere(found), homes_elsewhere(found)
    offenders = [f"{path.relative_to(ROOT)}:{line}" for name, path in found.items() if within(name, NO_ROUTE_WORD)
                 for line in route_word_lines(path.read_text())]
    assert not offenders, "the push side says setup, endpoint or push, not route:\n" + "\n".join(offenders)


FACE_BUDGET = 80  # every package's public names together (96 before issue 48 trimmed export's face to 9)


def test_every_public_name_resolves_and_the_faces_stay_small():
    """Each package's ``__all__`` names what it gives (every name resolves, lazy or not); export's face is the
    nine names a user needs (the rest are its modules'), and all faces together stay within the budget."""
    import importlib

    sizes, missing = {}, []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        name = ".".join(init.parent.relative_to(ROOT).parts)
        module = importlib.import_module(name)
        names = getattr(module, "__all__", [])
        sizes[name] = len(names)
        missing += [f"{name}.{n}" for n in names if not hasattr(module, n)]
    assert not missing, missing
    assert sizes["faircast_ds.export"] <= 9, sizes["faircast_ds.export"]
    assert sum(sizes.values()) <= FACE_BUDGET, sizes
