"""The run-time guard, route-neutral: what a framework serves is what Fair Cast wrote, or the run stops.

Fair Cast replaces a framework's fp32 -> bf16 refresh at the sites it knows. A release that moved one
(a second copy after ours, a renamed method that is no longer called, another buffer gathered in its
place) would serve round-to-nearest without a word. :class:`Guard` turns that into an error:

- every cast the caster makes is recorded where it wrote it: a digest of every block of 4,096 elements
  when a full check will read the record (the first optimizer step, every checkpoint load), the bits of a
  small sample of elements otherwise;
- :meth:`Guard.check` compares on every rank, element for element, what the adapter says the framework
  serves (``Adapter.served_views``) with that record: fully after the first step and loads, a rotating
  sample (up to 32 parameters of each flat group, 64 elements of each) after later steps.

A mismatch on any rank raises ``UnsupportedSetupError`` on every rank, naming where it was found (which
step or load, which parameter and element, the two bit patterns) and, in the integration's words
(``explain``), which release refreshed the copy and what to do. When to check is the integration's:
``faircast_ds.deepspeed.guard`` (around ``engine.step`` and ``load_checkpoint``) and
``faircast_ds.megatron.guard`` (around the optimizer's ``step`` and Fair Cast's checkpoint load). Nothing
here changes a served bit, and nothing here imports a framework.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import torch

from faircast_ds._util import dist
from faircast_ds.shard.adapter import Adapter, UnsupportedSetupError
from faircast_ds.shard.caster import ShardSlice

SAMPLE_SLICES = 32  # parameters of a flat group read by one sampled check
SAMPLE_ELEMENTS = 64  # elements of each
BLOCK = 4096  # elements per digest of a full record
_CHUNK_BLOCKS = 256  # blocks digested at a time (an 8 MiB int64 temporary)
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int16)


def _weights(device: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None:  # fixed odd weights below 2^31: a digest of 4,096 16-bit values stays below 2^59
        gen = torch.Generator().manual_seed(0x6A09E667)
        w = (torch.randint(1, 2**31, (BLOCK,), generator=gen, dtype=torch.int64) | 1).to(device)
        _WEIGHTS[device] = w
    return w


def _weights32(device: torch.device) -> torch.Tensor:
    """The same weights as int32 (all below 2^31), for the fused CPU digest."""
    w = _WEIGHTS.get((device, "int32"))
    if w is None:
        w = _weights(device).to(torch.int32)
        _WEIGHTS[(device, "int32")] = w
    return w


def _fused_digests(bits: torch.Tensor, out: torch.Tensor) -> bool:
    """:func:`block_digests` by the fused CPU kernel (one read of the bits, ~40x faster than the torch
    code below on a 2-core CPU); False where that kernel is not what casts this tensor (then the torch code
    computes the same sums)."""
    if bits.device.type != "cpu" or bits.element_size() != 2 or not bits.is_contiguous() or not out.is_contiguous():
        return False
    from faircast_ds.casting import kernels

    if kernels.backend_for(bits.device) != "cpp":
        return False
    from faircast_ds.casting.kernels import cpu

    cpu.load().block_digests(bits.data_ptr(), bits.numel(), out.data_ptr(), _weights32(bits.device).data_ptr(), BLOCK)
    return True


@torch.no_grad()
def block_digests(bits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """One int64 per block of :data:`BLOCK` elements of 1-D int16 ``bits``: the sum of each element's
    16-bit pattern times a fixed odd weight of its position in the block (no overflow). Any one changed
    element changes its block's digest; several collide with a chance of about 2^-31. On CPU the fused
    kernel computes it in one read of the bits; elsewhere torch, a chunk of 256 blocks at a time, whatever
    the size of ``bits``."""
    n = bits.numel()
    blocks = -(-n // BLOCK)
    if out is None:
        out = torch.empty(blocks, dtype=torch.int64, device=bits.device)
    if out.numel() != blocks or out.dtype != torch.int64:
        raise ValueError(f"block_digests: {n} elements need {blocks} int64 digests, got {out.numel()} {out.dtype}")
    if n and _fused_digests(bits, out):
        return out
    return torch_block_digests(bits, out)


@torch.no_grad()
def torch_block_digests(bits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`block_digests` in torch ops (any device; the definition the fused kernel is tested against)."""
    n = bits.numel()
    w = _weights(bits.device)
    step = _CHUNK_BLOCKS * BLOCK
    buf = torch.empty(min(step, n), dtype=torch.int64, device=bits.device)  # made once, never above the input
    for at in range(0, n, step):
        chunk = bits.narrow(0, at, min(step, n - at))
        whole, rest, b0 = chunk.numel() // BLOCK, chunk.numel() % BLOCK, at // BLOCK
        if whole:
            x = buf.narrow(0, 0, whole * BLOCK).view(whole, BLOCK)
            x.copy_(chunk.narrow(0, 0, whole * BLOCK).view(whole, BLOCK))
            torch.sum(x.bitwise_and_(0xFFFF).mul_(w), dim=1, out=out.narrow(0, b0, whole))
        if rest:
            x = buf.narrow(0, 0, rest)
            x.copy_(chunk.narrow(0, whole * BLOCK, rest))
            out[b0 + whole] = x.bitwise_and_(0xFFFF).mul_(w[:rest]).sum()
    return out


