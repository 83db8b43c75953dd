"""The one served-weight source: every consumer (HF export, the weight sync, every engine setup) reads
the served bf16 weights through :class:`ServedSource`.

A :class:`Walk` visits the served parameters once, in a stable order (the reader's, for DeepSpeed
``named_parameters()``), yielding each one's served bits in full exactly once: under ZeRO-3 one gather
per parameter yielded, under ZeRO-1/2 and BF16_Optimizer none (every rank holds the bf16 model).

The source knows which parameters changed since the last *acknowledged* version (a version an engine
confirmed holding). Each rank compares its own served shard with its own copy of that version's bits
(2 bytes per shard element, kept only once something was acknowledged) and ONE all-reduce of the
per-parameter changed-element counts per walk tells every rank which parameters changed. A dense walk
yields every parameter; a delta walk yields only the changed ones (optionally with the whole packed
group each belongs to), one gather each. With ``masks=True`` rank 0 also gets, per yielded parameter
of a delta walk whose sparse encoding is smaller than a dense one, which of its elements changed
(each rank's packed bitmap of its own shard, gathered to rank 0: 1 bit per element).

Acknowledge and abort::

    walk = source.walk("auto")                  # dense until something was acknowledged
    for item in walk:                           # every rank, to the end, in lockstep
        ...send item.tensor (rank 0)...
    walk.acknowledge()                          # the engine confirmed: the next delta is against this
    # or walk.abort() / nothing: the next walk is relative to the last acknowledged version
    source.require_dense()                      # a new engine or a reconnect: the next walk is dense

Where the parameters live is a :class:`ServedReader`'s business, and the integration that attached to
a model hands export its reader: :func:`provide` (DeepSpeed's attach provides
``faircast_ds.deepspeed.reader.DeepSpeedReader`` for every engine it sees, ZeRO-0/1/2/3; Megatron's attach
its HF-named ``MegatronHFReader``). :func:`reader_of` is the one lookup; a model no integration
provided a reader for is read as a plain module (:class:`ModelReader`). No framework, no integration
and no engine is imported here, and nothing depends on what was imported before.

**What changed** since the version an engine acknowledged, per local slice (the question every delta
asks, issue 32 item 4), has two answers with one interface: :class:`MarksTracker` reads the cast's own
change marks (:mod:`faircast_ds.casting.marks`, 1 bit per shard element, set by the kernel that writes
the served bits), used when the reader offers them (``reader.change_marks()``: DeepSpeed with Fair Cast
attached) and they cover every local slice; :class:`BaselineTracker` compares against a copy of each
slice's bits at the acknowledged version (2 bytes per element): weights no cast marks, or a second
engine when the marks already serve one. :func:`tracker_for` picks one; both are rank-local.

**Seconds per stage** of one update, on both ends (issue 32 item 1): a :class:`Stages` accumulates wall
seconds under stage names; every consumer fills one per update and hands it back in its report
(:attr:`ServedReport.stages`, a plain dict). Names are ``side.stage``: ``trainer.walk`` (reading the
served weights: ZeRO-3 gathers, or each rank's slices), ``trainer.diff`` (what changed),
``trainer.encode`` (delta encodings), ``trainer.mac`` / ``engine.mac`` (HMAC over frames),
``trainer.send`` / ``engine.receive`` (socket time, MAC excluded), ``engine.stage``, ``engine.load``
(inside vLLM's ``reload_weights``), ``trainer.collectives``, ``http.<endpoint>`` (one entry per HTTP call,
its whole round trip), ``shm.*`` / ``net.*`` / ``group.*`` (a plane's begin, write or send, digest,
commit). Stages may overlap (an HTTP call that waits while the trainer streams): they are not meant to
sum to the push.
"""
from __future__ import annotations

import contextlib
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

from faircast_ds._util.dist import collective_device, rank_world
from faircast_ds.export import delta as delta_encoding
from faircast_ds.export.served import (
    LocalSlice,
    ParamSpec,
    checked,
    even_slices,
    module_of,
)

