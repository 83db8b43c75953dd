"""What changed since an engine's acknowledged version (issue 32 item 4): the casts' change marks where
the reader offers them, a kept copy of the bits otherwise (faircast_ds/export/source.py), through a
real ShardCaster over the stand-in adapter's two flat shards and the one attach handle (FairCast).

The oracle is a copy of the served shards taken here at each acknowledgement and compared element by
element with numpy, plus the union of what each step changed (the marks may also hold an element that
changed and changed back)."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from stand_ins import TwoGroups

from faircast_ds.config.section import FairCastConfig
from faircast_ds.export.served import adapter_slices
from faircast_ds.export.source import ServedSource
from faircast_ds.export.source import BaselineTracker, MarksTracker, tracker_for
from faircast_ds.shard.caster import ShardCaster
from faircast_ds.shard.handle import FairCast


class Reader:
    """A reader over the stand-in adapter's served shards, offering the handle's marks (as
    faircast_ds.deepspeed.reader.DeepSpeedReader does for an engine)."""

    group = None

    def __init__(self, fair_cast: FairCast | None, adapter: TwoGroups, marks: bool = True) -> None:
        from faircast_ds.export.served import ParamSpec

        self.fair_cast, self.adapter, self.offer = fair_cast, adapter, marks
        names = sorted({s.name for sl in adapter.slices for s in sl if not s.is_padding})
        sizes = {}
        for sl in adapter.slices:
            for s in sl:
                if not s.is_padding:
                    sizes[s.name] = max(sizes.get(s.name, 0), s.start + s.numel)
        self.specs = [ParamSpec(n, (sizes[n],), torch.bfloat16) for n in names]

    def local_slices(self):
        return adapter_slices(self.adapter)

    def is_gathered(self, index):
        return False

    @contextlib.contextmanager
    def full(self, index):  # the walks below read only the changed counts
        yield torch.zeros(self.specs[index].shape, dtype=torch.bfloat16)

    def change_marks(self):
        return self.fair_cast.change_marks() if self.offer else None


def attached(mode: str = "dither") -> tuple[FairCast, TwoGroups]:
    adapter = TwoGroups(ShardCaster(FairCastConfig(mode=mode, seed=3)))
    return FairCast(adapter.caster.config, [adapter], route="deepspeed-runtime"), adapter


def step(adapter: TwoGroups, scale: float = 3e-6, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for m in adapter.masters:
        m += torch.randn(m.numel(), generator=gen) * scale
    adapter.caster.begin_step()
    adapter.cast_all()


def bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().copy()


def test_marks_and_a_kept_copy_answer_alike_and_the_marks_cost_a_sixteenth():
    fc, adapter = attached()
    values = [s.values for s in adapter_slices(adapter)]
    marks = tracker_for(Reader(fc, adapter), values)
    copy = BaselineTracker()
    assert isinstance(marks, MarksTracker)
    marks.acknowledge(values)
    copy.acknowledge(values)
    acked = [bits(v) for v in values]
    union = [np.zeros(v.numel(), dtype=bool) for v in values]
    for k in range(3):
        before = [bits(v) for v in values]
        step(adapter, seed=k)
        for u, b, v in zip(union, before, values):
            u |= b != bits(v)
    net = [a != bits(v) for a, v in zip(acked, values)]
    assert sum(int(n.sum()) for n in net) > 0
    for i, v in enumerate(values):
        assert np.array_equal(marks.mask(i, v).numpy(), union[i])
        assert np.array_equal(copy.mask(i, v).numpy(), net[i])
    assert marks.counts(values) == [int(u.sum()) for u in union]
    assert copy.counts(values) == [int(n.sum()) for n in net]
    local = sum(v.numel() for v in values)
    assert copy.nbytes == 2 * local
    assert marks.nbytes <= sum(m.numel() for m in adapter.masters) // 8 + 8  # both flat shards, padding included
    marks.acknowledge(values)
    assert marks.counts(values) == [0] * len(values)


def test_who_gets_the_marks():
    fc, adapter = attached()
    values = [s.values for s in adapter_slices(adapter)]
    assert isinstance(tracker_for(Reader(fc, adapter, marks=False), values), BaselineTracker)  # none offered
    first = tracker_for(Reader(fc, adapter), values)
    assert isinstance(first, MarksTracker)
    # a second consumer (another engine, its own acknowledged version) keeps a copy instead
    assert isinstance(tracker_for(Reader(fc, adapter), values), BaselineTracker)
    foreign = [torch.zeros(10, dtype=torch.bfloat16)]
    first.close()
    assert isinstance(tracker_for(Reader(fc, adapter), foreign), BaselineTracker)  # not a view the cast marks
    assert isinstance(tracker_for(Reader(fc, adapter), values), MarksTracker)  # released: the next one takes them


def test_a_load_or_a_restore_makes_the_next_delta_whole():
    fc, adapter = attached("error_feedback")
    values = [s.values for s in adapter_slices(adapter)]
    tracker = tracker_for(Reader(fc, adapter), values)
    tracker.acknowledge(values)
    step(adapter)
    some = tracker.counts(values)
    assert 0 < sum(some) < sum(v.numel() for v in values)
    tracker.acknowledge(values)
    fc.served_rewritten()  # what the DeepSpeed and Megatron checkpoint loads call
    assert tracker.counts(values) == [v.numel() for v in values]
    tracker.acknowledge(values)
    adapter.caster.restored(1, adapter.served[1], adapter.slices[1])  # error feedback's served bits put back
    counts = tracker.counts(values)
    in_second = [s.values.data_ptr() >= adapter.served[1].data_ptr() and
                 s.values.data_ptr() < adapter.served[1].data_ptr() + 2 * adapter.served[1].numel()
                 for s in adapter_slices(adapter)]
    assert counts == [v.numel() if second else 0 for v, second in zip(values, in_second)]


@pytest.mark.parametrize("offer", [True, False])
def test_a_delta_walk_yields_what_changed_either_way(offer):
    """ServedSource's delta walk over the same steps: the parameters it yields and their changed counts
    are the net change (the kept copy) or the union of the steps' changes (the marks)."""
    fc, adapter = attached("dither")  # a fixed threshold: an unmoved master keeps its served bits
    reader = Reader(fc, adapter, marks=offer)
    source = ServedSource(reader=reader, delta=True)
    adapter.caster.begin_step()
    adapter.cast_all()  # the served shards are the cast's from the start
    walk = source.walk(version=1)
    for _ in walk:
        pass
    walk.acknowledge()
    assert source.tracking == ("marks" if offer else "baseline")
    acked = {s.name + f"@{s.start}": bits(s.values) for s in adapter_slices(adapter)}
    adapter.masters[0][10:500] += 1e-3  # part of big.w moves, nothing else
    adapter.caster.begin_step()
    adapter.cast_all()
    walk = source.walk(version=2)
    got = {item.name: item.changed for item in walk}
    walk.acknowledge()
    want: dict[str, int] = {}
    for s in adapter_slices(adapter):
        n = int((acked[s.name + f"@{s.start}"] != bits(s.values)).sum())
        want[s.name] = want.get(s.name, 0) + n
    want = {k: v for k, v in want.items() if v}
    assert list(want) == ["big.w"] and 0 < want["big.w"] <= 490
    assert got == want  # one step: the union is the net change
