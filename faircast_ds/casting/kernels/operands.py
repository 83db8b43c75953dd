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
