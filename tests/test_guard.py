"""faircast_ds.deepspeed.guard in process, on a stand-in adapter over two flat groups and the real
ShardCaster: it passes what the caster wrote, and names the first element that something else
overwrote, in the full and in the sampled check. The guard on real DeepSpeed releases, with DeepSpeed
made to overwrite the partition after the cast: tests/test_releases.py."""
from __future__ import annotations

import pytest
import torch

from faircast_ds.adapter import Adapter, UnsupportedSetupError
from faircast_ds.config import FairCastConfig
from faircast_ds.deepspeed import guard as guard_mod
from faircast_ds.deepspeed.guard import Guard
from faircast_ds.shard_caster import NonFiniteWeightError, ShardCaster, ShardSlice, with_padding

N = 4000


class TwoGroups(Adapter):
    """Two flat shards; the second holds many small parameters (more than one sampled check reads)."""

    def __init__(self, caster: ShardCaster) -> None:
        super().__init__(optimizer=object(), caster=caster, names={})
        gen = torch.Generator().manual_seed(0)
        self.masters = [torch.randn(N, generator=gen) * 0.05, torch.randn(N, generator=gen) * 0.05]
        self.served = [m.to(torch.bfloat16) for m in self.masters]
        self.slices = [with_padding([ShardSlice("big.w", 7, 3000, 10), ShardSlice("big.b", 0, 900, 3050)], N),
                       with_padding([ShardSlice(f"small.{i}", 0, 90, 100 * i) for i in range(40)], N)]

    def install(self) -> None:
        pass

    def flat_groups(self):
        for i in range(2):
            yield i, self.masters[i], self.served[i], self.slices[i]

    def publish(self) -> None:
        pass


def setup(mode: str = "stochastic") -> tuple[TwoGroups, Guard]:
    adapter = TwoGroups(ShardCaster(FairCastConfig(mode=mode, seed=3)))
    return adapter, Guard(adapter, describe_sites="the stand-in's sites")


def step(adapter: TwoGroups, g: Guard, *, full: bool) -> None:
    g.prepare(full=full)
    adapter.caster.begin_step()
    adapter.cast_all()


def overwrite(adapter: TwoGroups, group: int, start: int, stop: int) -> None:
    """What a moved cast site does: round-to-nearest over the served shard after the cast."""
    adapter.served[group][start:stop] = adapter.masters[group][start:stop].to(torch.bfloat16)


@pytest.mark.parametrize("full", (True, False))
def test_what_the_caster_wrote_passes(full):
    adapter, g = setup()
    step(adapter, g, full=full)
    assert g.local_problem("step 1") is None
    g.check("step 1")  # one process: no collective
    assert all(rec.full is None for rec in g.records.values())  # the full copy is dropped after the check


def test_the_full_check_names_the_first_overwritten_element():
    adapter, g = setup()
    step(adapter, g, full=True)
    overwrite(adapter, 0, 3050 + 100, 3050 + 900)  # inside big.b, which starts at offset 3050
    changed = int((adapter.masters[0][3150:3950].to(torch.bfloat16).view(torch.int16)
                   != g.records[0].full[3150:3950]).sum())
    assert changed > 100  # stochastic rounding differs from round-to-nearest on many of them
    with pytest.raises(UnsupportedSetupError) as info:
        g.check("the first optimizer step (Stand.step)")
    message = str(info.value)
    assert message.startswith(f"fair_cast: after the first optimizer step (Stand.step): {changed} of 7500 checked")
    assert "first: parameter 'big.b' element " in message and "flat group 0" in message
    first = int(message.split("element ")[1].split(",")[0])
    assert 100 <= first < 900 and "the stand-in's sites" in message and "round-to-nearest" in message


def test_the_sampled_check_catches_an_overwrite_and_rotates_over_parameters():
    adapter, g = setup()
    step(adapter, g, full=False)
    rec = g.records[1]
    read = {i for i, _ in rec.picks}
    assert len(read) == guard_mod.SAMPLE_SLICES < 40  # a sample of the 40 parameters of group 1
    step(adapter, g, full=False)
    assert {i for i, _ in g.records[1].picks} != read  # the next step reads others
    overwrite(adapter, 1, 0, N)
    with pytest.raises(UnsupportedSetupError, match=r"after optimizer step 2: \d+ of \d+ checked .* 'small\.\d+'"):
        g.check("optimizer step 2")


def test_a_group_never_cast_or_reshaped_is_refused():
    adapter, g = setup()
    with pytest.raises(UnsupportedSetupError, match="flat group 0 was never cast by Fair Cast"):
        g.check("step 1")
    step(adapter, g, full=True)
    adapter.slices[1] = with_padding([ShardSlice("small.0", 0, 90, 0)], N)
    assert "changed its layout" in g.local_problem("step 2")


def test_a_shard_cast_before_a_nonfinite_error_is_still_recorded():
    adapter, g = setup()
    adapter.masters[1][5] = float("nan")
    with pytest.raises(NonFiniteWeightError):
        step(adapter, g, full=True)
    assert 1 in g.records  # the whole shard was cast before the error: it is what Fair Cast wrote
    assert torch.equal(g.records[1].full, adapter.served[1].view(torch.int16))


def test_recording_inside_a_prepared_step_allocates_nothing_new():
    """The buffers are made by prepare() (outside the cast): recording writes into them."""
    adapter, g = setup()
    g.prepare(full=True)
    ready = {k: r.full.data_ptr() for k, r in g.ready.items()}
    adapter.caster.begin_step()
    adapter.cast_all()
    assert {k: r.full.data_ptr() for k, r in g.records.items()} == ready
    g.check("step 1")
    g.prepare(full=False)
    values = {k: r.values.data_ptr() for k, r in g.ready.items()}
    adapter.caster.begin_step()
    adapter.cast_all()
    assert {k: r.values.data_ptr() for k, r in g.records.items()} == values


def test_bits_a_restore_writes_itself_are_taken_as_fair_casts():
    """error_feedback's restore puts the saved served bits into the shards without a cast; the caster tells
    its observers (checkpoint.publish_restored), so the full check after the load passes on them, and
    still catches a later overwrite."""
    from faircast_ds.cast_state import publish_restored

    adapter, g = setup("error_feedback")
    step(adapter, g, full=True)
    g.prepare(full=True)  # a load
    for served in adapter.served:  # the saved bits: a cast of other masters, written in place
        served.copy_((torch.randn(N, generator=torch.Generator().manual_seed(5)) * 0.05).to(torch.bfloat16))
    publish_restored(adapter, adapter.caster)
    g.check("load_checkpoint(x)")
    g.prepare(full=True)
    publish_restored(adapter, adapter.caster)
    overwrite(adapter, 1, 100, 101)  # after the restore: not ours
    adapter.served[1][100] = adapter.served[1][100] + 1.0
    with pytest.raises(UnsupportedSetupError, match="element 0, flat group 1"):
        g.check("load_checkpoint(x)")