DENSE, DELTA = "dense", "delta"


# ---------------------------------------------------------------- seconds per stage
class Stages:
    """Wall seconds and call counts per stage name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def add(self, name: str, seconds: float, calls: int = 1) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + float(seconds)
        self.calls[name] = self.calls.get(name, 0) + int(calls)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - began)

    def merge(self, other: Mapping[str, float] | "Stages" | None, prefix: str = "") -> None:
        if other is None:
            return
        items = other.seconds.items() if isinstance(other, Stages) else other.items()
        for k, v in items:
            if isinstance(v, (int, float)):
                self.add(prefix + k, v, other.calls.get(k, 1) if isinstance(other, Stages) else 1)

    def as_dict(self) -> dict[str, float]:
        return dict(self.seconds)

    def http_calls(self) -> int:
        return sum(n for k, n in self.calls.items() if k.startswith("http."))


# ---------------------------------------------------------------- what changed since the acknowledged version
def _bits(t: torch.Tensor) -> torch.Tensor:
    """The elements as same-width integers (a flat view): bits compared, never values."""
    return t.detach().view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


class BaselineTracker:
    """Changes against a kept copy of the acknowledged bits (2 bytes per local element)."""

    kind = "baseline"

    def __init__(self) -> None:
        self._baseline: list[torch.Tensor] | None = None

    def counts(self, values: Sequence[torch.Tensor]) -> list[int]:
        return [int((_bits(v) != base).sum()) for v, base in zip(values, self._require(values))]

    def mask(self, position: int, values: torch.Tensor) -> torch.Tensor:
        base = self._baseline[position] if self._baseline is not None else None
        if base is None:
            raise RuntimeError("no acknowledged version to compare against")
        return torch.ne(_bits(values), base)

    def indices(self, position: int, values: torch.Tensor) -> torch.Tensor:
        """Sorted int64 indices of the elements of slice ``position`` that changed."""
        return self.mask(position, values).nonzero().view(-1)

    def acknowledge(self, values: Sequence[torch.Tensor], positions: set[int] | None = None) -> None:
        """The engine now serves ``values``' bits (those of ``positions`` only, the others unchanged)."""
        if self._baseline is None or len(self._baseline) != len(values):
            self._baseline = [_bits(v).clone() for v in values]
            return
        for p in range(len(values)) if positions is None else positions:  # in place: no second copy
            self._baseline[p].copy_(_bits(values[p]))

    def _require(self, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self._baseline is None or len(self._baseline) != len(values):
            raise RuntimeError("no acknowledged version to compare against")
        return self._baseline

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._baseline or ())

    def close(self) -> None:
        self._baseline = None


class MarksTracker:
    """Changes read from the cast's change marks (1 bit per local element, kept by the casters)."""

    kind = "marks"

    def __init__(self, marks: Any) -> None:
        self.marks = marks

    def counts(self, values: Sequence[torch.Tensor]) -> list[int]:
        return [self.marks.count(v) for v in values]

    def mask(self, position: int, values: torch.Tensor) -> torch.Tensor:
        return self.marks.mask(values)

    def indices(self, position: int, values: torch.Tensor) -> torch.Tensor:
        return self.marks.indices(values)

    def acknowledge(self, values: Sequence[torch.Tensor], positions: set[int] | None = None) -> None:
        """The engine now serves every local bit as it is: no element changed since. (Slices a delta
        did not carry had no marks set, so clearing them all is the same.)"""
        self.marks.clear()

    @property
    def nbytes(self) -> int:
        return int(self.marks.nbytes)

    def close(self) -> None:
        self.marks.release(self)


