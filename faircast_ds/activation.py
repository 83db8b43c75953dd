"""Turning Fair Cast on for a DeepSpeed engine: config -> caster -> adapter.

``install()`` wraps ``DeepSpeedEngine.__init__`` so that every engine whose config has a
``fair_cast`` section is attached as it is built (the interpreter-start hook calls it for you).
``attach(engine)`` does the same for one engine explicitly.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from faircast_ds.adapters import Adapter, adapter_for
from faircast_ds.adapters.support import check_supported, engine_config, raw_config
from faircast_ds.checkpoint import FairCastStateError, publish_restored, reset_state, restore_state, save_state
from faircast_ds.config import FairCastConfig, find_section
from faircast_ds.diagnostics import Diagnostics
from faircast_ds.shard_caster import ShardCaster

logger = logging.getLogger("faircast_ds")
_ENGINE_ATTR = "_fair_cast"


@dataclass
class FairCast:
    """Fair Cast attached to one engine."""

    config: FairCastConfig
    caster: ShardCaster
    adapter: Adapter
    diagnostics: Diagnostics | None = None
    alignment: Any = None  # faircast_ds.align.AlignmentHandle when fair_cast.align_rounding is set

    def report(self) -> dict[str, float]:
        """S1, the master-served gap and the lag at the current step (a collective: call on every rank).
        See faircast_ds.diagnostics."""
        if self.diagnostics is None:
            raise RuntimeError("fair_cast.diagnostics.every is 0: diagnostics are off")
        return self.diagnostics.compute(self.adapter.flat_groups(), self.caster.last, self.caster.step)

    def stats(self) -> dict[str, float]:
        """The last cast's counts, summed over all ranks (a collective: call it on every rank)."""
        import deepspeed.comm as dist

        last = self.caster.last
        t = torch.tensor([last.changed, last.numel], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t)
        changed, numel = t.tolist()
        return {"step": last.step, "changed": changed, "numel": numel,
                "changed_fraction": changed / numel if numel else 0.0}


def get_fair_cast(engine: Any) -> FairCast | None:
    """The Fair Cast attached to ``engine``, or None."""
    return getattr(engine, _ENGINE_ATTR, None)


def attach(engine: Any, config: FairCastConfig | Mapping[str, Any] | None = None) -> FairCast | None:
    """Attach Fair Cast to a built DeepSpeed engine.

    ``config`` defaults to the engine's own ``fair_cast`` section. Returns None when there is no
    section or it says ``enabled: false``. Raises FairCastConfigError for a malformed section and
    UnsupportedSetupError for a setup we cannot route through the cast.
    """
    existing = get_fair_cast(engine)
    if existing is not None:
        return existing
    if config is None:
        config = find_section(raw_config(engine_config(engine)))
    elif not isinstance(config, FairCastConfig):
        config = FairCastConfig.from_section(config)
    if config is None:
        return None
    if not config.enabled:
        _log_rank0("[fair_cast] disabled by config (fair_cast.enabled=false): serving round-to-nearest")
        return None
    caster = ShardCaster(config)
    adapter = adapter_for(engine, caster)
    fair_cast = FairCast(config, caster, adapter)
    _prepare_kernels(adapter)
    if config.diagnostics.every > 0:
        model_numel = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
        fair_cast.diagnostics = caster.observer = Diagnostics(config.diagnostics, model_numel)
        _wrap_step_for_diagnostics(engine, fair_cast)
    if config.align_rounding is not None:
        from faircast_ds.align import apply_from_config

        fair_cast.alignment = apply_from_config(engine.module, config.align_rounding)
    setattr(engine, _ENGINE_ATTR, fair_cast)
    _wrap_checkpointing(engine, fair_cast)
    align = (f" align_rounding={config.align_rounding.engine}[{','.join(config.align_rounding.regions)}]"
             if config.align_rounding else "")
    _log_rank0(f"[fair_cast] active: mode={config.mode} zero_stage={adapter.zero_stage} seed={config.seed} "
               f"local_shard_elements={adapter.local_numel()} on_nonfinite={config.on_nonfinite}{align}")
    return fair_cast


