"""How stale is the served policy? Three figures, computed on each rank's own shard and reduced.

- ``changed_fraction`` (S1): the share of served elements the last cast changed (exact, all elements).
- ``gap_spacings``: mean |master - served| in units of the served value's bf16 spacing (exact).
- ``lag_steps``: the past step whose fp32 master is closest (L2) to the current served copy — the
  brute-force lag — estimated on a fixed sample of about ``sample`` elements of the whole model whose
  master values are kept for the last ``horizon`` steps. An element is in the sample when a hash of
  (parameter, index) falls below ``sample / model elements``, so the sample is the same for any
  sharding; memory is ``sample x horizon x 4`` bytes in all, split across ranks. A lag of
  ``horizon - 1`` means "at least that".
- ``lag_drift_steps``: the lag along the master's recent drift, for regimes where per-step noise makes
  the L2 search read 0. On the same sample, ``D`` = master now - master ``K`` steps ago (``K`` = the
  recorded history, up to ``horizon - 1``) is the drift; the served copy sits ``<master - served, D> /
  |D|^2 x K`` steps of that drift behind the master. Unbiased casts read about 0 (their error is
  uncorrelated with the drift); a copy stuck at an old master reads its age.
- ``bias_spacings``: the signed error of the served copy along the drift, in spacings: the
  ``|D|``-weighted mean over the sample of ``sign(D) x (served - master) / spacing``. Negative: the
  served copy trails the master; 0 for an unbiased cast.

The caster's observer: it sees every cast (``on_cast``); ``compute`` is a collective, run every ``every`` steps.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

import torch

from faircast_ds._util import dist
from faircast_ds.casting.bits import bf16_spacing
from faircast_ds.casting.noise import MASK32, mix32_, name_id
from faircast_ds.config.section import DiagnosticsConfig
from faircast_ds.shard.caster import CastStats, ShardSlice

_SAMPLE_SALT = 0x5A17
# Elements hashed (sample selection) or compared (the gap) at once. Every temporary of the two is a few
# bytes per element of one chunk, so their memory is bounded by this, not by the shard: hashing a
# 155M-element embedding slice whole made ~1.2 GB int64 temporaries at the first cast (issue 23).
CHUNK = 1 << 18


def sampled_indices(part: ShardSlice, threshold: int, chunk: int = CHUNK) -> torch.Tensor:
    """Indices (relative to the slice) of the elements of ``part`` in the sample: those whose hash of
    (parameter, element index) is below ``threshold``. Hashed ``chunk`` elements at a time in buffers
    made once and reused: the temporaries are bounded by the chunk, the result by the sample. (Fresh
    chunk-sized temporaries on every chunk, interleaved with the small kept results, fragment the host
    heap until it grows with the slice anyway.)"""
    salt = name_id(part.name) ^ _SAMPLE_SALT
    n = min(chunk, part.numel)
    index, scratch = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    keep = torch.empty(n, dtype=torch.bool)
    picked = []
    for first in range(0, part.numel, chunk):
        n = min(chunk, part.numel - first)
        x, tmp, below = index[:n], scratch[:n], keep[:n]
        torch.arange(part.start + first, part.start + first + n, dtype=torch.int64, out=x)
        x.bitwise_and_(MASK32).bitwise_xor_(salt)
        mix32_(x, tmp)
        torch.lt(x, threshold, out=below)
        picked.append(first + below.nonzero().flatten())
    return torch.cat(picked) if picked else torch.zeros(0, dtype=torch.int64)


class Diagnostics:
    """Observer of one rank's casts; reduces its figures across ranks on demand."""

    def __init__(self, config: DiagnosticsConfig, model_numel: int) -> None:
        self.config = config
        # an element is sampled when its 32-bit hash is below this threshold
        self._threshold = min(2**32, (config.sample << 32) // max(model_numel, 1))
        self._positions: dict[Hashable, torch.Tensor] = {}
        self._history: dict[Hashable, torch.Tensor] = {}
        self._first: dict[Hashable, int] = {}  # key -> first step recorded (by this process, or the saved run)
        self._slices: dict[Hashable, list[ShardSlice]] = {}  # key -> its parameter slices, to name the sample
        self.last: dict[str, float] = {}

    def _sample_positions(self, slices: Sequence[ShardSlice]) -> torch.Tensor:
        picked = [s.offset + sampled_indices(s, self._threshold) for s in slices if not s.is_padding]
        return torch.cat(picked) if picked else torch.zeros(0, dtype=torch.int64)

    def on_cast(self, key: Hashable, master: torch.Tensor, served: torch.Tensor, slices: Sequence[ShardSlice],
                step: int) -> None:
        """Record the sampled master values of one flat group at this step."""
        if key not in self._positions:
            self._track(key, slices, master.device, step)
        self._history[key][step % self.config.horizon] = master.detach().view(-1)[self._positions[key]]

    def _track(self, key: Hashable, slices: Sequence[ShardSlice], device: torch.device, first: int,
               known: Callable[[ShardSlice], torch.Tensor] | None = None) -> None:
        """Start recording flat group ``key``. ``known``: the sample's indices within a slice, read from a
        checkpoint drawn with this run's threshold (no element hashed); None: hash the slices."""
        kept = [s for s in slices if not s.is_padding]
        same = key in self._positions and self._slices.get(key) == kept and self._positions[key].device == device
        self._slices[key] = kept
        if not same:  # the sample of a flat group depends only on its slices: a reload keeps it (no rehash)
            if known is not None:
                picked = [s.offset + known(s) for s in kept]
                positions = torch.cat(picked) if picked else torch.zeros(0, dtype=torch.int64)
            else:
                positions = self._sample_positions(slices)
            self._positions[key] = positions.to(device)
        self._history[key] = torch.full((self.config.horizon, self._positions[key].numel()), float("nan"),
                                        device=device)
        self._first[key] = first

    def _sample_names(self, key: Hashable) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """The sample of flat group ``key`` by parameter: (name, element indices, columns of the history)."""
        positions = self._positions[key].cpu()
        out = []
        for s in self._slices[key]:
            columns = ((positions >= s.offset) & (positions < s.offset + s.numel)).nonzero().flatten()
            if columns.numel():
                out.append((s.name, positions[columns] - s.offset + s.start, columns))
        return out

    def checkpoint_state(self) -> dict[str, Any]:
        """This rank's sampled master history, keyed by (parameter name, element index) so that any world
        size or stage restores it (the sample itself is the same for any sharding): saved with Fair Cast's
        checkpoint state so that a resumed run's lag reads as the uninterrupted run's."""
        names, counts, indices, columns = [], [], [], []
        for key in self._positions:
            history = self._history[key].cpu()
            for name, index, cols in self._sample_names(key):
                names.append(name)
                counts.append(int(index.numel()))
                indices.append(index)
                columns.append(history.index_select(1, cols))
        covered = [(s.name, s.start, s.numel) for slices in self._slices.values() for s in slices]
        return {"horizon": self.config.horizon, "first": min(self._first.values(), default=None),
                "threshold": self._threshold, "covered": covered, "names": names, "counts": counts,
                "index": torch.cat(indices) if indices else torch.zeros(0, dtype=torch.int64),
                "history": torch.cat(columns, dim=1) if columns else torch.zeros(self.config.horizon, 0)}

    def restore_checkpoint_state(self, states: Sequence[dict[str, Any] | None], flat_groups: Any) -> str | None:
        """Put back the sampled history that every rank saved (``states``: each rank file's
        :meth:`checkpoint_state`) for this rank's ``flat_groups``. Returns why nothing was restored (a
        checkpoint from before the history was saved, another horizon, an element of the sample missing),
        or None. Local: no collective."""
        if not states or any(st is None for st in states):
            return "the checkpoint holds no diagnostics history (saved by an older faircast-ds or without diagnostics)"
        if any(int(st["horizon"]) != self.config.horizon for st in states):
            return f"the checkpoint's diagnostics horizon differs from this run's {self.config.horizon}"
        firsts = [int(st["first"]) for st in states if st["first"] is not None]
        if not firsts:
            return "the checkpoint's diagnostics had recorded nothing"
        saved: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for st in states:
            at = 0
            for name, count in zip(st["names"], st["counts"]):
                index, history = st["index"][at:at + count], st["history"][:, at:at + count]
                if name in saved:
                    index, history = torch.cat([saved[name][0], index]), torch.cat([saved[name][1], history], dim=1)
                saved[name] = (index, history)
                at += count
        for name, (index, history) in saved.items():  # sorted once per parameter, looked up per slice
            order = torch.argsort(index)
            saved[name] = (index[order], history[:, order])
        flat_groups = list(flat_groups)
        known = self._known_sample(states, saved, [s for _, _, _, slices in flat_groups for s in slices])
        tracked = {}
        for key, master, _, slices in flat_groups:
            self._track(key, slices, master.device, min(firsts), known)
            history = torch.full_like(self._history[key], float("nan")).cpu()
            for name, index, cols in self._sample_names(key):
                have = saved.get(name)
                if have is None:
                    return f"the checkpoint's diagnostics sample lacks {name}"
                sorted_index, sorted_history = have
                where = torch.searchsorted(sorted_index, index).clamp(max=max(sorted_index.numel() - 1, 0))
                if sorted_index.numel() == 0 or not torch.equal(sorted_index[where], index):
                    return f"the checkpoint's diagnostics sample lacks elements of {name}"
                history[:, cols] = sorted_history[:, where]
            tracked[key] = history.to(self._history[key].device)
        self._history.update(tracked)
        return None

    def _known_sample(self, states: Sequence[dict[str, Any]], saved: dict[str, tuple[torch.Tensor, torch.Tensor]],
                      slices: Sequence[ShardSlice]) -> Callable[[ShardSlice], torch.Tensor] | None:
        """The sample's indices within a slice as the checkpoint names them, when that is the sample this run
        would draw: every rank file drew it with this run's threshold (the hash is the same for any sharding)
        and the files together covered each of ``slices`` whole. Else None (hash again): a checkpoint from
        before these fields, another model size or sample, or a rank file missing."""
        if any(int(st.get("threshold", -1)) != self._threshold or "covered" not in st for st in states):
            return None
        ranges: dict[str, list[tuple[int, int]]] = {}
        for st in states:
            for name, start, numel in st["covered"]:
                ranges.setdefault(name, []).append((int(start), int(start) + int(numel)))
        for s in slices:
            if s.is_padding:
                continue
            reach = s.start  # the end of the covered prefix of [start, start + numel)
            for lo, hi in sorted(ranges.get(s.name, ())):
                if lo <= reach < hi:
                    reach = hi
            if reach < s.start + s.numel:
                return None
        empty = torch.zeros(0, dtype=torch.int64)

        def known(s: ShardSlice) -> torch.Tensor:
            index = saved.get(s.name, (empty, None))[0]
            lo, hi = torch.searchsorted(index, torch.tensor([s.start, s.start + s.numel])).tolist()
            return index[lo:hi] - s.start
        return known

    def on_restored(self, key: Hashable, served: torch.Tensor, slices: Sequence[ShardSlice]) -> None:
        """A restore wrote the served shard: the figures read it at the next ``compute``; nothing to record."""

    @torch.no_grad()
    def compute(self, flat_groups: Any, stats: CastStats, step: int) -> dict[str, float]:
        """All three figures at ``step`` (a collective: every rank calls it)."""
        horizon = self.config.horizon
        first = min(self._first.values(), default=step)
        depth = min(step - first + 1, horizon)  # how many past steps this process has recorded
        gap_sum = 0.0
        count = 0
        distances = torch.zeros(horizon, dtype=torch.float64)  # by lag k
        # along the drift: <master - served, D>, |D|^2, sum of sign(D) (served - master) / spacing x |D|, sum |D|
        drift = torch.zeros(4, dtype=torch.float64)
        window = depth - 1  # D spans the whole recorded history
        rows = torch.tensor([(step - k) % horizon for k in range(depth)], dtype=torch.int64)
        for key, master, served, slices in flat_groups:
            m = master.detach().view(-1)
            s = served.detach().view(-1).to(m.device)  # fp32 master offloaded: compare on its device
            for part in slices:  # the parameters' elements only (not the alignment padding), a chunk at a time
                if part.is_padding:
                    continue
                for at in range(part.offset, part.offset + part.numel, CHUNK):
                    n = min(CHUNK, part.offset + part.numel - at)
                    got = s.narrow(0, at, n)
                    gap = m.narrow(0, at, n) - got.float()
                    gap.abs_().div_(bf16_spacing(got))  # in place: one temporary per chunk
                    gap_sum += float(gap.sum(dtype=torch.float64))  # a Python float: no small tensor kept between the chunks
                count += part.numel
            if key in self._positions and self._positions[key].numel():
                current = s[self._positions[key]].float()
                history = self._history[key].index_select(0, rows.to(m.device))  # (depth, sample), row k = lag k
                diff = history - current  # squares in fp32, summed in fp64: ample for an argmin, 3x cheaper
                distances[:depth] += (diff * diff).sum(dim=1, dtype=torch.float64).cpu()
                if window > 0:
                    now, old = history[0].double(), history[window].double()
                    d = now - old
                    error = now - current.double()  # master - served, at the sampled elements
                    spacing = bf16_spacing(s[self._positions[key]]).double()
                    drift += torch.stack([(error * d).sum(), (d * d).sum(), (-error / spacing * d).sum(),
                                          d.abs().sum()]).cpu()
        totals = torch.cat([torch.tensor([stats.changed, stats.numel, float(gap_sum), count], dtype=torch.float64),
                            drift, distances])
        if dist.initialized():
            torch.distributed.all_reduce(totals)
        changed, numel, gap_total, n, along, d2, bias_sum, d1 = totals[:8].tolist()
        lag = int(torch.argmin(totals[8:8 + depth]).item()) if depth else 0
        self.last = {"step": float(step), "changed_fraction": changed / numel if numel else 0.0,
                     "gap_spacings": gap_total / n if n else 0.0, "lag_steps": float(lag),
                     "lag_drift_steps": window * along / d2 if d2 > 0 else float("nan"),
                     "bias_spacings": bias_sum / d1 if d1 > 0 else float("nan")}
        return self.last

    def sample_size(self) -> int:
        """Elements this rank tracks for the lag."""
        return sum(p.numel() for p in self._positions.values())