def tracker_for(reader: Any, values: Sequence[torch.Tensor]) -> MarksTracker | BaselineTracker:
    """The cast's marks when ``reader`` offers them, they cover every one of ``values`` and no other
    consumer holds them; else a baseline."""
    offer = getattr(reader, "change_marks", None)
    marks = offer() if callable(offer) else None
    if marks is not None and all(marks.covers(v) for v in values):
        tracker = MarksTracker(marks)
        if marks.claim(tracker):
            marks.invalidate()  # nothing this consumer's engine acknowledged yet
            return tracker
    return BaselineTracker()


@dataclass(frozen=True)
class ServedReport:
    """One consumer's account of one update (sync, push, export), the same type everywhere.

    ``changed``: elements whose bits changed since the base version (a dense update has no base: every
    element). ``elements``: elements carried (a parameter sent whole carries all of its elements;
    defaults to ``changed``). ``gathers``: full-parameter gathers the walk made (ZeRO-3; 0 where every
    rank holds the model). The engine fields are filled by consumers that load into an engine.
    """

    version: int | None
    kind: str  # "dense" or "delta"
    params: int  # parameters carried
    changed: int
    numel: int  # elements in the model
    bytes: int  # bytes handed over (on the channel: headers included)
    seconds: float
    elements: int | None = None
    params_total: int | None = None
    gathers: int = 0
    load_seconds: float = 0.0  # inside the engine's reload
    verify_seconds: float = 0.0
    verified: bool | None = None  # None: not checked
    mismatched: list[str] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage (:class:`Stages`)
    http_calls: int = 0  # HTTP round trips to the engine during the update
    collectives: int = 0  # collectives of the training job during the update (walk gathers not counted)
    tracking: str | None = None  # how deltas find changes: "marks" (the cast's, 1 bit/element), "baseline" (a copy)
    tracking_bytes: int = 0  # this rank's memory for that between pushes
    plane: str | None = None  # the push into vllm serve: the plane it crossed (ServedPush)
    plane_choice: str | None = None  # why that plane, where ServedPush chose it (None: the caller named it)

    def __post_init__(self) -> None:
        if self.elements is None:
            object.__setattr__(self, "elements", self.changed)


class ServedReader(Protocol):
    """Where a framework keeps the served weights: what :class:`ServedSource` needs of it.

    - :attr:`specs`: every served parameter, in the order walks visit them (identical on every rank).
    - :meth:`local_slices`: this rank's own pieces, read in place; over the ranks of :attr:`group` they
      cover every element exactly once. ``start`` is the piece's offset in the flattened tensor
      :meth:`full` yields (a piece that is not contiguous there is listed as several slices). Raises
      ValueError when this rank's pieces cannot be read (no delta is possible then).
    - ``change_marks()`` (optional): the cast's change marks over this rank's pieces
      (:class:`faircast_ds.casting.marks.MarkSet`), or None; deltas read them instead of keeping a copy
      of the acknowledged bits (:func:`tracker_for`).
    - :meth:`full`: parameter ``index`` in full, in its served dtype, for the duration (a collective
      over :attr:`group` where :meth:`is_gathered` says so).
    - :attr:`group`: the process group the walk's own collectives run on (None: the default group).

    Optional: ``fair_cast_summary()``, the Fair Cast settings an export records (``mode``, ``seed``,
    ``step``), or None (:func:`fair_cast_summary`).
    """

    specs: list[ParamSpec]
    group: Any

    def local_slices(self) -> list[LocalSlice]: ...

    def full(self, index: int) -> ContextManager[torch.Tensor]: ...

    def is_gathered(self, index: int) -> bool: ...


ReaderFactory = Callable[[Any], ServedReader]
READER_ATTR = "_faircast_served_reader"  # where provide() keeps a model's reader (on the model: nothing leaks)


def provide(model: Any, reader: ServedReader | ReaderFactory) -> None:
    """An integration hands export the reader of ``model``'s served weights (the engine or module a
    consumer will give :class:`ServedSource`, :func:`~faircast_ds.export.hf.save_hf`, a push). ``reader``:
    a :class:`ServedReader`, or a callable that makes one from the model it is asked about (called for
    each source, so each reads the model as it is then). Local; a second call replaces the first. Kept
    on the model itself, so it goes with the model."""
    setattr(model, READER_ATTR, reader)


