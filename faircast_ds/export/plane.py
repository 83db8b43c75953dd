"""The data plane's pieces every transport shares (issue 32 items 2 and 7): where each served parameter
lives in one flat staging segment, what a trainer rank reports after writing its own slices there,
and the engine's ledger that turns the ranks' reports into one all-or-nothing commit.

Nothing here moves bytes or knows a socket. A transport supplies a :class:`Segment` (bytes the engine
owns and the trainer ranks may write): :class:`HostSegment` is the CPU one (a ``memfd`` mapped in both
processes, :mod:`faircast_ds.vllm.transfer.segment`); :class:`TensorSegment` is any uint8 tensor, a GPU
engine's staging included, which :mod:`faircast_prepared.bucket_stream` (beside the package) fills bucket by bucket. The tests drive the ledger, the layout and the
digests through :class:`HostSegment` alone.

**Layout.** Parameter ``i`` occupies ``[offset[i], offset[i] + numel * element_size)``, offsets in
parameter order, each aligned to :data:`ALIGN` bytes. Element ``e`` of a parameter's flattened tensor
sits at ``offset[i] + e * element_size``.

**A rank's write.** Each trainer rank holds slices ``(param index, start element, numel)`` of the
served parameters (over the ranks they cover every element exactly once: the served reader's
contract). It declares them once (its hello), then per update writes the slices of the parameters
the update carries and reports ``(version, params, bytes, digest)``. The digest (:func:`write_digest`)
is SHA-256 over each written slice's coordinates and :data:`SAMPLES` of its elements at fixed
positions, the first and last included, taken from the bits the rank meant to write; the engine
recomputes it from the segment at the declared places. It catches a slice written at the wrong
offset, a short write, or another rank's bytes at the sampled positions; it is not a MAC (the bulk
bytes are trusted because only authenticated peers ever hold the segment) and not a full content
check (the post-load check reads the kernels back against the segment).

**Commit.** :class:`Ledger` (the engine's): a write of version ``v`` begins (the segment is dirty from
then on until a commit); every rank reports; rank 0 commits with the world size and the parameters
the update carries. The commit is counted only when *every* rank of the world reported version
``v``, the reported parameters are exactly the commit's, each rank's byte count equals its declared
slices of those parameters, the ranks' slices cover each parameter exactly once, and every digest
matches. A rank that vanishes before the commit fails the write. Until a later dense write commits,
a dirty segment takes no delta. Versions only increase: a write of a version not newer than the last
one committed (or named by a no-change update) is refused before it begins, so a version names one set
of bits and the engine's weight version never goes back within a session.
"""
from __future__ import annotations

import hashlib
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence

import torch

from faircast_ds.export.served import ParamSpec

ALIGN = 64  # bytes: every parameter starts on a cache line
SAMPLES = 16  # elements sampled per written slice by write_digest
_COORD = struct.Struct("<qqq")


