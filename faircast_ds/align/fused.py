"""Fast path for the fused (one-rounding) regions: autograd Functions with a hand-written backward.

The forward is the reference forward of ``regions.py`` (same ops, same bits). The backward is the
exact derivative of the fp32 math, computed in fp32 and rounded once per input; the rounding
itself is treated as identity (straight-through), as autograd does for ``.to(bf16)``. What we
gain over autograd of the reference is memory: only the inputs (and one fp32 scalar per row for
the norm) are saved, not every fp32 intermediate.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from faircast_ds.align.regions import (
    rms_rstd,
    rmsnorm_one_rounding,
    swiglu_one_rounding,
    wide,
)


class _FusedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return swiglu_one_rounding(gate, up)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        gate, up = ctx.saved_tensors
        g, gw = wide(grad), wide(gate)
        d_gate = d_up = None
        if ctx.needs_input_grad[0]:  # ``g * up`` promotes up to fp32 inside the kernel, exactly
            d_gate = torch.ops.aten.silu_backward(g * up, gw).to(gate.dtype)
        if ctx.needs_input_grad[1]:
            d_up = (g * F.silu(gw)).to(up.dtype)
        return d_gate, d_up


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xw = wide(x)
        rstd = rms_rstd(xw, eps)
        ctx.save_for_backward(x, weight, rstd)
        return rmsnorm_one_rounding(xw, rstd, weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        g, xhat = wide(grad), wide(x) * rstd
        d_x = d_w = None
        if ctx.needs_input_grad[0]:
            gw = g * wide(weight)
            # d/dx of x·rstd(x): rstd · (gw − x̂ · mean(gw · x̂))
            d_x = (rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            d_w = (g * xhat).reshape(-1, xhat.shape[-1]).sum(0).to(weight.dtype)
        return d_x, d_w, None


def fused_swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """fp32 ``silu(gate) * up``, rounded once to ``gate.dtype``; memory-lean backward."""
    return _FusedSwiGLU.apply(gate, up)


def fused_rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """fp32 ``x · rstd(x) · weight``, rounded once to ``weight.dtype``; memory-lean backward.

    ``x`` may be bf16 or the fp32 residual sum; the gradient is returned in ``x.dtype``.
    """
    return _FusedRMSNorm.apply(x, weight, eps)
