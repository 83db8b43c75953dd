"""bf16 linear layers computed as fp32 products of their bf16 values, rounded once to bf16.

On a CPU without AVX-512, PyTorch has no oneDNN bf16 GEMM and falls back to a generic loop. That loop is
slow in every layout, and pathologically slow in the layout of a linear layer's input gradient
(``grad @ weight``). Measured here on the AVX2 machine, one thread:
- SmolLM2-135M, 8 sequences of 61 tokens: forward 17.9 s and backward 139 s in bf16, against 4.3 s and 7.9 s
  through this module;
- the tied LM head's input gradient alone, ``[488, 49152] @ [49152, 576]``: 48.9 s in bf16, 0.6 s in fp32.

What this module computes, per ``nn.Linear`` whose weight is bf16: the exact products of the bf16 values
(a bf16 × bf16 product fits in fp32), summed in fp32, rounded once to bf16. That is the arithmetic of a GPU's
bf16 GEMM (fp32 accumulation), and of PyTorch's own CPU fallback up to the order of the sums: on random
matrices 0.01–0.02% of outputs differ from the fallback's, each by the last bit. The input gradient, the
weight gradient and the bias gradient are computed the same way and rounded to bf16, as autograd would
hand them on.

Nothing here touches the served weights or the cast: it changes only how the trainer's forward and backward
multiply. The GRPO job chooses it with ``--gemm fp32`` (the default under ``--model``); ``--gemm native``
keeps PyTorch's own bf16 kernels. The engine's side of the same arithmetic, in fixed row blocks so that a row
does not depend on the requests beside it: ``faircast_ds/vllm/cpu_gemm.py`` (``--engine-gemm fp32``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["Fp32AccumulatedLinear", "use_fp32_accumulation"]


class Fp32AccumulatedLinear(torch.autograd.Function):
    """``y = round_bf16(x @ w.T + b)`` with fp32 products and sums; gradients the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # the parameter itself is saved (not its fp32 copy): under ZeRO-3 its data is gathered again
        # before the backward, as for DeepSpeed's own linear
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        g = grad.float()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (g @ weight.float()).to(x.dtype)
        rows = g.reshape(-1, g.shape[-1])  # one row per input position
        if ctx.needs_input_grad[1]:
            dw = (rows.t() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = rows.sum(0).to(weight.dtype)
        return dx, dw, db


def _forward(module: torch.nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or module.weight.dtype != torch.bfloat16:
            raise TypeError(f"fp32-accumulated linear expects bf16 input and weight, got {x.dtype} and "
                            f"{module.weight.dtype}")
        return Fp32AccumulatedLinear.apply(x, module.weight, module.bias)
    return forward


def use_fp32_accumulation(model: torch.nn.Module) -> int:
    """Compute every ``nn.Linear`` of ``model`` whose weight is bf16 with :class:`Fp32AccumulatedLinear`
    (an instance attribute ``forward``; hooks, ZeRO-3's included, still run around it). Returns how many
    layers were changed; fp32 layers are left alone."""
    routed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.bfloat16:
            module.forward = _forward(module)
            routed += 1
    return routed
