"""ShardCaster: applies the configured cast to one rank's flat fp32 shard, slice by slice.

An adapter describes a flat shard as a list of ``ShardSlice`` (which parameter, which elements of
it, where in the flat buffer). The caster knows nothing about DeepSpeed: it reads the fp32 flat
shard, writes the bf16 flat shard, keeps the error-feedback residual and the step counter, and
counts what changed. Nothing larger than the rank's own shard is ever created here.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Hashable, Protocol, Sequence

import torch

from faircast_ds.casting.marks import ChangeMarks
from faircast_ds.casting.modes import CastRule
from faircast_ds.casting.rules import cast_into_with
from faircast_ds.casting.runs import Runs
from faircast_ds.config.section import FairCastConfig


@dataclass(frozen=True, eq=False)
class IndexRuns:
    """Where a slice's elements sit in the flattened parameter when they are not one contiguous run (a
    tensor-parallel slice cut across the split dimension): equal-length runs, element ``k`` of the slice
    at ``starts[(k + phase) // length] + (k + phase) % length``. Kept as one start per run (a row of a
    row-parallel weight, say), not one index per element; :meth:`indices` expands them when cast."""

    starts: torch.Tensor  # int64: the parameter index of each run's first element
    length: int
    phase: int = 0  # the slice starts this far into its first run

    def indices(self, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The parameter index of each of the slice's ``numel`` elements (int64, on ``device``)."""
        starts = self.starts.to(device)
        every = (starts[:, None] + torch.arange(self.length, dtype=torch.int64, device=device)).reshape(-1)
        if self.phase + numel > every.numel():
            raise ValueError(f"index runs cover {every.numel() - self.phase} elements, the slice has {numel}")
        return every.narrow(0, self.phase, numel)

    def table(self, numel: int) -> Runs:
        """The runs the slice's ``numel`` elements make, as the fused kernels take them: the first run
        from ``phase`` on, the last one cut where the slice ends."""
        if not 0 <= self.phase < self.length:
            raise ValueError(f"index runs of length {self.length} with phase {self.phase}")
        count = (self.phase + numel + self.length - 1) // self.length
        if count > self.starts.numel():
            raise ValueError(f"index runs cover {self.starts.numel() * self.length - self.phase} elements, "
                             f"the slice has {numel}")
        starts = self.starts[:count].to("cpu", torch.int64).clone()
        lengths = torch.full((count,), self.length, dtype=torch.int64)
        starts[0] += self.phase
        lengths[0] -= self.phase
        lengths[-1] -= count * self.length - self.phase - numel
        return Runs.of(starts, lengths)


