"""The runtime route: Fair Cast on an unmodified DeepSpeed, config -> caster -> adapter -> shard.

``install()`` wraps ``DeepSpeedEngine.__init__`` so that every engine whose config has a
``fair_cast`` section is attached as it is built (the interpreter-start hook calls it for you).
``attach(engine)`` does the same for one engine explicitly. The adapter replaces the optimizer's
refresh sites; this module adds periodic diagnostics after ``engine.step``, and
``checkpointing`` puts Fair Cast's state in every ``save_checkpoint`` / ``load_checkpoint``.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

from faircast_ds import dist
from faircast_ds.config import FairCastConfig, find_section
from faircast_ds.deepspeed.adapters import make_adapter
from faircast_ds.deepspeed.support import check_supported, engine_config, raw_config
from faircast_ds.handle import FairCast, build, get_fair_cast, resolve
from faircast_ds.shard_caster import ShardCaster

ROUTE = "deepspeed-runtime"

__all__ = ["FairCast", "attach", "get_fair_cast", "install"]


def engine_section(engine: Any) -> FairCastConfig | None:
    """The engine's own ``fair_cast`` section, validated (None when absent)."""
    return find_section(raw_config(engine_config(engine)))


def model_numel(engine: Any) -> int:
    """Elements of the whole model (ZeRO-3 parameters counted at full size)."""
    from faircast_ds.deepspeed.params import full_numel

    return sum(full_numel(p) for p in engine.module.parameters())


def attach(engine: Any, config: FairCastConfig | Mapping[str, Any] | None = None) -> FairCast | None:
    """Attach Fair Cast to a built DeepSpeed engine.

    ``config`` defaults to the engine's own ``fair_cast`` section. Returns None when there is no
    section or it says ``enabled: false``. Raises FairCastConfigError for a malformed section and
    UnsupportedSetupError for a setup we cannot route through the cast.
    """
    existing = get_fair_cast(engine)
    if existing is not None:
        return existing
    config = resolve(engine_section(engine) if config is None else config)
    if config is None:
        return None
    check_supported(engine_config(engine))
    adapter = make_adapter(engine, ShardCaster(config))
    fair_cast = build(config, [adapter], route=ROUTE, owner=engine, connect=lambda a: a.install(),
                      module=engine.module, model_numel=model_numel(engine))
    wire_engine(engine, fair_cast)
    return fair_cast


def wire_engine(engine: Any, fair_cast: FairCast) -> None:
    """What every DeepSpeed route adds to the engine: periodic diagnostics after ``engine.step`` and
    Fair Cast's state in its checkpoints."""
    from faircast_ds.deepspeed.checkpointing import wrap_checkpointing

    if fair_cast.diagnostics is not None:
        _wrap_step_for_diagnostics(engine, fair_cast)
    wrap_checkpointing(engine, fair_cast)


def _wrap_step_for_diagnostics(engine: Any, fair_cast: FairCast) -> None:
    """After every ``every``-th optimizer step: reduce the figures, log one line, feed DeepSpeed's monitor."""
    step = engine.step
    every = fair_cast.config.diagnostics.every
    reported = {"step": -1}

    @functools.wraps(step)
    def step_and_report(*args: Any, **kwargs: Any) -> Any:
        result = step(*args, **kwargs)
        now = fair_cast.caster.step
        if now != reported["step"] and now % every == 0:
            reported["step"] = now
            figures = fair_cast.report()
            if fair_cast.config.diagnostics.log:
                dist.log_rank0(f"[fair_cast] step {now}: served changed {100 * figures['changed_fraction']:.3f}% | "
                               f"gap {figures['gap_spacings']:.3f} spacings | lag {figures['lag_steps']:.0f} steps")
            monitor = getattr(engine, "monitor", None)
            if monitor is not None and getattr(monitor, "enabled", False):
                monitor.write_events([(f"fair_cast/{k}", v, now) for k, v in figures.items() if k != "step"])
        return result

    engine.step = step_and_report


def install() -> None:
    """Wrap ``DeepSpeedEngine.__init__`` so engines with a ``fair_cast`` section attach themselves.
    Idempotent."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine.__init__
    if getattr(original, "_faircast_wrapped", False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        config = None
        parsed = kwargs.get("config_class")  # deepspeed.initialize parses the config before the engine
        if parsed is not None:
            config = find_section(raw_config(parsed))  # a malformed section fails here, in seconds
            if config is not None and config.enabled:
                check_supported(parsed)
        original(self, *args, **kwargs)
        attach(self, config)

    __init__._faircast_wrapped = True  # type: ignore[attr-defined]
    DeepSpeedEngine.__init__ = __init__  # type: ignore[method-assign]
