"""The package's structure, checked without DeepSpeed or a launch: one hooks object per engine runs its
hooks in the documented order and wraps each method once."""
from __future__ import annotations

import types

import pytest

from faircast_ds.deepspeed.engine_hooks import METHODS, EngineHooks


class Engine:
    """A stand-in with the four methods EngineHooks replaces; each notes its call in ``calls``."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def step(self, n: int = 1) -> str:
        self.calls.append(f"step({n})")
        return "stepped"

    def save_checkpoint(self, save_dir: str, tag=None) -> None:
        self.calls.append(f"save({save_dir},{tag})")

    def load_checkpoint(self, load_dir: str, tag=None) -> tuple:
        self.calls.append(f"load({load_dir},{tag})")
        return (load_dir, {})

    def load_module_state_dict(self, checkpoint: dict) -> None:
        self.calls.append("load_module")


def test_hooks_run_before_around_after_in_registration_order_and_wrap_once():
    engine = Engine()
    hooks = EngineHooks.of(engine)
    dispatchers = {m: getattr(engine, m) for m in METHODS}
    assert EngineHooks.of(engine) is hooks  # a second route or attach: the same object ...
    assert {m: getattr(engine, m) for m in METHODS} == dispatchers  # ... and no second wrapper
    note = engine.calls.append

    def around(tag):
        def fn(call, *args, **kwargs):
            note(f"{tag}>")
            result = call(*args, **kwargs)
            note(f"<{tag}")
            return result
        return fn

    hooks.after("step", "a", "", lambda result, *a, **k: note(f"after-a:{result}"))
    hooks.before("step", "b", "", lambda *a, **k: note(f"before-b:{a}"))
    hooks.around("step", "outer", "", around("outer"))
    hooks.around("step", "inner", "", around("inner"))
    hooks.after("step", "c", "", lambda result, *a, **k: note("after-c"))
    hooks.before("step", "d", "", lambda *a, **k: note("before-d"))
    assert engine.step(3) == "stepped"
    assert engine.calls == ["before-b:(3,)", "before-d", "outer>", "inner>", "step(3)", "<inner", "<outer",
                            "after-a:stepped", "after-c"]
    assert hooks.describe()[:3] == ["engine.step: before b: ", "engine.step: before d: ", "engine.step: around outer: "]
    with pytest.raises(RuntimeError, match="already has a after hook on engine.step"):
        hooks.after("step", "a", "", lambda result: None)
    with pytest.raises(ValueError, match="not hooked"):
        hooks.before("forward", "a", "", lambda: None)


def test_an_around_hook_may_rewrite_the_arguments_of_the_inner_call():
    engine = Engine()
    hooks = EngineHooks.of(engine)
    hooks.around("load_checkpoint", "x", "", lambda call, load_dir, tag=None: call(load_dir, tag or "latest-tag"))
    assert engine.load_checkpoint("d") == ("d", {})
    assert engine.calls == ["load(d,latest-tag)"]
    assert hooks.original("load_checkpoint").__self__ is engine  # DeepSpeed's bound method, kept


def test_wire_engine_registers_diagnostics_checkpoint_state_and_guard_in_the_documented_order(monkeypatch):
    """What runs around engine.step is what faircast_ds.deepspeed.engine_hooks' docstring lists."""
    from faircast_ds.config import FairCastConfig
    from faircast_ds.deepspeed import save_load as checkpointing, attachment as runtime, engine_hooks as hooks_mod
    from faircast_ds.shard_caster import ShardCaster

    monkeypatch.setattr(checkpointing, "_route_fp32_reads_to_the_loaded_tag", lambda: None)  # DeepSpeed's module
    adapter = types.SimpleNamespace(caster=ShardCaster(FairCastConfig(mode="stochastic", seed=1)),
                                    optimizer=object(), flat_groups=lambda: iter(()), cast_sites="test sites")
    fair_cast = types.SimpleNamespace(adapter=adapter, caster=adapter.caster, diagnostics=object(), extras={},
                                      config=FairCastConfig(mode="stochastic", seed=1))
    engine = Engine()
    hooks = runtime.wire_engine(engine, fair_cast)
    owners = [line.split(":")[0] + ":" + line.split(":")[1] for line in hooks.describe()]
    assert owners == ["engine.step: before guard", "engine.step: after diagnostics", "engine.step: after guard",
                      "engine.save_checkpoint: around checkpoint state",
                      "engine.load_checkpoint: before guard", "engine.load_checkpoint: around checkpoint state",
                      "engine.load_checkpoint: after guard",
                      "engine.load_module_state_dict: around checkpoint state"]
    doc = " ".join(hooks_mod.__doc__.split())
    for text in ("``engine.step``: before: guard", "after: diagnostics", "then guard",
                 "``engine.save_checkpoint``: around: checkpoint state",
                 "``engine.load_checkpoint``: before: guard (full record buffers); around: checkpoint state",
                 "after: guard (full check", "``engine.load_module_state_dict``: around: checkpoint state"):
        assert text in doc
    assert [type(o).__name__ for o in adapter.caster.observers] == ["Guard"]  # diagnostics' is added by build()