@dataclass(frozen=True)
class ShardSlice:
    """Elements ``[start, start + numel)`` of parameter ``name`` sit at ``[offset, offset + numel)`` of
    the flat shard. ``name`` None marks DeepSpeed's alignment padding, which belongs to no parameter.
    With ``runs`` the elements are not contiguous in the parameter: ``runs`` says where each one is
    (``start`` is then the first one's index), and the noise is keyed by those indices: equal-length runs
    (:class:`IndexRuns`, a tensor-parallel cut) or any runs (:class:`faircast_ds.casting.runs.Runs`)."""

    name: str | None
    start: int
    numel: int
    offset: int
    runs: IndexRuns | Runs | None = field(default=None, compare=False)

    @property
    def is_padding(self) -> bool:
        return self.name is None

    @cached_property
    def run_table(self) -> Runs | None:
        """The slice's runs as the fused kernels take them (made once per slice), or None."""
        if self.runs is None:
            return None
        table = self.runs if isinstance(self.runs, Runs) else self.runs.table(self.numel)
        if table.numel != self.numel:
            raise ValueError(f"slice of {self.name!r}: its runs cover {table.numel} elements, the slice has "
                             f"{self.numel}")
        if int(table.starts[0]) != self.start:
            raise ValueError(f"slice of {self.name!r} starts at {self.start}, its first run at "
                             f"{int(table.starts[0])}")
        return table

    def indices(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The parameter index of each element of the slice (int64)."""
        if self.runs is not None:
            return self.run_table.indices(device)
        return torch.arange(self.start, self.start + self.numel, dtype=torch.int64, device=device)


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
    """A served weight would be NaN or Inf (raised when ``on_nonfinite`` is ``error``).

    Raised only once the whole flat shard has been cast (every slice, residual included), so that the
    served copy is one step's cast throughout, never half of this step and half of the last; the
    caster keeps it as ``failed`` until the next step, and :func:`faircast_ds.shard.state.complete_step`
    casts the flat shards the step did not reach before a checkpoint is written."""


@dataclass
class CastStats:
    """Counts of the last cast on this rank's shard (sum over the step's flat groups)."""

    step: int = 0
    numel: int = 0
    changed: int = 0
    seconds: float = 0.0  # wall time spent casting (the observers' time excluded)


class CastObserver(Protocol):
    """Told about every flat group the caster casts, once the whole flat shard is cast (also when the
    cast then raises NonFiniteWeightError: the served shard holds this step's cast throughout). The
    caster's observers: :class:`faircast_ds.shard.diagnostics.Diagnostics` (when diagnostics are on) and the
    DeepSpeed guard (``faircast_ds.deepspeed.guard.Guard``), in that order."""

    def on_cast(self, key: Hashable, master: torch.Tensor, served: torch.Tensor, slices: Sequence[ShardSlice],
                step: int) -> None: ...

    def on_restored(self, key: Hashable, served: torch.Tensor, slices: Sequence[ShardSlice]) -> None:
        """The served shard of ``key`` was written by a restore, not a cast (error feedback's saved
        served bits): they are Fair Cast's bits all the same."""


STAGING_ENV = "FAIRCAST_DS_STAGING"  # "always": take the staging route even on one device (tests it on CPU)


def _staging_forced() -> bool:
    value = os.environ.get(STAGING_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "always"):
        raise ValueError(f"{STAGING_ENV}={value!r}; accepted: auto, always")
    return value == "always"


@dataclass
class ShardCaster:
    """Casts flat fp32 shards into flat bf16 shards according to a :class:`FairCastConfig`.

    When the fp32 master and the served bf16 shard sit on different devices (CPU optimizer offload on
    an accelerator: master on the host, served on the device), the cast runs where the master is, with
    the fused kernel, into a staging buffer there (the one the adapter passes, e.g. DeepSpeed's own
    pinned buffer, else one of the caster's, pinned), and the result goes to the device in one copy.
    ``force_staging`` (``FAIRCAST_DS_STAGING=always``) takes that route on one device too.
    """

    config: FairCastConfig
    step: int = 0
    residuals: dict[Hashable, torch.Tensor] = field(default_factory=dict)
    last: CastStats = field(default_factory=CastStats)
    observers: list[CastObserver] = field(default_factory=list)  # told about every flat group it casts, in order
    force_staging: bool = field(default_factory=_staging_forced)
    stages: dict[Hashable, torch.Tensor] = field(default_factory=dict, repr=False)  # the caster's own staging
    failed: NonFiniteWeightError | None = None  # this step's cast stopped on a non-finite weight
    cast_keys: set = field(default_factory=set, repr=False)  # flat shards cast since begin_step()
    checking: bool = True  # False inside unchecked(): non-finite served weights are noted, not raised
    suppressed: NonFiniteWeightError | None = None  # the first one noted while unchecked
    _pending: NonFiniteWeightError | None = field(default=None, repr=False)
    rule: CastRule = field(init=False, repr=False)  # what every slice is cast with: the mode's spec and the seed
    marks: ChangeMarks | None = field(default=None, repr=False)  # change marks, once track_changes() was called

    def __post_init__(self) -> None:
        self.rule = self.config.rule

    @contextmanager
    def unchecked(self):
        """Casts that must reproduce a saved served copy as it was (a checkpoint load) do not raise on
        non-finite weights; the first one is kept in ``suppressed``."""
        before, self.checking, self.suppressed = self.checking, False, None
        try:
            yield self
        finally:
            self.checking = before

    def track_changes(self) -> ChangeMarks:
        """From now on every cast marks the elements whose served bits it changed (1 bit per element,
        :mod:`faircast_ds.casting.marks`): what a delta push reads instead of a copy of the bits it sent.
        The marks start all set (nothing acknowledged yet). Idempotent."""
        if self.marks is None:
            self.marks = ChangeMarks()
        return self.marks

    def begin_step(self) -> int:
        """Advance the noise step; call once per optimizer step, before its first flat group."""
        self.step += 1
        self.last = CastStats(step=self.step)
        self.failed = None
        self.cast_keys = set()
        return self.step

    def residual_for(self, key: Hashable, master: torch.Tensor) -> torch.Tensor | None:
        """The error-feedback residual of one flat shard (created as zeros on first use)."""
        if not self.config.spec.residual:
            return None
        res = self.residuals.get(key)
        if res is None:
            res = torch.zeros(master.numel(), dtype=torch.float32, device=master.device)
            self.residuals[key] = res
        return res

    def cast_flat(self, key: Hashable, master: torch.Tensor, served: torch.Tensor,
                  slices: Sequence[ShardSlice], previous: torch.Tensor | None = None,
                  staging: torch.Tensor | None = None, check: bool = True) -> None:
        """Write cast(master) into ``served`` (both flat, same length), one parameter slice at a time.

        Changes are counted against ``served``'s old contents, or against ``previous`` (then updated)
        for optimizers that overwrite the served shard by round-to-nearest before we get to it.
        ``staging``: a flat bf16 buffer of the same length on the master's device that may be
        overwritten, used when the served shard is on another device (see the class docstring).
        With ``on_nonfinite: error`` a non-finite served weight raises NonFiniteWeightError after the
        whole flat shard is cast (``check=False``: never, as when completing a failed step).
        """
        if master.numel() != served.numel():
            raise ValueError(f"flat shard {key!r}: master has {master.numel()} elements, served {served.numel()}")
        started = time.perf_counter()
        master = master.detach().view(-1)
        residual = self.residual_for(key, master)
        last_served = previous if previous is not None else served
        self._pending = None
        marks = self.marks.for_cast(key, served.detach().view(-1), master.device) if self.marks is not None else None
        if self.force_staging or last_served.device != master.device:
            self._cast_staged(key, master, served, slices, previous, staging, residual, marks)
        else:
            self._cast_direct(master, served, slices, previous, residual, marks)
        self.cast_keys.add(key)
        self.last.seconds += time.perf_counter() - started
        error, self._pending = self._pending, None
        for observer in self.observers:  # the whole shard is cast, raised or not: observers see what was written
            observer.on_cast(key, master, served, slices, self.step)
        if error is not None and check and self.checking:
            self.failed = self.failed or error
            raise error
        if error is not None:
            self.suppressed = self.suppressed or error

    def restored(self, key: Hashable, served: torch.Tensor, slices: Sequence[ShardSlice]) -> None:
        """Tell the observers that a restore wrote the served shard of ``key`` itself (its change marks,
        if kept, count every element as changed)."""
        if self.marks is not None:
            self.marks.mark_all(key)
        for observer in self.observers:
            observer.on_restored(key, served, slices)

    def _cast_direct(self, master: torch.Tensor, served: torch.Tensor, slices: Sequence[ShardSlice],
                     previous: torch.Tensor | None, residual: torch.Tensor | None,
                     marks: torch.Tensor | None = None) -> None:
        for s in slices:
            src = master.narrow(0, s.offset, s.numel)
            dst = served.narrow(0, s.offset, s.numel)
            if s.is_padding:  # belongs to no parameter: keep DeepSpeed's own copy of it
                dst.data.copy_(src)
                continue
            res = residual.narrow(0, s.offset, s.numel) if residual is not None else None
            # cast into the buffer that holds the last served bits (on the master's device), so the change
            # count comes for free
            target = previous.narrow(0, s.offset, s.numel) if previous is not None else dst.data
            changed, nonfinite = self._cast_slice(target, src, s, res, marks)
            if previous is not None:
                dst.data.copy_(target)
            self._count(changed, nonfinite, target, src, s)

    def _cast_slice(self, out: torch.Tensor, src: torch.Tensor, s: ShardSlice,
                    residual: torch.Tensor | None, marks: torch.Tensor | None = None) -> tuple[int, int]:
        """One parameter slice into ``out``, one ``cast_into`` call: a contiguous run of the parameter from
        ``start``, or a slice with runs (its noise keyed by each element's own index in the parameter; a mode
        that draws no noise ignores them). ``marks``: the flat shard's change marks (the slice's first
        element at bit ``s.offset``)."""
        rule = self.rule
        runs = s.run_table if rule.spec.uses_noise else None
        return cast_into_with(rule, out, src, step=self.step, name=s.name, start=s.start, residual=residual,
                              runs=runs, marks=marks, mark_base=s.offset)

    def _count(self, changed: int, nonfinite: int, out: torch.Tensor, src: torch.Tensor, s: ShardSlice) -> None:
        self.last.changed += changed
        self.last.numel += s.numel
        if nonfinite and self.config.on_nonfinite == "error" and self._pending is None:
            self._pending = _nonfinite_error(out, src, s, self.step)  # raised once the whole shard is cast

    def staging_buffer(self, key: Hashable, master: torch.Tensor, served: torch.Tensor,
                       staging: torch.Tensor | None) -> torch.Tensor:
        """The flat bf16 buffer on the master's device that the staged cast writes: ``staging`` if given,
        else ``served`` itself when it sits there (not when forced), else the caster's own (made once
        per flat shard, pinned when it feeds another device)."""
        n = master.numel()
        if staging is not None:
            stage = staging.detach().view(-1)
            if stage.dtype != torch.bfloat16 or stage.numel() != n or stage.device != master.device:
                raise ValueError(f"flat shard {key!r}: the staging buffer must be bf16 with {n} elements on "
                                 f"{master.device}, got {stage.dtype} with {stage.numel()} on {stage.device}")
            return stage
        if served.device == master.device and not self.force_staging:
            return served.detach().view(-1)
        stage = self.stages.get(key)
        if stage is None or stage.numel() != n or stage.device != master.device:
            stage = torch.empty(n, dtype=torch.bfloat16, device=master.device)
            if master.device.type == "cpu" and served.device.type != "cpu":
                try:
                    stage = stage.pin_memory()  # a fast, asynchronous-capable copy to the device
                except RuntimeError:  # no pinning on this build: a plain host buffer works the same
                    pass
            self.stages[key] = stage
        return stage

    def _cast_staged(self, key: Hashable, master: torch.Tensor, served: torch.Tensor, slices: Sequence[ShardSlice],
                     previous: torch.Tensor | None, staging: torch.Tensor | None,
                     residual: torch.Tensor | None, marks: torch.Tensor | None = None) -> None:
        """The fused kernel on the master's device into a staging buffer there, then one copy of the
        whole flat shard to the served (and previous) buffer. The staging buffer first receives the
        last served bits, so the kernel counts the changes as the direct path does."""
        last_served = (previous if previous is not None else served).detach().view(-1)
        stage = self.staging_buffer(key, master, served, staging)
        if stage.data_ptr() != last_served.data_ptr():
            stage.copy_(last_served)  # the bits served before: one copy back from the device
        for s in slices:
            src = master.narrow(0, s.offset, s.numel)
            out = stage.narrow(0, s.offset, s.numel)
            if s.is_padding:  # belongs to no parameter: DeepSpeed's own copy of it
                out.copy_(src)
                continue
            res = residual.narrow(0, s.offset, s.numel) if residual is not None else None
            changed, nonfinite = self._cast_slice(out, src, s, res, marks)
            self._count(changed, nonfinite, out, src, s)
        if last_served.data_ptr() != stage.data_ptr():
            last_served.copy_(stage)  # the one copy to the device
        flat = served.detach().view(-1)
        if previous is not None and flat.data_ptr() != stage.data_ptr():
            flat.copy_(last_served if last_served.device == flat.device else stage)


def _nonfinite_error(out: torch.Tensor, src: torch.Tensor, s: ShardSlice, step: int) -> NonFiniteWeightError:
    bad = ~torch.isfinite(out.float()).cpu()
    i = int(bad.nonzero()[0, 0]) if bool(bad.any()) else 0
    index = int(s.indices()[i]) if s.runs is not None else s.start + i
    return NonFiniteWeightError(
        f"fair_cast: parameter {s.name!r} element {index} would be served as {float(out[i])} "
        f"(fp32 master {float(src[i])}) at step {step}; {int(bad.sum())} non-finite element(s) in this slice. "
        "The fp32 master has diverged or overflowed bf16; set fair_cast.on_nonfinite to 'propagate' "
        "to serve it anyway.")
