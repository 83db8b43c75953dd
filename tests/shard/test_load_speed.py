"""What makes a load cheap, checked for what it must still do (benchmarks/load_breakdown.py has the times):

- the guard's block digests come from the fused CPU kernel in one read of the bits: equal to the torch
  code, and to sums in Python ints (tests/deepspeed_tests/test_guard.py checks those too);
- error feedback's restore at the saved layout reads each saved piece once, its CRC taken chunk by chunk as
  it is copied: bitwise the saved state, and a flipped byte in either array still refused;
- the DeepSpeed guard's check after ``load_checkpoint`` (faircast_ds/deepspeed/guard.install, driven here
  through stand-in hooks) compares what the load left served with what Fair Cast wrote: a load that left
  round-to-nearest in one element stops the run.
"""
from __future__ import annotations

import pytest
import torch

from faircast_ds.shard import state as checkpoint
from faircast_ds.shard.adapter import UnsupportedSetupError
from faircast_ds.shard.state import FairCastStateError, publish_restored, restore_state
from faircast_ds.shard.guard import BLOCK, _weights, block_digests, torch_block_digests
from faircast_ds.casting.kernels import cpu
from test_checkpoint_format import (assert_same, gather, make_world, saved_at_world_2,
                                    tensor_entries, train_step)
from stand_ins import overwrite, setup

needs_kernel = pytest.mark.skipif(not cpu.available(), reason="the fused CPU kernel is not available")


@needs_kernel
@pytest.mark.parametrize("n", [1, BLOCK - 1, BLOCK, BLOCK + 1, 37 * BLOCK + 555])
def test_fused_digests_equal_the_torch_code_and_python_sums(n, monkeypatch):
    bits = torch.randint(-2**15, 2**15, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.int16)
    fused = block_digests(bits)
    assert torch.equal(fused, torch_block_digests(bits, torch.empty_like(fused)))
    w = _weights(bits.device).tolist()
    last = fused.numel() - 1
    block = bits[last * BLOCK:].tolist()
    assert int(fused[last]) == sum((v & 0xFFFF) * w[i] for i, v in enumerate(block))
    calls = []
    monkeypatch.setattr(torch, "sum", lambda *a, **k: calls.append(1) or pytest.fail("torch code used"))
    block_digests(bits)  # the kernel, not the torch code
    assert not calls


def test_digests_of_a_strided_view_take_the_torch_code():
    bits = torch.randint(-2**15, 2**15, (2 * BLOCK + 10,), generator=torch.Generator().manual_seed(3),
                         dtype=torch.int16)
    view = bits[::2]
    assert torch.equal(block_digests(view), torch_block_digests(view.contiguous(), torch.empty(2, dtype=torch.int64)))
    with pytest.raises(ValueError, match="need 2 int64 digests"):
        block_digests(view, out=torch.empty(3, dtype=torch.int64))


def test_error_feedback_restores_the_saved_layout_in_one_pass(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "_COPY_CHUNK", 7)  # many chunks per saved piece
    copied = []
    real = checkpoint._copy_verified
    monkeypatch.setattr(checkpoint, "_copy_verified", lambda p, *rest: copied.append(p.numel) or real(p, *rest))
    full, w2, tag, _ = saved_at_world_2(tmp_path, "error_feedback")
    saved = gather(w2)
    again = make_world(2, "error_feedback", full)
    assert [restore_state(a, a.caster, tag) for a in again] == [3, 3]
    for a in again:
        publish_restored(a, a.caster)
    assert copied and sum(copied) == sum(s.numel for a in again for _, _, _, sl in a.flat_groups()
                                         for s in sl if not s.is_padding)  # every piece whole, one pass
    assert_same(gather(again), saved, "error feedback restored at world 2", residual=True)
    train_step(w2, full, 4, again)
    assert_same(gather(again), gather(w2), "step 4 after the restore", residual=True)


