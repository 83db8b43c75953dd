"""Writing an update straight into the tensors an engine's kernels compute with, all or nothing.

vLLM's ``reload_weights`` rebuilds every layer an update touches, whatever share of it changed (on
this project's CPU, 0.4 s for a 327M-parameter model; benchmarks/inplace_push.py). Where a layer's
kernel computes from its plain weight tensor (a GPU engine's linear layers; on a CPU where oneDNN builds
no bf16 matmul, torch's ``F.linear`` fallback; norm weights and embedding lookups everywhere) and the
update listed the elements it changed, the engine can instead write just those elements into that
tensor. This module is the framework-free part of that, driven by the engine
(:mod:`faircast_ds.vllm.transfer.engine`) with vLLM's tensors and kernels
(:func:`faircast_ds.vllm.engine_weights.inplace_target`, :func:`~faircast_ds.vllm.engine_weights.kernel_probes`), and by
the tests with stand-ins:

- :class:`UndoRecord` writes new bits into target tensors at the elements an update changed (the
  engine knows them when a delta listed them) and keeps what it overwrote (10 bytes per element
  written: position and old bits), so a load that fails part-way restores every tensor it wrote. Its
  cost follows the update, not the model.
- :func:`reads_live` decides whether a target may be written this way: the kernel must compute with
  the target's bits now, and with a bit flipped in it, with that flip (then the flip is undone). A
  kernel that repacked its weight at load (oneDNN on an AVX-512 CPU leaves ``.weight`` empty; the
  tied LM head's packed copy) fails the second read and keeps vLLM's reload.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

_BITS = {2: torch.int16, 4: torch.int32}

Reader = Callable[[int], torch.Tensor]  # an index -> what the kernel computes with there (a row or a column)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns as integers of its width (bf16/fp16 as int16, fp32 as int32)."""
    width = _BITS.get(t.element_size())
    if width is None or not t.is_floating_point():
        raise TypeError(f"in-place writes take 2- or 4-byte floating tensors, not {t.dtype}")
    return t.view(width)


class UndoRecord:
    """Writes into target tensors at listed elements, restorable together (:meth:`restore`) until
    :meth:`clear`."""

    def __init__(self) -> None:
        self._entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.written = 0  # elements written

    def __len__(self) -> int:
        return len(self._entries)

    def write(self, target: torch.Tensor, new: torch.Tensor, index: torch.Tensor) -> None:
        """Copy ``new``'s bits at flat element ``index`` (any integer dtype, each inside the tensor) into
        ``target`` (a contiguous tensor of ``new``'s shape and dtype), keeping the bits it overwrites."""
        if target.shape != new.shape or target.dtype != new.dtype:
            raise ValueError(f"in-place write of {list(new.shape)} {new.dtype} into {list(target.shape)} {target.dtype}")
        if not target.is_contiguous():
            raise ValueError("in-place writes need a contiguous target")
        if index.numel() == 0:
            return
        index = index.to(torch.int64)
        values = bits(new).reshape(-1).index_select(0, index).to(target.device)
        index = index.to(target.device)
        flat = bits(target).view(-1)
        # recorded before writing, so a write that stops part-way is restored as well
        self._entries.append((target, index, flat.index_select(0, index)))
        flat.index_copy_(0, index, values)
        self.written += int(index.numel())

    def restore(self) -> None:
        """Put every overwritten bit back, latest write first; the record is empty afterwards."""
        for target, index, old in reversed(self._entries):
            bits(target).view(-1).index_copy_(0, index, old)
        self.clear()

    def clear(self) -> None:
        """Keep the writes: forget what they overwrote."""
        self._entries.clear()
        self.written = 0


def reads_live(target: torch.Tensor, expected: torch.Tensor, rows: Sequence[Reader] = (),
               columns: Sequence[Reader] = ()) -> bool:
    """Whether the kernels compute with ``target``'s bits as they are now and as they will be after an
    in-place write. ``expected``: the bits the engine last loaded into this layer (the staging copy); they
    must equal ``target``'s, else the target is not where the engine keeps them. A vector (no readers:
    the kernel reads the tensor itself) passes on that alone. For a matrix each reader gives what its
    kernel computes with at row (``rows``: an embedding lookup) or input column (``columns``: a linear
    kernel) ``i``, over the target's rows; it must show ``target``'s bits there, then, with one element's
    lowest bit flipped, the flip. The flip is undone before this returns."""
    if target.shape != expected.shape or target.dtype != expected.dtype:
        return False
    if not torch.equal(bits(target), bits(expected.to(target.device))):
        return False
    if target.dim() != 2:
        return not rows and not columns
    if not rows and not columns:
        return False  # a matrix read by nothing here: nothing shows its kernel reads it
    r, c = target.shape[0] // 2, target.shape[1] // 2
    view = bits(target)

    def agree() -> bool:
        return all(torch.equal(bits(read(r).reshape(-1).to(target.dtype)), view[r]) for read in rows) and \
            all(torch.equal(bits(read(c).reshape(-1).to(target.dtype)), view[:, c]) for read in columns)

    if not agree():
        return False
    old = view[r, c].clone()
    try:
        view[r, c] ^= 1
        return agree()
    finally:
        view[r, c] = old