@dataclass
class _Record:
    """What the caster last wrote into one flat group: all of it (``full``: the :func:`block_digests` of
    each parameter slice) or a sample (``picks``: the position of a parameter slice among the group's
    parameter slices and element indices in it; ``flat``: the same elements' offsets in the flat shard;
    ``values``: their bits)."""

    source: Sequence[ShardSlice]  # the adapter's slice list the record was made for
    slices: list[ShardSlice]  # its parameter slices
    full: list[torch.Tensor] | None = None
    picks: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    flat: torch.Tensor | None = None
    values: torch.Tensor | None = None


class Guard:
    """Records the caster's writes and checks the served copy against them (see the module docstring)."""

    def __init__(self, adapter: Adapter, *, describe_sites: str,
                 explain: Callable[[], str] | None = None) -> None:
        self.adapter = adapter
        # what a mismatch means in this framework (its release, the sites): an integration's own words
        self.explain = explain or (lambda: f"the served copy was refreshed outside the cast sites Fair Cast routes "
                                           f"({describe_sites}), so this run would serve round-to-nearest without "
                                           "saying so")
        self.caster = adapter.caster
        self.sites = describe_sites
        self.records: dict[Hashable, _Record] = {}
        self.ready: dict[Hashable, _Record] = {}  # made before a step or load, filled by its casts
        self.full_pending = True  # the next check reads everything (the first step)
        self.record_full = False  # casts now record every bit
        self.steps_checked = 0
        self._counters: tuple[int, int] = (0, 0)  # (caster step, applied optimizer steps) before engine.step
        self.paused = False  # inside superseded(): casts are not recorded
        self.caster.observers.append(self)  # every cast is recorded where it was written

    @contextmanager
    def superseded(self):
        """Casts made inside are not recorded: the caller casts every flat group again before the check
        (a checkpoint load: the framework's load sites cast at the old step, then the restore casts at the
        saved one), so their digests would be computed only to be replaced. A flat group the later cast
        misses keeps its older record, which the check then finds differs: an error, never a pass."""
        before, self.paused = self.paused, True
        try:
            yield self
        finally:
            self.paused = before

    # ---- recording (the caster's observer) ------------------------------------------------------------
    def on_cast(self, key: Hashable, master: torch.Tensor, served: torch.Tensor, slices: Sequence[ShardSlice],
                step: int) -> None:
        """Called by the caster once a flat shard is cast (also when the cast then raises on a non-finite
        weight: what it wrote is still Fair Cast's)."""
        self.record(key, served, slices)

    def on_restored(self, key: Hashable, served: torch.Tensor, slices: Sequence[ShardSlice]) -> None:
        """Error feedback's restore writes the saved served bits into the shards itself: they are ours."""
        self.record(key, served, slices)

    def prepare(self, *, full: bool) -> None:
        """Before a step or a load: make the records' buffers now, so that recording inside the cast
        allocates little (a full record is 8 bytes per 4,096 shard elements, held until the check)."""
        self.record_full = full
        if full:  # the digest weights are made here, outside the cast
            for _, _, served, _ in self.adapter.flat_groups():
                _weights(served.device)
                if served.device.type == "cpu":
                    _weights32(served.device)
        self.ready = {key: self._new_record(slices, served.numel(), served.device, self.caster.step + 1, full)
                      for key, _, served, slices in self.adapter.flat_groups()}

    def _new_record(self, slices: Sequence[ShardSlice], numel: int, device: torch.device, step: int,
                    full: bool) -> _Record:
        params = [s for s in slices if not s.is_padding]
        rec = _Record(slices, params)
        if full:
            rec.full = [torch.empty(-(-s.numel // BLOCK), dtype=torch.int64, device=device) for s in params]
            return rec
        rec.picks = self._picks(params, step, device)
        if rec.picks:
            rec.flat = torch.cat([idx + params[i].offset for i, idx in rec.picks])
            rec.values = torch.empty(rec.flat.numel(), dtype=torch.int16, device=device)
        return rec

    @staticmethod
    def _picks(params: list[ShardSlice], step: int, device: torch.device) -> list[tuple[int, torch.Tensor]]:
        if not params:
            return []
        n = len(params)
        chosen = range(n) if n <= SAMPLE_SLICES else [(step * SAMPLE_SLICES + j) % n for j in range(SAMPLE_SLICES)]
        gen = torch.Generator().manual_seed(1_000_003 * step + n)
        host = [(i, torch.arange(params[i].numel) if params[i].numel <= SAMPLE_ELEMENTS
                 else torch.randint(0, params[i].numel, (SAMPLE_ELEMENTS,), generator=gen)) for i in chosen]
        on_device = torch.cat([idx for _, idx in host]).to(device)  # one copy to the device, not one per slice
        picks, at = [], 0
        for i, idx in host:
            picks.append((i, on_device.narrow(0, at, idx.numel())))
            at += idx.numel()
        return picks

    @torch.no_grad()
    def record(self, key: Hashable, served: torch.Tensor, slices: Sequence[ShardSlice]) -> None:
        """Note what Fair Cast just wrote into ``served`` (the flat shard of group ``key``)."""
        if self.paused:
            return
        bits = _bits(served)
        rec = self.ready.pop(key, None)
        if rec is None or rec.source is not slices or (rec.full is not None) != self.record_full:
            rec = self._new_record(slices, bits.numel(), bits.device, self.caster.step, self.record_full)
        if rec.full is not None:
            for s, digests in zip(rec.slices, rec.full):
                block_digests(bits.narrow(0, s.offset, s.numel), out=digests)
        elif rec.flat is not None:
            if rec.flat.device == bits.device and rec.values.device == bits.device:
                torch.index_select(bits, 0, rec.flat, out=rec.values)
            else:  # e.g. the hook route's host staging buffer
                rec.values.copy_(bits.index_select(0, rec.flat.to(bits.device)))
        self.records[key] = rec

    # ---- checking ------------------------------------------------------------------------------------
    def local_problem(self, site: str) -> str | None:
        """This rank's first disagreement between the served copy and the record, described; or None.
        One device synchronization for all the comparisons (a second one only to describe a mismatch)."""
        compared = []  # (mismatches, key, slice, served bits, recorded bits, element indices or None)
        for key, _, _, _ in self.adapter.flat_groups():
            rec = self.records.get(key)
            views = list(self.adapter.served_views(key))
            if not views:
                continue
            if rec is None:
                return f"flat group {key!r} was never cast by Fair Cast: {self._moved()}"
            if self.record_full and rec.full is None:  # a full check reads only what was cast since prepare()
                return (f"after {site}: flat group {key!r} was not cast by Fair Cast since this check was prepared, "
                        f"so what it serves was not checked: {self._moved()}")
            if len(views) != len(rec.slices) or (rec.full is not None and [s for s, _ in views] != rec.slices):
                return f"flat group {key!r} changed its layout since Fair Cast cast it: {self._moved()}"
            if rec.full is not None:
                pairs = ((s, block_digests(_bits(v).to(want.device)), want, None) for (s, v), want in zip(views, rec.full))
            else:
                pairs = self._sampled_pairs(views, rec)
            for s, got, want, idx in pairs:
                got = got.to(want.device)
                compared.append(((got != want).sum(), key, s, got, want, idx))
        if not compared:
            return None
        try:
            bad = torch.stack([c[0] for c in compared]).tolist()
        except RuntimeError:  # counts on more than one device
            bad = [int(c[0]) for c in compared]
        if not any(bad):
            return None
        i = next(i for i, n in enumerate(bad) if n)
        _, key, s, got, want, idx = compared[i]
        j = int((got != want).nonzero()[0, 0])
        if self.records[key].full is not None:  # a full check compares block digests
            blocks = sum(c[4].numel() for c in compared)
            first = s.start + j * BLOCK
            return (f"after {site}: {int(sum(bad))} of {blocks} checked blocks of up to {BLOCK} served bf16 elements "
                    f"differ from what Fair Cast wrote (first: parameter {s.name!r} elements {first}.."
                    f"{first + min(BLOCK, s.numel - j * BLOCK) - 1}, flat group {key!r}). {self._moved()}")
        checked = sum(c[4].numel() for c in compared)
        element = s.start + (int(idx[j]) if idx is not None else j)
        served, wrote = int(got[j]) & 0xFFFF, int(want[j]) & 0xFFFF
        return (f"after {site}: {int(sum(bad))} of {checked} checked served bf16 elements differ from what Fair Cast "
                f"wrote (first: parameter {s.name!r} element {element}, flat group {key!r}: served 0x{served:04x}, "
                f"Fair Cast wrote 0x{wrote:04x}). {self._moved()}")

    @staticmethod
    def _sampled_pairs(views: list[tuple[ShardSlice, torch.Tensor]], rec: _Record):
        at = 0
        for i, idx in rec.picks:
            s, v = views[i]
            k = idx.numel()
            got = _bits(v).index_select(0, idx.to(v.device))
            yield s, got, rec.values.narrow(0, at, k), idx
            at += k

    def _moved(self) -> str:
        """What a mismatch means and what to do: the integration's words (its release, its range)."""
        return self.explain()

    def check(self, site: str) -> None:
        """Compare on every rank (a collective: one all-reduce of a flag; the messages are gathered only
        when a rank found a mismatch); raise UnsupportedSetupError on every rank on a mismatch."""
        problem = self.local_problem(site)
        error = None
        if _any_rank(problem is not None):
            error = dist.first_failure(lambda: _raise(problem), UnsupportedSetupError)
        self.full_pending = False
        self.record_full = False
        self.ready = {}
        for rec in self.records.values():  # the full copies were for this check only
            rec.full = None
        if error is not None:
            raise UnsupportedSetupError(f"fair_cast: {error}")



def _raise(problem: str | None) -> None:
    if problem is not None:
        raise UnsupportedSetupError(problem)


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (one all-reduce of one element, on the device the backend
    takes: dist.all_reduce_sum)."""
    return dist.all_reduce_sum([1.0 if flag else 0.0])[0] > 0
