"""ShardCaster: applies the configured cast to one rank's flat fp32 shard, slice by slice.

An adapter describes a flat shard as a list of ``ShardSlice`` (which parameter, which elements of
it, where in the flat buffer). The caster knows nothing about DeepSpeed: it reads the fp32 flat
shard, writes the bf16 flat shard, keeps the error-feedback residual and the step counter, and
counts what changed. Nothing larger than the rank's own shard is ever created here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Protocol, Sequence

import torch

from faircast_ds.casts import bf16_bits, cast, cast_into
from faircast_ds.config import FairCastConfig


@dataclass(frozen=True)
class ShardSlice:
    """Elements ``[start, start + numel)`` of parameter ``name`` sit at ``[offset, offset + numel)`` of
    the flat shard. ``name`` None marks DeepSpeed's alignment padding, which belongs to no parameter."""

    name: str | None
    start: int
    numel: int
    offset: int

    @property
    def is_padding(self) -> bool:
        return self.name is None


def with_padding(slices: Sequence[ShardSlice], total: int) -> list[ShardSlice]:
    """Sort parameter slices by offset and fill every gap up to ``total`` with padding slices."""
    out: list[ShardSlice] = []
    cursor = 0
    for s in sorted(slices, key=lambda s: s.offset):
        if s.offset < cursor:
            raise ValueError(f"overlapping shard slices at offset {s.offset} ({s.name})")
        if s.offset > cursor:
            out.append(ShardSlice(None, 0, s.offset - cursor, cursor))
        out.append(s)
        cursor = s.offset + s.numel
    if cursor < total:
        out.append(ShardSlice(None, 0, total - cursor, cursor))
    elif cursor > total:
        raise ValueError(f"shard slices end at {cursor}, past the flat shard's {total} elements")
    return out


class NonFiniteWeightError(FloatingPointError):
    """A served weight would be NaN or Inf (raised when ``on_nonfinite`` is ``error``)."""


@dataclass
class CastStats:
    """Counts of the last cast on this rank's shard (sum over the step's flat groups)."""

    step: int = 0
    numel: int = 0
    changed: int = 0
    seconds: float = 0.0  # wall time spent casting (the observer's time excluded)


class CastObserver(Protocol):
    """Told about every flat group the caster casts (e.g. :class:`faircast_ds.diagnostics.Diagnostics`)."""

    def on_cast(self, key: Hashable, master: torch.Tensor, slices: Sequence[ShardSlice], step: int) -> None: ...


@dataclass
class ShardCaster:
    """Casts flat fp32 shards into flat bf16 shards according to a :class:`FairCastConfig`."""

    config: FairCastConfig
    step: int = 0
    residuals: dict[Hashable, torch.Tensor] = field(default_factory=dict)
    last: CastStats = field(default_factory=CastStats)
    observer: CastObserver | None = None  # told about every flat group it casts

    def begin_step(self) -> int:
        """Advance the noise step; call once per optimizer step, before its first flat group."""
        self.step += 1
        self.last = CastStats(step=self.step)
        return self.step

    def residual_for(self, key: Hashable, master: torch.Tensor) -> torch.Tensor | None:
        """The error-feedback residual of one flat shard (created as zeros on first use)."""
        if self.config.mode != "error_feedback":
            return None
        res = self.residuals.get(key)
        if res is None:
            res = torch.zeros(master.numel(), dtype=torch.float32, device=master.device)
            self.residuals[key] = res
        return res

    def cast_flat(self, key: Hashable, master: torch.Tensor, served: torch.Tensor,
                  slices: Sequence[ShardSlice], previous: torch.Tensor | None = None) -> None:
        """Write cast(master) into ``served`` (both flat, same length), one parameter slice at a time.

        Changes are counted against ``served``'s old contents, or against ``previous`` (then updated)
        for optimizers that overwrite the served shard by round-to-nearest before we get to it.
        """
        if master.numel() != served.numel():
            raise ValueError(f"flat shard {key!r}: master has {master.numel()} elements, served {served.numel()}")
        started = time.perf_counter()
        master = master.detach().view(-1)
        residual = self.residual_for(key, master)
        cfg = self.config
        for s in slices:
            src = master.narrow(0, s.offset, s.numel)
            dst = served.narrow(0, s.offset, s.numel)
            if s.is_padding:  # belongs to no parameter: keep DeepSpeed's own copy of it
                dst.data.copy_(src)
                continue
            res = residual.narrow(0, s.offset, s.numel) if residual is not None else None
            # cast into the buffer that holds the last served bits, so the change count comes for free
            target = previous.narrow(0, s.offset, s.numel) if previous is not None else dst.data
            if target.device == src.device:
                changed, nonfinite = cast_into(target, src, cfg.mode, seed=cfg.seed, step=self.step, name=s.name,
                                               start=s.start, residual=res)
            else:  # e.g. fp32 master offloaded to CPU, bf16 on the accelerator
                out = cast(src, cfg.mode, seed=cfg.seed, step=self.step, name=s.name, start=s.start, residual=res)
                changed = int((bf16_bits(target) != bf16_bits(out.to(target.device))).sum())
                nonfinite = int((~torch.isfinite(out)).sum())
                target.copy_(out)
            if previous is not None:
                dst.data.copy_(target)
            self.last.changed += changed
            self.last.numel += s.numel
            if nonfinite and cfg.on_nonfinite == "error":
                _raise_nonfinite(target, src, s)
        self.last.seconds += time.perf_counter() - started
        if self.observer is not None:
            self.observer.on_cast(key, master, slices, self.step)


def _raise_nonfinite(out: torch.Tensor, src: torch.Tensor, s: ShardSlice) -> None:
    bad = ~torch.isfinite(out.float()).cpu()
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise NonFiniteWeightError(
            f"fair_cast: parameter {s.name!r} element {s.start + i} would be served as {float(out[i])} "
            f"(fp32 master {float(src[i])}); {int(bad.sum())} non-finite element(s) in this slice. "
            "The fp32 master has diverged or overflowed bf16; set fair_cast.on_nonfinite to 'propagate' "
            "to serve it anyway.")