def provided(model: Any) -> ServedReader | ReaderFactory | None:
    """What an integration provided for ``model`` (:func:`provide`), or None."""
    return getattr(model, READER_ATTR, None)


def reader_of(model: Any) -> ServedReader:
    """The reader of ``model``'s served weights: the one its integration provided, else a plain
    module's (:class:`ModelReader`). Local: no collective."""
    given = provided(model)
    if given is None:
        return ModelReader(model)
    return given(model) if callable(given) else given


def fair_cast_summary(reader: ServedReader) -> dict[str, Any] | None:
    """The Fair Cast settings an export records, as the reader reports them (None: none attached)."""
    summary = getattr(reader, "fair_cast_summary", None)
    return summary() if summary is not None else None


class ModelReader:
    """A plain module's served weights: the reader of a model no integration provided one for (an fp32
    reference, a module Fair Cast never attached to). Every rank holds every parameter; each rank's
    pieces are an even split of each one (:func:`~faircast_ds.export.served.even_slices`). A parameter
    with no elements on this rank (a framework's partitioned one) is refused."""

    group = None

    def __init__(self, model: Any) -> None:
        self.model = model
        named = list(module_of(model).named_parameters())
        self._params = [checked(name, p) for name, p in named]
        self.specs = [ParamSpec(name, tuple(int(d) for d in p.shape), p.dtype) for name, p in named]

    def local_slices(self) -> list[LocalSlice]:
        rank, world = rank_world()
        return even_slices(((s.name, p) for s, p in zip(self.specs, self._params)), rank, world)

    def is_gathered(self, index: int) -> bool:
        return False

    @contextlib.contextmanager
    def full(self, index: int) -> Iterator[torch.Tensor]:
        yield self._params[index].data


def served_specs(model: Any) -> list[ParamSpec]:
    """Every served parameter's name, full shape and dtype, in the reader's order (``named_parameters()``
    for DeepSpeed and a plain module). Local: no collective, no gather."""
    return list(reader_of(model).specs)


def local_served_slices(model: Any) -> list[LocalSlice]:
    """This rank's own pieces of the served parameters, read in place (no gather, no copy): over all
    ranks they cover every served element exactly once. Raises ValueError where the reader cannot
    read them (ZeRO-3 without Fair Cast)."""
    return reader_of(model).local_slices()


