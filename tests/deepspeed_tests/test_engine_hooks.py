"""EngineHooks, checked without DeepSpeed or a launch: one hooks object per engine runs its hooks in the
documented order and wraps each method once; the hook route connects only the adapter registered under it."""
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
    from faircast_ds.config.section import FairCastConfig
    from faircast_ds.deepspeed import attachment as runtime
    from faircast_ds.deepspeed import checkpoint as checkpointing
    from faircast_ds.deepspeed import engine_hooks as hooks_mod
    from faircast_ds.shard.caster import ShardCaster

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


def test_the_deepspeed_hook_route_connects_only_the_adapter_registered_under_it(monkeypatch):
    from faircast_ds.config.section import FairCastConfig
    from faircast_ds.deepspeed import hook
    from faircast_ds.shard.caster import ShardCaster
    from faircast_ds.shard.routes import DEEPSPEED_RUNTIME, ROUTES, Route

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
