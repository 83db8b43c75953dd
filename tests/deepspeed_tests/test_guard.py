"""faircast_ds.deepspeed.guard in process, on a stand-in adapter over two flat groups and the real
ShardCaster: it passes what the caster wrote, and names the first element that something else
overwrote, in the full and in the sampled check. The guard on real DeepSpeed releases, with DeepSpeed
made to overwrite the partition after the cast: tests/deepspeed_tests/test_releases.py."""
from __future__ import annotations

import pytest
import torch

from faircast_ds.deepspeed import guard as guard_mod
from faircast_ds.shard.adapter import UnsupportedSetupError
from faircast_ds.shard.caster import NonFiniteWeightError, ShardSlice, with_padding
from stand_ins import N, overwrite, setup, step

@pytest.mark.parametrize("full", (True, False))
def test_what_the_caster_wrote_passes(full):
    adapter, g = setup()
    step(adapter, g, full=full)
    assert g.local_problem("step 1") is None
    g.check("step 1")  # one process: no collective
    assert all(rec.full is None for rec in g.records.values())  # the full copy is dropped after the check


def test_the_full_check_names_the_first_overwritten_block():
    adapter, g = setup()
    step(adapter, g, full=True)
    wrote = adapter.served[0][3150:3950].clone()
    overwrite(adapter, 0, 3050 + 100, 3050 + 900)  # inside big.b, which starts at offset 3050
    assert int((adapter.served[0][3150:3950].view(torch.int16) != wrote.view(torch.int16)).sum()) > 100
    with pytest.raises(UnsupportedSetupError) as info:
        g.check("the first optimizer step (Stand.step)")
    message = str(info.value)
    # one block per parameter here: big.w, big.b and the 40 small ones
    assert message.startswith("fair_cast: after the first optimizer step (Stand.step): 1 of 42 checked blocks")
    assert "differ from what Fair Cast wrote (first: parameter 'big.b' elements 0..899, flat group 0)" in message
    assert "the stand-in's sites" in message and "round-to-nearest" in message


def test_the_full_record_is_a_digest_per_block_and_sees_any_one_changed_element():
    """8 bytes per 4,096 elements, and a change of any one element at any position (any bit) changes its
    block's digest and no other; the chunked digest equals a per-block sum computed here in Python ints."""
    from faircast_ds.shard.guard import BLOCK, _weights, block_digests

    n = 3 * 256 * BLOCK + 1234  # more than one chunk, a partial last block
    bits = torch.randint(-2**15, 2**15, (n,), generator=torch.Generator().manual_seed(1), dtype=torch.int16)
    got = block_digests(bits)
    assert got.dtype == torch.int64 and got.numel() == -(-n // BLOCK)
    w = _weights(bits.device).tolist()
    for b in (0, 255, 256, 700, got.numel() - 1):
        block = bits[b * BLOCK:(b + 1) * BLOCK].tolist()
        assert int(got[b]) == sum((v & 0xFFFF) * w[i] for i, v in enumerate(block)), b
    gen = torch.Generator().manual_seed(2)
    for pos in torch.randint(0, n, (64,), generator=gen).tolist() + [0, n - 1, BLOCK - 1, BLOCK]:
        for bit in (0, 7, 15):
            flipped = bits.clone()
            flipped[pos] ^= torch.tensor(1 << bit, dtype=torch.int32).to(torch.int16)
            diff = (block_digests(flipped) != got).nonzero().flatten().tolist()
            assert diff == [pos // BLOCK], (pos, bit)


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
    from faircast_ds.shard.guard import block_digests

    served = adapter.served[1].view(torch.int16)
    rec = g.records[1]
    assert all(torch.equal(d, block_digests(served[s.offset:s.offset + s.numel])) for s, d in zip(rec.slices, rec.full))


def test_recording_inside_a_prepared_step_allocates_nothing_new():
    """The buffers are made by prepare() (outside the cast): recording writes into them."""
    adapter, g = setup()
    g.prepare(full=True)
    ready = {k: [d.data_ptr() for d in r.full] for k, r in g.ready.items()}
    adapter.caster.begin_step()
    adapter.cast_all()
    assert {k: [d.data_ptr() for d in r.full] for k, r in g.records.items()} == ready
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
    from faircast_ds.shard.state import publish_restored

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
    with pytest.raises(UnsupportedSetupError, match="parameter 'small.1' elements 0..89, flat group 1"):
        g.check("load_checkpoint(x)")
