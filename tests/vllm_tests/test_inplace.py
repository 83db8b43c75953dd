"""faircast_ds.vllm.inplace without an engine: the undo record against saved copies of the bits, and the
liveness probe against stand-in kernels (one that computes with the weight it is given, one that
computes with a copy it packed at load). The engine's use of both against a real ``vllm serve`` is in
tests/vllm_tests/transfer/test_vllm_faults.py."""
from __future__ import annotations

import pytest
import torch

from faircast_ds.vllm import inplace


def weights(seed: int, *shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.05).to(dtype)


def moved(t: torch.Tensor, share: float, seed: int) -> torch.Tensor:
    """``t`` with about ``share`` of its elements one bit pattern up (exactly: the oracle counts them)."""
    g = torch.Generator().manual_seed(seed)
    out = t.clone()
    mask = torch.rand(t.shape, generator=g) < share
    raw = out.view(torch.int16 if t.element_size() == 2 else torch.int32)
    raw[mask] += 1
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    width = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a.view(width), b.view(width))


def changed_index(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The oracle's list of changed elements: a plain comparison of values, flat positions."""
    return (old.reshape(-1) != new.reshape(-1)).nonzero().view(-1)


@pytest.mark.parametrize("share", [0.0, 0.01, 0.2, 1.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_writes_carry_the_new_bits_and_restore_brings_back_the_old(share, dtype, index_dtype):
    old = {n: weights(i, 37, 64, dtype=dtype) for i, n in enumerate("abc")}
    targets = {n: t.clone() for n, t in old.items()}
    new = {n: moved(t, share, 10 + i) for i, (n, t) in enumerate(old.items())}
    undo = inplace.UndoRecord()
    for n in targets:
        undo.write(targets[n], new[n], changed_index(old[n], new[n]).to(index_dtype))
    for n in targets:
        assert same_bits(targets[n], new[n])
    assert undo.written == sum(int((old[n] != new[n]).sum()) for n in old)
    undo.restore()
    for n in targets:
        assert same_bits(targets[n], old[n])
    assert len(undo) == 0 and undo.written == 0


def test_only_the_listed_elements_are_written():
    old = weights(0, 16, 16)
    target, new = old.clone(), moved(old, 0.5, 1)
    index = changed_index(old, new)[::2]  # half of what changed
    inplace.UndoRecord().write(target, new, index)
    expected = old.clone().reshape(-1)
    expected[index] = new.reshape(-1)[index]
    assert same_bits(target, expected.view(16, 16))


def test_successive_writes_to_one_tensor_restore_to_the_first_bits():
    """Two staged deltas of one tensor, written in turn (overlapping elements): restore gives the bits before both."""
    old = weights(0, 16, 16)
    first = moved(old, 0.2, 1)
    second = moved(first, 0.2, 2)
    target = old.clone()
    undo = inplace.UndoRecord()
    undo.write(target, second, changed_index(old, first))
    undo.write(target, second, changed_index(first, second))
    assert same_bits(target, second)
    undo.restore()
    assert same_bits(target, old)


def test_a_write_that_fails_part_way_is_restored_with_the_others():
    old = [weights(i, 16, 16) for i in range(3)]
    targets = [t.clone() for t in old]
    news = [moved(o, s, i) for i, (o, s) in enumerate(zip(old, (0.5, 0.05, 0.3)))]
    undo = inplace.UndoRecord()
    undo.write(targets[0], news[0], changed_index(old[0], news[0]))
    undo.write(targets[1], news[1], changed_index(old[1], news[1]))
    with pytest.raises(IndexError):
        undo.write(targets[2], news[2], torch.tensor([3, 5, 16 * 16]))  # one index past the end
    undo.restore()
    for t, o in zip(targets, old):
        assert same_bits(t, o)


def test_clear_keeps_the_writes():
    target = weights(0, 8, 8)
    new = moved(target, 0.3, 3)
    undo = inplace.UndoRecord()
    undo.write(target, new, changed_index(target, new))
    undo.clear()
    undo.restore()  # nothing left to restore
    assert same_bits(target, new)


def test_a_mismatched_non_contiguous_or_integer_target_is_refused():
    t = weights(0, 8, 8)
    every = torch.arange(64)
    with pytest.raises(ValueError, match="in-place write of"):
        inplace.UndoRecord().write(t, weights(1, 8, 4), every)
    with pytest.raises(ValueError, match="contiguous"):
        inplace.UndoRecord().write(t.t(), t.t().clone(), every)
    with pytest.raises(TypeError, match="floating"):
        inplace.UndoRecord().write(torch.zeros(4, dtype=torch.int16), torch.ones(4, dtype=torch.int16), torch.arange(4))


class LiveKernel:
    """A linear kernel and an embedding lookup that compute with the weight as it is now."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def column(self, i: int) -> torch.Tensor:
        x = torch.zeros(1, self.weight.shape[1], dtype=self.weight.dtype)
        x[0, i] = 1
        return torch.nn.functional.linear(x.float(), self.weight.float())[0]

    def row(self, i: int) -> torch.Tensor:
        return torch.nn.functional.embedding(torch.tensor([i]), self.weight)[0]


class PackedKernel(LiveKernel):
    """A kernel that packed a copy of its weight at load: later writes into the weight do not reach it."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight.clone())


def test_a_kernel_computing_with_the_tensor_live_passes_the_probe_and_the_flip_is_undone():
    w = weights(0, 12, 10)
    before = w.clone()
    k = LiveKernel(w)
    assert inplace.reads_live(w, before, rows=[k.row], columns=[k.column])
    assert same_bits(w, before)


def test_a_kernel_with_a_packed_copy_fails_the_probe():
    w = weights(0, 12, 10)
    live, packed = LiveKernel(w), PackedKernel(w)
    assert not inplace.reads_live(w, w.clone(), columns=[packed.column])
    # the tied LM head: lookups live, logits from a packed copy
    assert not inplace.reads_live(w, w.clone(), rows=[live.row], columns=[packed.column])


def test_the_probe_needs_the_tensor_to_hold_what_the_engine_loaded():
    w = weights(0, 12, 10)
    k = LiveKernel(w)
    other = moved(w, 0.1, 4)
    assert not inplace.reads_live(w, other, columns=[k.column])  # the bits are not where the engine keeps them
    assert not inplace.reads_live(w, w.clone())  # a matrix that no kernel reader shows
    vec = weights(1, 10)
    assert inplace.reads_live(vec, vec.clone())  # a vector: the kernel reads the tensor itself
    assert not inplace.reads_live(vec, moved(vec, 0.5, 5))