def _prepare_kernels(adapter: Adapter) -> None:
    """Build the fused cast kernel for the masters' device now, not inside the first optimizer step."""
    from faircast_ds import kernels

    devices = {master.device for _, master, _, _ in adapter.flat_groups()}
    for device in devices:
        kernels.prepare(device)


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
                _log_rank0(f"[fair_cast] step {now}: served changed {100 * figures['changed_fraction']:.3f}% | "
                           f"gap {figures['gap_spacings']:.3f} spacings | lag {figures['lag_steps']:.0f} steps")
            monitor = getattr(engine, "monitor", None)
            if monitor is not None and getattr(monitor, "enabled", False):
                monitor.write_events([(f"fair_cast/{k}", v, now) for k, v in figures.items() if k != "step"])
        return result

    engine.step = step_and_report


def _wrap_checkpointing(engine: Any, fair_cast: FairCast) -> None:
    """Save Fair Cast's state with every engine checkpoint, restore it with every load."""
    save, load = engine.save_checkpoint, engine.load_checkpoint

    @functools.wraps(save)
    def save_checkpoint(save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        import deepspeed.comm as dist

        tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"  # DeepSpeed's default
        # ours first: DeepSpeed writes `latest` last, so it never names a checkpoint without our state
        save_state(fair_cast.adapter, fair_cast.caster, os.path.join(save_dir, tag),
                   rank=dist.get_rank(), world=dist.get_world_size())
        return save(save_dir, tag, *args, **kwargs)

    @functools.wraps(load)
    def load_checkpoint(load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        result = load(load_dir, tag, *args, **kwargs)
        if result is None or result[0] is None:
            return result  # nothing was loaded
        if tag is None:
            latest = "latest_universal" if engine.load_universal_checkpoint() else "latest"
            with open(os.path.join(load_dir, latest)) as f:
                tag = f.read().strip()
        tag_dir = os.path.join(load_dir, str(tag))
        given = inspect.signature(load).bind(load_dir, tag, *args, **kwargs)
        given.apply_defaults()
        optimizer_loaded = given.arguments["load_optimizer_states"] and not given.arguments["load_module_only"]
        if not optimizer_loaded:
            reset_state(fair_cast.adapter, fair_cast.caster, engine.global_steps)
            _log_rank0(f"[fair_cast] {tag_dir}: module-only load, residual starts at zero, noise step "
                       f"{engine.global_steps}")
            return result
        error = _agree(lambda: restore_state(fair_cast.adapter, fair_cast.caster, tag_dir))
        if error is None:
            publish_restored(fair_cast.adapter, fair_cast.caster)
            _log_rank0(f"[fair_cast] restored state from {tag_dir}: mode={fair_cast.config.mode} "
                       f"step={fair_cast.caster.step}")
        elif fair_cast.config.on_missing_state == "error":
            raise FairCastStateError(f"{error}. Set fair_cast.on_missing_state to 'reset' to start the residual "
                                     "at zero instead.")
        else:
            reset_state(fair_cast.adapter, fair_cast.caster, engine.global_steps)
            _log_rank0(f"[fair_cast] WARNING {error}; on_missing_state=reset: residual starts at zero, noise step "
                       f"{engine.global_steps}")
        return result

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint


def _agree(restore: Any) -> str | None:
    """Run a local restore on every rank; return the first failing rank's message (the same on all
    ranks), or None. No rank goes on to a collective while another has failed."""
    import deepspeed.comm as dist

    try:
        restore()
        mine = None
    except FairCastStateError as exc:
        mine = str(exc)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, mine)
    for rank, message in enumerate(messages):
        if message is not None:
            return f"rank {rank}: {message}"
    return None


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


def _log_rank0(message: str) -> None:
    import deepspeed.comm as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(message)
        print(message, flush=True)  # visible in every launcher's output, whatever logging is set up