class PlaneError(RuntimeError):
    """A write or commit on the data plane was refused; the message says why. The engine's model is
    untouched (it changes only at a committed update's load)."""


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Layout:
    """Byte offsets of the served parameters in one flat segment."""

    specs: tuple[ParamSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, specs: Sequence[ParamSpec], align: int = ALIGN) -> "Layout":
        offsets, at = [], 0
        for s in specs:
            at = -(-at // align) * align
            offsets.append(at)
            at += s.numel * element_size(s.dtype)
        return cls(tuple(specs), tuple(offsets), -(-at // align) * align if at else align)

    def span(self, index: int, start: int = 0, numel: int | None = None) -> tuple[int, int]:
        """``(byte offset, byte count)`` of elements ``[start, start + numel)`` of parameter ``index``;
        ValueError outside the parameter."""
        if not 0 <= index < len(self.specs):
            raise ValueError(f"parameter index {index} out of range [0, {len(self.specs)})")
        spec = self.specs[index]
        numel = spec.numel - start if numel is None else numel
        if start < 0 or numel < 0 or start + numel > spec.numel:
            raise ValueError(f"{spec.name}: elements [{start}, {start + numel}) outside [0, {spec.numel})")
        size = element_size(spec.dtype)
        return self.offsets[index] + start * size, numel * size


class Segment(Protocol):
    """Bytes the engine owns, written in place by trainer ranks (one transport's staging copy)."""

    nbytes: int

    def bytes_at(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 view of ``[offset, offset + nbytes)`` (no copy)."""

    def close(self) -> None: ...


class TensorSegment:
    """A :class:`Segment` over a 1-D uint8 tensor on any device (a GPU engine's staging buffer; no copy)."""

    def __init__(self, flat: torch.Tensor) -> None:
        if flat.dtype != torch.uint8 or flat.dim() != 1:
            raise ValueError(f"a segment is a 1-D uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
        self.flat, self.nbytes = flat, flat.numel()

    def bytes_at(self, offset: int, nbytes: int) -> torch.Tensor:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) outside the segment of {self.nbytes}")
        return self.flat.narrow(0, offset, nbytes)

    def tensor(self, layout: Layout, index: int) -> torch.Tensor:
        """Parameter ``index`` as a tensor of its dtype and shape, over the segment (no copy)."""
        spec = layout.specs[index]
        offset, nbytes = layout.span(index)
        return self.bytes_at(offset, nbytes).view(spec.dtype).view(spec.shape)

    def close(self) -> None:
        self.flat = torch.empty(0, dtype=torch.uint8)


class HostSegment(TensorSegment):
    """A :class:`TensorSegment` in host memory over any writable buffer (an ``mmap`` of a memfd, or a
    ``bytearray`` in tests): a zero-copy uint8 tensor over it."""

    def __init__(self, buffer: Any, nbytes: int) -> None:
        nbytes = int(nbytes)
        super().__init__(torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes) if nbytes
                         else torch.empty(0, dtype=torch.uint8))
        self._buffer = buffer

    def close(self) -> None:
        super().close()
        self._buffer = None


def _sample_positions(numel: int, samples: int = SAMPLES) -> torch.Tensor:
    if numel <= samples:
        return torch.arange(numel, dtype=torch.long)
    # integer arithmetic: float positions round past the end of slices longer than 2^24 elements
    return torch.arange(samples, dtype=torch.long) * (numel - 1) // (samples - 1)


def _as_bytes(values: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as rows of raw bytes: ``[numel, element_size]`` uint8."""
    flat = values.detach().reshape(-1)
    return flat.view(torch.uint8).view(flat.numel(), flat.element_size()) if flat.numel() else \
        torch.empty(0, flat.element_size(), dtype=torch.uint8)


def write_digest(pieces: Iterable[tuple[int, int, torch.Tensor]], samples: int = SAMPLES) -> str:
    """The digest of one rank's write: ``pieces`` are ``(param index, start element, values)`` in the
    order written, ``values`` the elements (any dtype; or a ``[numel, element_size]`` uint8 tensor of
    their bytes, as read back from a segment)."""
    h = hashlib.sha256()
    for index, start, values in pieces:
        rows = values if values.dtype == torch.uint8 and values.dim() == 2 else _as_bytes(values)
        h.update(_COORD.pack(int(index), int(start), rows.shape[0]))
        picked = rows.index_select(0, _sample_positions(rows.shape[0], samples).to(rows.device))
        h.update(picked.cpu().contiguous().numpy().tobytes())  # a device segment's samples come to the host
    return h.hexdigest()


def segment_digest(segment: Segment, layout: Layout, slices: Sequence[tuple[int, int, int]],
                   params: set[int], samples: int = SAMPLES) -> str:
    """:func:`write_digest` of ``slices`` (``(index, start, numel)``) of ``params`` as the segment holds
    them."""
    pieces = []
    for index, start, numel in slices:
        if index in params:
            offset, nbytes = layout.span(index, start, numel)
            size = element_size(layout.specs[index].dtype)
            pieces.append((index, start, segment.bytes_at(offset, nbytes).view(numel, size)))
    return write_digest(pieces, samples)


def slice_bytes(layout: Layout, slices: Sequence[tuple[int, int, int]], params: set[int]) -> int:
    return sum(n * element_size(layout.specs[i].dtype) for i, _, n in slices if i in params)


def coverage_problem(layout: Layout, ranks: dict[int, Sequence[tuple[int, int, int]]], params: set[int]) -> str | None:
    """Why the ranks' slices do not cover each parameter of ``params`` exactly once (None if they do)."""
    per: dict[int, list[tuple[int, int, int]]] = {i: [] for i in params}
    for rank, slices in ranks.items():
        for i, start, numel in slices:
            if i in per and numel:
                per[i].append((start, start + numel, rank))
    for i in sorted(params):
        at = 0
        for start, end, rank in sorted(per[i]):
            if start != at:
                what = "overlap" if start < at else "gap"
                return (f"{layout.specs[i].name}: the ranks' slices {what} at element {min(start, at)} (rank {rank} "
                        f"starts at {start}, covered up to {at})")
            at = end
        if at != layout.specs[i].numel:
            return f"{layout.specs[i].name}: the ranks' slices cover {at} of {layout.specs[i].numel} elements"
    return None


@dataclass
class RankState:
    world: int
    slices: list[tuple[int, int, int]]
    report: dict[str, Any] | None = None  # this write's "written" message
    gone: bool = False


@dataclass
class Commit:
    """A committed write: what the engine loads at the next finish."""

    version: int
    kind: str
    params: set[int]
    bytes: int  # of the segment brought up to date
    stages: dict[str, float] = field(default_factory=dict)
    sent: int = 0  # of them that crossed to the engine (a delta's changed elements only, on the net plane)
    # a net-plane delta: per carried parameter, the flat indices of the elements the ranks' change lists
    # wrote, None where a rank sent a slice of it whole; None for a dense write and on the shm plane
    listed: dict[int, torch.Tensor | None] | None = None


class Ledger:
    """The engine's account of the writes into one segment (thread-safe: each rank's connection is
    served on its own thread). See the module docstring for the rules."""

    def __init__(self, layout: Layout, segment: Segment) -> None:
        self.layout, self.segment = layout, segment
        self.cond = threading.Condition()
        self.ranks: dict[int, RankState] = {}
        self.session: str | None = None
        self.segment_version: int | None = None  # the version whose complete bits the segment holds
        self.last_version: int | None = None  # the newest version committed (or named the same) here
        self.writing: tuple[int, str, int | None] | None = None  # (version, kind, base) of the open write
        self.failure: str | None = None  # why the open write cannot commit
        self.committed: Commit | None = None  # committed, not yet taken by the engine's update call
        self.writes = self.commits = 0
        # set by a host whose ranks send their slices (the net plane): the open write's change lists, per
        # parameter (None once a rank sent a slice of it whole), for Commit.listed
        self.listing = False
        self._listed: dict[int, list[torch.Tensor] | None] = {}

    # -- connections -------------------------------------------------------------------------------
    def join(self, session: str, rank: int, world: int, slices: list[tuple[int, int, int]]) -> None:
        """A rank's hello: its session, place and declared slices (bounds checked here)."""
        if type(rank) is not int or type(world) is not int or not 0 <= rank < world:
            raise PlaneError(f"rank {rank!r} of world {world!r} is not a place in a world")
        for entry in slices:
            if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and all(type(v) is int for v in entry)):
                raise PlaneError(f"rank {rank}: a slice {entry!r} is not [param index, start, numel]")
            try:
                self.layout.span(*entry)
            except ValueError as exc:
                raise PlaneError(f"rank {rank}: {exc}") from None
        with self.cond:
            alive = {r: s for r, s in self.ranks.items() if not s.gone}
            if self.session is not None and session != self.session and alive:
                raise PlaneError(f"already serving another trainer (ranks {sorted(alive)} of session "
                                 f"{self.session[:8]}... are connected)")
            if session != self.session:
                self.session, self.ranks = session, {}
            old = self.ranks.get(rank)
            if old is not None and not old.gone:
                raise PlaneError(f"rank {rank} of this trainer is already connected")
            if any(s.world != world for s in self.ranks.values()):
                raise PlaneError(f"rank {rank} says the world has {world} ranks; others said otherwise")
            self.ranks[rank] = RankState(world, [tuple(e) for e in slices])
            self.cond.notify_all()

    def leave(self, rank: int, session: str | None) -> None:
        """A rank's connection ended (cleanly or not): an open write it had not reported cannot commit."""
        with self.cond:
            state = self.ranks.get(rank)
            if state is None or session != self.session:
                return
            state.gone = True
            if self.writing is not None and state.report is None and self.failure is None:
                self.failure = (f"trainer rank {rank} vanished before reporting its write of version "
                                f"{self.writing[0]}")
            self.cond.notify_all()

    # -- one write -----------------------------------------------------------------------------
    def begin(self, rank: int, version: Any, kind: Any, base: Any) -> None:
        """A rank asks to write ``version``; the first ask of a version opens the write (the segment is
        dirty from here until it commits)."""
        if type(version) is not int or not 0 <= version < 2**63 or kind not in ("dense", "delta"):
            raise PlaneError(f"malformed begin: version {version!r}, kind {kind!r}")
        with self.cond:
            if self.last_version is not None and version <= self.last_version and not (
                    self.writing is not None and self.writing[0] == version):
                # a version names one set of bits, and the engine's weight version must not go back
                raise PlaneError(f"update version {version} is " + (
                    f"older than the weights served (version {self.last_version})" if version < self.last_version
                    else "the version the engine already holds; versions must increase when the weights change"))
            if self.writing is not None and self.writing[0] == version:
                if self.writing[1:] != (kind, base):
                    raise PlaneError(f"rank {rank} writes version {version} as {kind} on {base}, rank 0's write "
                                     f"is {self.writing[1]} on {self.writing[2]}")
                if self.failure is not None:
                    raise PlaneError(f"the write of version {version} already failed: {self.failure}")
                return
            if kind == "delta" and (self.segment_version is None or base != self.segment_version):
                state = ("dirty (a write did not complete)" if self.segment_version is None
                         else f"at version {self.segment_version}")
                raise PlaneError(f"a delta on version {base!r} but the staging segment is {state}: send a dense update")
            self.writing, self.failure, self.committed = (version, kind, base), None, None
            self.segment_version = None  # dirty until the commit
            self._listed = {}
            for s in self.ranks.values():
                s.report = None
            self.writes += 1
            self.cond.notify_all()

    def list_changes(self, index: int, indices: torch.Tensor | None) -> None:
        """The open write changed parameter ``index`` at these flat element indices (a rank's change list,
        already applied), or at elements not listed (None: a slice sent whole)."""
        with self.cond:
            had = self._listed.get(index, [])
            self._listed[index] = None if indices is None or had is None else had + [indices]

    def written(self, rank: int, report: dict[str, Any]) -> None:
        """A rank's report of its write (checked against its declared slices and the segment now)."""
        with self.cond:
            state = self.ranks.get(rank)
            writing = self.writing
        if state is None or writing is None or report.get("version") != writing[0]:
            raise PlaneError(f"rank {rank} reports a write of version {report.get('version')!r}; the open write is "
                             f"{writing[0] if writing else None}")
        params = report.get("params")
        if not (isinstance(params, list) and all(type(i) is int and 0 <= i < len(self.layout.specs) for i in params)):
            raise PlaneError(f"rank {rank}: malformed parameter list in its report")
        chosen = set(params)
        problem = None
        expected = slice_bytes(self.layout, state.slices, chosen)
        if report.get("bytes") != expected:
            problem = f"rank {rank} reports {report.get('bytes')!r} bytes written; its slices of those parameters hold {expected}"
        elif segment_digest(self.segment, self.layout, state.slices, chosen) != report.get("digest"):
            problem = (f"rank {rank}'s write of version {writing[0]} does not match the segment at its declared "
                       "offsets (digest of the sampled elements differs): written at the wrong place, or cut short")
        sent = report.get("sent", expected)  # what crossed to the engine (a sparse delta: less than covered)
        if problem is None and (type(sent) is not int or sent < 0):
            problem = f"rank {rank} reports {str(sent)[:40]!r} bytes sent"
        with self.cond:
            state.report = {"params": chosen, "bytes": expected, "sent": sent, "problem": problem}
            if problem is not None and self.failure is None:
                self.failure = problem
            self.cond.notify_all()

    def commit(self, version: Any, world: Any, params: Any, timeout: float) -> Commit:
        """Rank 0's commit: waits (at most ``timeout`` seconds) for every rank's report, then checks the
        whole write. Raises :class:`PlaneError` (the segment stays dirty) or returns the commit."""
        began = time.perf_counter()
        deadline = time.monotonic() + timeout
        with self.cond:
            if self.writing is None or self.writing[0] != version:
                raise PlaneError(f"commit of version {version!r} but the open write is "
                                 f"{self.writing[0] if self.writing else None}")
            kind = self.writing[1]
            if type(world) is not int or world < 1:
                raise PlaneError(f"commit with a world of {world!r}")
            while True:
                if self.failure is not None:
                    break
                gone = [r for r in range(world) if r in self.ranks and self.ranks[r].gone and self.ranks[r].report is None]
                if gone:
                    self.failure = f"trainer ranks {gone} are gone before reporting their write of version {version}"
                    break
                reported = [r for r in range(world) if r in self.ranks and self.ranks[r].report is not None]
                if len(reported) == world:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in range(world) if r not in reported]
                    self.failure = (f"ranks {missing} did not report their write of version {version} within "
                                    f"{timeout:.0f} s")
                    break
                self.cond.wait(left)
            if self.failure is not None:
                raise PlaneError(self.failure)
            if set(self.ranks) != set(range(world)):
                raise PlaneError(f"commit for a world of {world} but ranks {sorted(self.ranks)} joined")
            want = set(range(len(self.layout.specs))) if kind == "dense" else set(params or ())
            if kind == "delta" and not (isinstance(params, list) and all(type(i) is int for i in params)):
                raise PlaneError("a delta commit lists the parameters it carries")
            for r in range(world):
                got = self.ranks[r].report["params"]
                if got != want:
                    raise self._fail(f"rank {r} wrote {len(got)} parameter(s), the commit carries {len(want)}")
            problem = coverage_problem(self.layout, {r: self.ranks[r].slices for r in range(world)}, want)
            if problem is not None:
                raise self._fail(problem)
            nbytes = sum(self.ranks[r].report["bytes"] for r in range(world))
            listed = None
            if kind == "delta" and self.listing:  # a parameter no rank listed: not known, so None
                listed = {i: torch.cat(self._listed[i]) if self._listed.get(i) else None for i in want}
            done = Commit(version, kind, want, nbytes, {"commit_wait": time.perf_counter() - began},
                          sum(self.ranks[r].report["sent"] for r in range(world)), listed)
            self.segment_version, self.writing, self.committed = version, None, done
            self.last_version = version
            self.commits += 1
            return done

    def same(self, version: Any, base: Any) -> None:
        """A no-change update: the segment's bits are ``base``'s and now also ``version``'s."""
        with self.cond:
            if self.segment_version is None or base != self.segment_version or type(version) is not int:
                raise PlaneError(f"a no-change update on version {base!r} but the staging segment is "
                                 f"{'dirty' if self.segment_version is None else self.segment_version}")
            self.segment_version = self.last_version = version

    def take(self, version: int) -> Commit:
        """The committed write of ``version`` for the engine to load (once)."""
        with self.cond:
            done, self.committed = self.committed, None
        if done is None or done.version != version:
            raise PlaneError(f"no committed write of version {version} in the staging segment"
                             + (f" (the committed one is {done.version})" if done else ""))
        return done

    def fail(self, why: str) -> None:
        """The open write cannot commit, for ``why`` (the first reason stays); a waiting commit wakes."""
        with self.cond:
            self.failure = self.failure or why
            self.cond.notify_all()

    def _fail(self, why: str) -> PlaneError:
        self.failure = why
        return PlaneError(why)
