"""Operands of a fused cast: the kernels take contiguous buffers; strided views go through copies."""
from __future__ import annotations

import torch


def contiguous(out: torch.Tensor, x: torch.Tensor,
               residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dst, src, res): each operand itself when contiguous, else a contiguous copy."""
    res = residual
    if res is not None and not res.is_contiguous():
        res = res.contiguous()
    return (out if out.is_contiguous() else out.contiguous()), (x if x.is_contiguous() else x.contiguous()), res


def write_back(out: torch.Tensor, dst: torch.Tensor, residual: torch.Tensor | None, res: torch.Tensor | None) -> None:
    """Copy the kernel's results into the caller's tensors where ``contiguous`` made copies."""
    if dst is not out:
        out.copy_(dst)
    if res is not None and res is not residual:
        residual.copy_(res)


def check_marks(marks: torch.Tensor, mark_base: int, numel: int, device: torch.device) -> None:
    """Change marks a kernel may OR into: a contiguous uint8 bitmap on the kernel's device, whole 32-bit
    words (:func:`faircast_ds.casting.marks.bitmap_bytes`), holding bits ``[mark_base, mark_base + numel)``."""
    if not isinstance(marks, torch.Tensor) or marks.dtype != torch.uint8 or marks.dim() != 1 \
            or not marks.is_contiguous() or marks.device != device:
        got = f"{marks.dtype} {tuple(marks.shape)} on {marks.device}" if isinstance(marks, torch.Tensor) \
            else type(marks).__name__
        raise TypeError(f"change marks must be a contiguous 1-D uint8 tensor on {device}, got {got}")
    if marks.numel() % 4 or marks.data_ptr() % 4:
        raise ValueError("change marks are whole 32-bit words: their length and address are multiples of 4 bytes")
    if type(mark_base) is not int or mark_base < 0 or mark_base + numel > marks.numel() * 8:
        raise ValueError(f"change marks of {marks.numel() * 8} bits cannot hold bits [{mark_base}, {mark_base + numel})")