@pytest.mark.parametrize("entry", (0, 1))  # residual, neighbour bits (the first two arrays of the file)
def test_a_flipped_byte_is_caught_at_the_saved_layout(tmp_path, entry, monkeypatch):
    monkeypatch.setattr(checkpoint, "_COPY_CHUNK", 5)
    full, _, tag, files = saved_at_world_2(tmp_path, "error_feedback")
    offset, size = tensor_entries(files[1])[entry]
    raw = bytearray(open(files[1], "rb").read())
    raw[offset + size - 3] ^= 0x21  # in the last chunk of the last piece
    open(files[1], "wb").write(raw)
    w2 = make_world(2, "error_feedback", full)  # the masters as saved (a load restores them first)
    restore_state(w2[0], w2[0].caster, tag)  # rank 0's file is intact
    with pytest.raises(FairCastStateError, match=r"rank00001-of-00002\.pt: CRC mismatch for .* corrupted"):
        restore_state(w2[1], w2[1].caster, tag)


class _Hooks:
    """EngineHooks' registration calls, recorded: the guard's before/after callbacks by method."""

    def __init__(self) -> None:
        self.before_cbs: dict[str, list] = {}
        self.after_cbs: dict[str, list] = {}

    def before(self, method, who, what, fn) -> None:
        self.before_cbs.setdefault(method, []).append(fn)

    def after(self, method, who, what, fn) -> None:
        self.after_cbs.setdefault(method, []).append(fn)


class _Engine:
    global_steps = 0
    skipped_steps = 0


def _guarded_load(corrupt: bool, recast: bool = True) -> None:
    """A ``load_checkpoint`` as the DeepSpeed guard sees it: prepared, DeepSpeed's load-site cast (not
    recorded: superseded), the restore's recast at the saved step into the prepared records (and, with
    ``corrupt``, an element left at round-to-nearest after it), then the check."""
    from faircast_ds.deepspeed import guard as ds_guard

    adapter, _ = setup()
    adapter.caster.observers.clear()  # the guard install() makes is the only observer

    class _FC:
        extras: dict = {}

    fc = _FC()
    fc.adapter = adapter
    hooks = _Hooks()
    ds_guard.install(_Engine(), fc, hooks)
    guard = fc.extras["guard"]
    adapter.caster.begin_step()
    adapter.cast_all()  # a step before the save (full: the first step's record)
    guard.check("step 1")
    for fn in hooks.before_cbs["load_checkpoint"]:
        fn("ckpt", "t")
    prepared = {k: [d.data_ptr() for d in r.full] for k, r in guard.ready.items()}
    with guard.superseded():  # DeepSpeed's load sites: a cast at the old step, not recorded
        adapter.cast_all()
    assert {k: [d.data_ptr() for d in r.full] for k, r in guard.ready.items()} == prepared
    if recast:
        adapter.caster.step = 7  # the restored step
        adapter.recast_and_publish()  # what publish_restored does for the noise modes
        assert {k: [d.data_ptr() for d in r.full] for k, r in guard.records.items()} == prepared
    if corrupt:
        overwrite(adapter, 1, 3905, 3906)  # an element of small.39 (padding is not served)
        adapter.served[1][3905] = adapter.served[1][3905] + 1.0
    for fn in hooks.after_cbs["load_checkpoint"]:
        fn(("ckpt", {}), "ckpt", "t")


def test_the_check_after_a_load_compares_what_the_load_served():
    _guarded_load(corrupt=False)
    with pytest.raises(UnsupportedSetupError, match=r"after load_checkpoint\(ckpt, tag='t'\): 1 of \d+ checked blocks .* 'small\.39' elements 0\.\.89"):
        _guarded_load(corrupt=True)


def test_a_load_whose_superseded_cast_is_not_followed_by_a_recast_fails_the_check():
    """Only the restore's casts are recorded; were a flat group left with only the load site's (unrecorded)
    cast -- here the very bits the record of the step before holds -- the full check after the load refuses
    it as not cast since the check was prepared, rather than passing a copy it did not check."""
    with pytest.raises(UnsupportedSetupError, match=r"after load_checkpoint\(ckpt, tag='t'\): flat group 0 was not "
                       r"cast by Fair Cast since this check was prepared"):
        _guarded_load(corrupt=False, recast=False)