@torch.no_grad()
def served_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every served parameter, in the reader's order, exactly as the
    trainer's forward sees it (bf16 under DeepSpeed's bf16 mode).

    A collective where the reader gathers (ZeRO-3): call it on every rank and consume the iterator to
    the end on every rank. Each parameter is gathered on its own, in its served dtype, and released
    before the next one, so no rank holds more than one gathered parameter at a time. The yielded
    tensor is the parameter's own storage, not a copy: it is valid until the iterator advances and must
    not be modified. ``model`` is a DeepSpeed engine, a module, or whatever an integration provided a
    reader for.
    """
    reader = reader_of(model)
    for index, spec in enumerate(reader.specs):
        with reader.full(index) as full:
            yield spec.name, full


@dataclass
class ServedItem:
    """One parameter of a walk. ``tensor`` is the full served tensor on every rank, valid only until the
    walk advances (the framework's own storage: do not modify it). ``changed``: its elements whose bits
    changed since the base (dense walk: all). ``mask`` (rank 0, delta walks with ``masks=True``): a
    bool tensor over the flattened parameter, True where the bits changed; None when sending the
    parameter whole is smaller (see :func:`faircast_ds.export.delta.best`) or off rank 0."""

    index: int
    spec: ParamSpec
    tensor: torch.Tensor
    changed: int
    mask: torch.Tensor | None = None

    @property
    def name(self) -> str:
        return self.spec.name


class ServedSource:
    """The served weights of one model as walks, with the last acknowledged version's baseline.

    Construct on every rank with a model (read by the reader its integration provided, :func:`reader_of`)
    or ``reader=`` (a :class:`ServedReader` given directly). ``delta=False`` never keeps a baseline (every walk is dense). Every walk is a
    collective of :attr:`reader`'s group: start it and consume it to the end on every rank. The
    acknowledged version is one engine's: give each engine its own source (they may share a
    reader).
    """

    def __init__(self, model: Any = None, *, reader: ServedReader | None = None, delta: bool = True) -> None:
        if (model is None) == (reader is None):
            raise ValueError("ServedSource takes a model or reader=, exactly one")
        self.model = model
        self.reader: ServedReader = reader if reader is not None else reader_of(model)
        self.specs: list[ParamSpec] = list(self.reader.specs)
        self.index = {s.name: i for i, s in enumerate(self.specs)}
        self.numel = sum(s.numel for s in self.specs)
        self.rank, self.world = _group_rank_world(self.reader.group)
        self.can_delta = delta and _readable(self.reader)
        self.acknowledged: int | None = None  # the version the engine acknowledged; None: the next walk is dense
        self._tracker: MarksTracker | BaselineTracker | None = None  # what changed since (made at the first acknowledge)
        self._layout: list[list[tuple[int, int, int]]] | None = None  # per rank: (param index, start, numel)
        self.walks = 0

    @property
    def params_total(self) -> int:
        return len(self.specs)

    @property
    def tracking(self) -> str | None:
        """How deltas find changes: ``"marks"``, ``"baseline"``, or None before the first acknowledge."""
        return self._tracker.kind if self._tracker is not None else None

    @property
    def tracking_bytes(self) -> int:
        return self._tracker.nbytes if self._tracker is not None else 0

    def require_dense(self) -> None:
        """Forget the acknowledged version (a new engine, a reconnect): the next walk is dense. Local."""
        self.acknowledged = None

    def walk(self, kind: str = "auto", *, masks: bool = False,
             groups: Mapping[str, Sequence[str]] | None = None, version: int | None = None) -> "Walk":
        """Start a walk (a collective). ``kind``: ``auto`` (delta when a version was acknowledged and
        deltas are possible, else dense), ``dense`` or ``delta`` (ValueError without an acknowledged
        version). ``groups``: name -> the names that must travel together (a packed engine layer); a
        delta walk then yields every member of a group with a changed member. Must be the same on
        every rank. ``version``: what :meth:`Walk.acknowledge` records (default: the engine's
        ``global_steps``)."""
        if kind not in ("auto", DENSE, DELTA):
            raise ValueError(f"kind must be 'auto', 'dense' or 'delta', not {kind!r}")
        if kind == DELTA and self.acknowledged is None:
            raise ValueError("a delta walk needs an acknowledged version" + (
                "" if self.can_delta else " and each rank's served shard (under ZeRO-3: Fair Cast attached)"))
        use_delta = kind != DENSE and self.acknowledged is not None and self.can_delta
        if version is None:
            version = getattr(self.model, "global_steps", None)
        return Walk(self, DELTA if use_delta else DENSE, masks=masks and use_delta, groups=groups, version=version)

    # -- rank-local pieces ------------------------------------------------------------------------
    def _slices(self) -> list[LocalSlice]:
        return self.reader.local_slices()

    def _changed_counts(self, slices: list[LocalSlice]) -> torch.Tensor:
        """Per parameter, how many of its elements changed since the baseline, over all ranks: the
        walk's one collective (an all-reduce of one int64 per parameter)."""
        counts = torch.zeros(len(self.specs), dtype=torch.int64)
        for s, n in zip(slices, self._tracker.counts([s.values for s in slices])):
            counts[self.index[s.name]] += n
        if self.world > 1:
            device = collective_device()
            reduced = counts.to(device)
            dist.all_reduce(reduced, group=self.reader.group)
            counts = reduced.cpu()
        return counts

    def _rank_layout(self, slices: list[LocalSlice]) -> list[list[tuple[int, int, int]]]:
        """Every rank's slices (param index, start, numel), once per source (one object all-gather)."""
        if self._layout is None:
            mine = [(self.index[s.name], s.start, s.numel) for s in slices]
            if self.world == 1:
                self._layout = [mine]
            else:
                everyone: list[Any] = [None] * self.world
                dist.all_gather_object(everyone, mine, group=self.reader.group)
                self._layout = everyone
        return self._layout

    def _mask(self, index: int, slices: list[LocalSlice], numel: int) -> torch.Tensor | None:
        """Which elements of parameter ``index`` changed, on rank 0 (a gather of each rank's packed
        bitmap of its own pieces; None off rank 0). Rank 0 holds one bool per element of the parameter
        and the ranks' bitmaps (1 bit per element), nothing larger."""
        layout = self._rank_layout(slices)
        mine = [self._tracker.mask(k, s.values) for k, s in enumerate(slices) if s.name == self.specs[index].name]
        local = torch.cat(mine) if mine else torch.zeros(0, dtype=torch.bool)
        if self.world == 1:
            full = torch.zeros(numel, dtype=torch.bool)
            for (_, start, n), part in zip([e for e in layout[0] if e[0] == index], mine):
                full[start:start + n] = part
            return full
        lengths = [sum(n for i, _, n in rank_slices if i == index) for rank_slices in layout]
        width = (max(lengths) + 7) // 8
        device = collective_device()
        packed = delta_encoding.mask_to_bitmap(local.cpu(), width).to(device)
        parts = [torch.empty_like(packed) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(packed, parts, dst=_global_rank0(self.reader.group), group=self.reader.group)
        if self.rank != 0:
            return None
        full = torch.zeros(numel, dtype=torch.bool)
        for rank_slices, part, length in zip(layout, parts, lengths):
            bits = delta_encoding.bitmap_to_mask(part.cpu(), length)
            cursor = 0
            for i, start, n in rank_slices:
                if i == index:
                    full[start:start + n] = bits[cursor:cursor + n]
                    cursor += n
        return full

    def _acknowledge(self, walk: "Walk") -> None:
        if not self.can_delta:
            self.acknowledged = None
            return
        slices = self._slices()
        values = [s.values for s in slices]
        if self._tracker is None:
            self._tracker = tracker_for(self.reader, values)
        self._tracker.acknowledge(values)
        self.acknowledged = walk.version if walk.version is not None else walk.serial


class Walk:
    """One pass over the served weights (see :meth:`ServedSource.walk`). Iterate it once, to the end,
    on every rank; then :meth:`acknowledge` (the engine confirmed) or :meth:`abort`."""

    def __init__(self, source: ServedSource, kind: str, *, masks: bool, groups: Mapping[str, Sequence[str]] | None,
                 version: int | None) -> None:
        self.source, self.kind, self.masks, self.version = source, kind, masks, version
        self.base = source.acknowledged if kind == DELTA else None
        source.walks += 1
        self.serial = source.walks
        self.began = time.perf_counter()
        self.gathers = 0
        self.walk_seconds = 0.0  # inside the reader (gathers, masks, the changed-count all-reduce)
        self.changed = source.numel if kind == DENSE else 0
        self.params = 0  # yielded so far
        self.elements = 0
        self._started = False
        self._generator: Iterator[ServedItem] | None = None
        self._steps = getattr(source.model, "global_steps", None)
        self._slices: list[LocalSlice] = []
        if kind == DENSE:
            self.counts = None
            self.order = list(range(len(source.specs)))
        else:
            t0 = time.perf_counter()
            self._slices = source._slices()
            self.counts = source._changed_counts(self._slices)
            self.walk_seconds += time.perf_counter() - t0
            self.changed = int(self.counts.sum())
            chosen = {i for i in range(len(source.specs)) if int(self.counts[i])}
            if groups:
                for i in list(chosen):
                    chosen.update(source.index[m] for m in groups.get(source.specs[i].name, ()) if m in source.index)
            self.order = sorted(chosen)

    @property
    def changed_params(self) -> list[str]:
        """Names of the parameters whose bits changed since the base (dense walk: all of them)."""
        if self.counts is None:
            return [s.name for s in self.source.specs]
        return [s.name for s, c in zip(self.source.specs, self.counts.tolist()) if c]

    def __iter__(self) -> Iterator[ServedItem]:
        if self._started:
            raise RuntimeError("a walk is iterated once; start another with ServedSource.walk()")
        self._started = True
        self._generator = self._items()
        return self._generator

    def _items(self) -> Iterator[ServedItem]:
        source = self.source
        for index in self.order:
            spec = source.specs[index]
            changed = spec.numel if self.counts is None else int(self.counts[index])
            mask = None
            t0 = time.perf_counter()
            if self.masks and 0 < changed and delta_encoding.best(spec.numel, changed, _size(spec.dtype)) != \
                    delta_encoding.DENSE:
                mask = source._mask(index, self._slices, spec.numel)
            if source.reader.is_gathered(index):
                self.gathers += 1
            with source.reader.full(index) as tensor:
                self.walk_seconds += time.perf_counter() - t0
                self.params += 1
                self.elements += spec.numel
                yield ServedItem(index, spec, tensor, changed, mask)

    @property
    def done(self) -> bool:
        """Whether every parameter of the walk was yielded (a consumer may stop at the last one without
        asking for more, as vLLM's ``iter_groups`` does)."""
        return self._started and self.params == len(self.order)

    def close(self) -> None:
        """Release the parameter the walk holds gathered, if any (local; :meth:`acknowledge` does it)."""
        if self._generator is not None:
            self._generator.close()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.began

    def acknowledge(self) -> None:
        """The engine confirmed this walk's weights (every rank; local): later delta walks are against
        them. Refused before the walk ended, or when the model took an optimizer step since it began
        (the baseline would not be the bits that were sent)."""
        if not self.done:
            raise RuntimeError("acknowledge() after the walk was consumed to the end")
        self.close()
        if getattr(self.source.model, "global_steps", None) != self._steps:
            raise RuntimeError("the model stepped between the walk and its acknowledgement; the walk's bits are gone")
        self.source._acknowledge(self)

    def abort(self) -> None:
        """The engine did not confirm: nothing changes, the next walk is against the last acknowledged
        version (a consumer whose engine may hold half an update calls ``require_dense`` instead)."""
        self.close()

    def report(self, *, bytes: int = 0, params: int | None = None, elements: int | None = None,
               **engine: Any) -> ServedReport:
        """This walk as a :class:`ServedReport` (``params``/``elements`` default to what it yielded)."""
        return ServedReport(version=self.version, kind=self.kind, params=self.params if params is None else params,
                            changed=self.changed, numel=self.source.numel, bytes=bytes, seconds=self.seconds,
                            elements=self.elements if elements is None else elements,
                            params_total=self.source.params_total, gathers=self.gathers,
                            tracking=self.source.tracking, tracking_bytes=self.source.tracking_bytes, **engine)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _readable(reader: ServedReader) -> bool:
    try:
        reader.local_slices()
    except ValueError:
        return False
    return True


def _group_rank_world(group: Any) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return rank_world()
    return dist.get_rank(group), dist.get_world_size(group)


def _global_rank0(group: Any) -> int:
    """The default-group rank of ``group``'s rank 0 (what ``dist.gather``'s ``dst`` names)."""
    return 0 if group is None else dist.get_global_rank(group, 0)