# ---- the neutral core and the import graph ------------------------------------------------------------
import ast  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "faircast_ds"
INTEGRATIONS = ("faircast_ds.deepspeed", "faircast_ds.megatron")
FRAMEWORKS = ("deepspeed", "megatron")
# may import a framework: the integrations themselves, the GRPO job and the benchmarks (bench.py and its model
# worker, launched under DeepSpeed); the shared model builder does not (ZeRO-3's zero.Init build is
# faircast_ds/deepspeed/models.py)
MAY_IMPORT_A_FRAMEWORK = INTEGRATIONS + ("faircast_ds.jobs", "faircast_ds.bench", "faircast_ds.bench_model_worker",
                                          "faircast_ds.bench_push_worker")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The absolute names one import statement imports (``from a import b``: ``a.b`` and ``a``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolved against this module's package
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            origin = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = node.module or ""
        return [origin] + [f"{origin}.{alias.name}" for alias in node.names]
    return []


def test_the_scan_sees_function_level_and_relative_imports():
    """The oracle itself: a function-level import and a relative one are found."""
    tree = ast.parse("def f():\n    from deepspeed.utils import logger\nfrom ..deepspeed import compat\n")
    found = [n for node in ast.walk(tree) for n in imported(node, "faircast_ds.export.served", False)]
    assert "deepspeed.utils" in found and "faircast_ds.deepspeed.compat" in found


def test_no_core_module_imports_deepspeed_or_megatron():
    """Outside faircast_ds/deepspeed/ and faircast_ds/megatron/ (and the job and benchmark, which run
    DeepSpeed), no module imports DeepSpeed, Megatron or their integrations, at any level of the file."""
    offenders = []
    for name, path in modules().items():
        if within(name, MAY_IMPORT_A_FRAMEWORK):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target in imported(node, name, path.name == "__init__.py"):
                if within(target, FRAMEWORKS) or within(target, INTEGRATIONS):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {target}")
    assert not offenders, "\n".join(offenders)


def import_graph(*, function_level: bool) -> dict[str, set[str]]:
    """faircast_ds module -> the faircast_ds modules it imports (a module's own parent packages left out:
    they are loaded before it). ``function_level``: imports inside functions count too."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        edges = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in (ast.walk(tree) if function_level else tree.body):
            targets = imported(node, name, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom):  # ``from pkg import sub``: the submodule; ``from m import x``: m
                origin, names = targets[0], targets[1:]
                targets = [t for t in names if t in known] + ([origin] if any(t not in known for t in names) else [])
            edges.update(t for t in targets if t in known and t != name and not name.startswith(t + "."))
        graph[name] = edges
    return graph


def cycles_in(graph: dict[str, set[str]]) -> list[str]:
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [node, nxt]) if nxt in stack
                              else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, stack + [node])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return cycles


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


# ---- routes -----------------------------------------------------------------------------------------------

def test_one_route_type_for_both_frameworks():
    from faircast_ds import routes

    assert routes.resolve_choice("auto", has_hook=lambda: True) == "hook"
    assert routes.resolve_choice("auto", has_hook=lambda: False) == "runtime"
    assert routes.resolve_choice("runtime", has_hook=lambda: True) == "runtime"
    with pytest.raises(ValueError, match="route must be one of 'auto', 'runtime', 'hook', got 'patched'"):
        routes.resolve_choice("patched", has_hook=lambda: True)
    assert {routes.kind(f, c) for f in ("deepspeed", "megatron") for c in ("runtime", "hook")} == set(routes.KINDS)
    with pytest.raises(ValueError, match="unknown route kind 'deepspeed-runtim'"):
        routes.Route(adapter=None, kind="deepspeed-runtim")


def test_every_route_is_named_from_the_route_type():
    """No module spells a route kind out as a string literal but routes.py."""
    from faircast_ds import routes

    offenders = []
    for name, path in modules().items():
        if name == "faircast_ds.routes":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in routes.KINDS:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not offenders, offenders


def test_the_deepspeed_hook_route_connects_only_the_adapter_registered_under_it(monkeypatch):
    from faircast_ds.config import FairCastConfig
    from faircast_ds.deepspeed import cast_hook as hook
    from faircast_ds.routes import DEEPSPEED_RUNTIME, ROUTES, Route
    from faircast_ds.shard_caster import ShardCaster

    class Optimizer:
        pass

    monkeypatch.setattr(hook, "require_hook", lambda: None)  # as on a patched DeepSpeed
    monkeypatch.setattr(hook, "_install_hook", lambda: pytest.fail("connected an adapter not registered under the route"))
    adapter = types.SimpleNamespace(optimizer=Optimizer(), caster=ShardCaster(FairCastConfig(mode="dither")))
    with pytest.raises(RuntimeError, match="registered: nothing"):
        hook.connect(adapter)
    ROUTES.add(adapter.optimizer, Route(adapter, DEEPSPEED_RUNTIME))
    try:
        with pytest.raises(RuntimeError, match="registered: deepspeed-runtime"):
            hook.connect(adapter)
    finally:
        ROUTES.remove(adapter.optimizer)


def test_nothing_but_megatron_compat_reads_the_megatron_release():
    """Megatron's release check lives in faircast_ds/megatron/compat.py, as DeepSpeed's does in its compat."""
    offenders = [str(path.relative_to(ROOT)) for name, path in modules().items()
                 if name != "faircast_ds.megatron.compat" and ("package_info" in path.read_text()
                                                              or "VERIFIED_MEGATRON" in path.read_text())]
    assert offenders == [], offenders


# ---- the docs match the code ------------------------------------------------------------------------------
import re  # noqa: E402

DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}


def test_the_readme_banner_example_is_what_the_banner_prints():
    from faircast_ds.adapter import Adapter, Setup
    from faircast_ds.config import FairCastConfig
    from faircast_ds.handle import FairCast
    from faircast_ds.shard_caster import ShardCaster, ShardSlice

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
