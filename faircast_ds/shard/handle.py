"""The one attach pipeline: every route (DeepSpeed runtime, DeepSpeed cast hook, Megatron runtime and
hook) resolves its config once, makes its adapters, and hands them to :func:`build`, which returns the
one handle type, :class:`FairCast`.

``build`` does what every route needs and nothing framework-specific: it builds the fused kernel for
the masters' devices, registers each adapter's route, wires diagnostics as the caster's first observer,
applies rounding-location alignment to the module, and prints the one banner. The integrations do the
rest around it (DeepSpeed: ``faircast_ds.deepspeed.engine_hooks`` lists what runs around an engine's methods).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from faircast_ds._util import dist
from faircast_ds.casting.marks import MarkSet
from faircast_ds.config.section import FairCastConfig
from faircast_ds.shard.adapter import Adapter, UnsupportedSetupError
from faircast_ds.shard.caster import ShardCaster
from faircast_ds.shard.diagnostics import Diagnostics
from faircast_ds.shard.routes import ROUTES, Route, RouteKind

ATTR = "_fair_cast"  # where an engine (or optimizer) keeps its handle


@dataclass
class FairCast:
    """Fair Cast attached to one engine or optimizer: its config, its adapters (one per optimizer whose
    shards it casts; a DeepSpeed engine has one), and how they are routed."""

    config: FairCastConfig
    adapters: list[Adapter]
    route: RouteKind  # faircast_ds.shard.routes.KINDS
    diagnostics: Diagnostics | None = None
    alignment: Any = None  # faircast_ds.align.AlignmentHandle when fair_cast.align_rounding is set
    origin: str | None = None  # where the section came from (faircast_ds.config.origin), for the banner
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def adapter(self) -> Adapter:
        """The adapter, where there is exactly one (every DeepSpeed engine)."""
        if len(self.adapters) != 1:
            raise AttributeError(f"this Fair Cast serves {len(self.adapters)} optimizers; use .adapters")
        return self.adapters[0]

    @property
    def caster(self) -> ShardCaster:
        """The caster, where there is exactly one adapter."""
        return self.adapter.caster

    def local_numel(self) -> int:
        return sum(a.local_numel() for a in self.adapters)

    @property
    def step(self) -> int:
        """The step of the last cast, over every adapter (0 before the first)."""
        return max((a.caster.step for a in self.adapters), default=0)

    def summary(self) -> dict[str, Any]:
        """What an export records of the Fair Cast that served its bits: mode, seed and step."""
        return {"mode": self.config.mode, "seed": self.config.seed, "step": self.step}

    def change_marks(self) -> MarkSet:
        """The casts' change marks over every adapter's served shard (1 bit per element, set where a cast
        wrote other bits; :mod:`faircast_ds.casting.marks`), turned on at the first call: what a delta
        push reads instead of a copy of the bits it sent. Every flat shard is registered now, marked
        changed, so a reader finds its slices before the next cast."""
        marks = self.extras.get("change_marks")
        if marks is None:
            parts = []
            for adapter in self.adapters:
                part = adapter.caster.track_changes()
                for key, master, served, _ in adapter.flat_groups():
                    part.for_cast(key, served.detach().view(-1), master.device)
                parts.append(part)
            marks = self.extras["change_marks"] = MarkSet(parts)
        return marks

    def served_rewritten(self) -> None:
        """Something other than the cast wrote served bits (a checkpoint load): every element counts
        as changed for the next delta (which is therefore dense)."""
        marks = self.extras.get("change_marks")
        if marks is not None:
            marks.invalidate()

    def stats(self) -> dict[str, float]:
        """The last cast's counts, summed over all ranks (a collective: call it on every rank)."""
        changed, numel = dist.all_reduce_sum([float(sum(a.caster.last.changed for a in self.adapters)),
                                              float(sum(a.caster.last.numel for a in self.adapters))])
        return {"step": self.step, "changed": changed, "numel": numel,
                "changed_fraction": changed / numel if numel else 0.0}

    def report(self) -> dict[str, float]:
        """Changed fraction, master-served gap and lag at the current step (a collective: call it on
        every rank). See faircast_ds.shard.diagnostics."""
        if self.diagnostics is None:
            raise RuntimeError("fair_cast.diagnostics.every is 0: diagnostics are off")
        return self.diagnostics.compute(self.adapter.flat_groups(), self.caster.last, self.caster.step)

    def banner(self) -> str:
        cfg = self.config
        align = (f" align_rounding={cfg.align_rounding.engine}[{','.join(cfg.align_rounding.regions)}]"
                 if cfg.align_rounding else "")
        setup = str(self.adapters[0].setup) if self.adapters else "no shards"
        setup = f" {setup}" if setup else ""
        return (f"[fair_cast] active: mode={cfg.mode}{setup} seed={cfg.seed} local_shard_elements={self.local_numel()} "
                f"on_nonfinite={cfg.on_nonfinite}{align} route={self.route}"
                + (f" origin={self.origin}" if self.origin else ""))


def get_fair_cast(obj: Any) -> FairCast | None:
    """The Fair Cast attached to an engine or optimizer, or None."""
    return getattr(obj, ATTR, None)


def resolve(config: FairCastConfig | Mapping[str, Any] | None) -> FairCastConfig | None:
    """The validated config, or None when there is none or it says ``enabled: false`` (said on rank 0)."""
    if config is None:
        return None
    if not isinstance(config, FairCastConfig):
        config = FairCastConfig.from_section(config)
    if not config.enabled:
        dist.log_rank0("[fair_cast] disabled by config (fair_cast.enabled=false): serving round-to-nearest")
        return None
    return config


def build(config: FairCastConfig, adapters: list[Adapter], *, route: RouteKind, owner: Any,
          connect: Callable[[Adapter], None], module: Any = None, model_numel: int | None = None,
          origin: str | None = None) -> FairCast:
    """Route ``adapters`` and make their handle, kept on ``owner`` (the engine or optimizer that
    :func:`get_fair_cast` is asked about).

    Each adapter's optimizer is registered under ``route`` (refused if another route serves it), then
    ``connect(adapter)`` puts the adapter in the optimizer's refresh path (the runtime route installs
    its wrappers; a hook route registers with the framework's hook). ``module``: the model, for
    rounding-location alignment. ``model_numel``: elements of the whole model, for the diagnostics'
    sample (diagnostics need exactly one adapter). ``origin``: where the section came from (the banner says it).
    """
    from faircast_ds.casting import kernels

    for i, adapter in enumerate(adapters):
        try:
            ROUTES.add(adapter.optimizer, Route(adapter, route))
        except RuntimeError:
            for earlier in adapters[:i]:
                ROUTES.remove(earlier.optimizer)
            raise
    for adapter in adapters:
        connect(adapter)
    handle = FairCast(config, list(adapters), route, origin=origin)
    for device in {master.device for a in adapters for _, master, _, _ in a.flat_groups()}:
        kernels.prepare(device)  # build the fused kernel now, not inside the first optimizer step
    if config.diagnostics.every > 0 and model_numel is not None and len(adapters) == 1:
        handle.diagnostics = Diagnostics(config.diagnostics, model_numel)
        adapters[0].caster.observers.insert(0, handle.diagnostics)  # the first observer: before the guard
    if config.align_rounding is not None:
        if module is None:
            raise UnsupportedSetupError("fair_cast.align_rounding: this route has no HF module to align")
        from faircast_ds.align import apply_from_config

        handle.alignment = apply_from_config(module, config.align_rounding)
    setattr(owner, ATTR, handle)
    for adapter in adapters:  # for callers that hold the optimizer (a Trainer, through Accelerate's wrapper)
        setattr(adapter.optimizer, ATTR, handle)
    dist.log_rank0(handle.banner())
    return handle
