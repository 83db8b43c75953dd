"""Reference implementations of the four regions, parameterised by a :class:`Rounding`.

Pure functions on tensors, differentiable by plain autograd. ``fused=False`` reproduces HF eager
op by op (each bf16 op rounds); ``fused=True`` keeps intermediates in fp32 and rounds once, the
way the engines' fused kernels do. They model *where* an engine rounds; reductions (the order of
the RMS sum), ``exp``/``rsqrt`` and FMA contraction are torch-CPU's, not the GPU kernel's.

The fused forwards here are also the forwards of the fast path (``fused.py``), which only adds a
hand-written backward, so the aligned trainer and the reference forward agree bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from faircast_ds.align.profiles import Rounding


def wide(x: Tensor) -> Tensor:
    """``x`` in at least fp32: bf16/fp16 go to fp32, fp32/fp64 are left alone."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def round_to(x: Tensor, dtype: torch.dtype, mode: str = "even") -> Tensor:
    """``x`` rounded to ``dtype`` once: to nearest even (``x.to(dtype)``), or for ``mode="truncate"`` an fp32
    ``x`` going to bf16 keeps its top 16 bits (toward zero, as vLLM's CPU kernels convert without
    AVX512-BF16). The gradient passes straight through, as autograd treats ``.to(dtype)``."""
    if mode == "even" or dtype != torch.bfloat16 or x.dtype != torch.float32:
        return x.to(dtype)
    if mode != "truncate":
        raise ValueError(f"unknown rounding mode {mode!r}")
    bits = x.detach().view(torch.int32) & -65536  # 0xFFFF0000: sign, exponent and the 7 bits bf16 keeps
    kept = bits.view(torch.float32)
    if x.requires_grad:
        kept = x + (kept - x.detach())
    return kept.to(dtype)  # exact: the dropped bits are zero


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the last dim: the NeoX-style pairing HF and the engines use."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x: Tensor, cos: Tensor, sin: Tensor, rounding: Rounding) -> Tensor:
    """Rotate ``x`` by the angle table ``cos``/``sin`` (fp32, broadcastable to ``x``).

    The table is cast to ``x.dtype`` first unless ``rounding.fp32_table``; an engine with a bf16
    cache multiplies by the rounded cos/sin even when its arithmetic is fp32.
    """
    if not rounding.fp32_table:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if not rounding.fused:
        return x * cos + rotate_half(x) * sin  # three bf16 ops, three roundings (HF eager)
    xw = wide(x)
    return round_to(xw * wide(cos) + rotate_half(xw) * wide(sin), x.dtype, rounding.to_bf16)


def swiglu(gate: Tensor, up: Tensor, rounding: Rounding) -> Tensor:
    """``silu(gate) * up``: rounded after each op, or computed in fp32 and rounded once."""
    if not rounding.fused:
        return F.silu(gate) * up
    return swiglu_one_rounding(gate, up)


def swiglu_one_rounding(gate: Tensor, up: Tensor) -> Tensor:
    """fp32 ``silu(gate) * up``, rounded once to ``gate.dtype``."""
    return (F.silu(wide(gate)) * up).to(gate.dtype)  # the product promotes ``up`` exactly


def rms_rstd(xw: Tensor, eps: float) -> Tensor:
    """``1 / sqrt(mean(x²) + eps)`` over the last dim of an already-widened ``xw``."""
    return torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + eps)


def rmsnorm_one_rounding(xw: Tensor, rstd: Tensor, weight: Tensor) -> Tensor:
    """``(x·rstd)·w`` in fp32, rounded once to the weight dtype (the engines' multiply order)."""
    return (xw * rstd * wide(weight)).to(weight.dtype)


def rmsnorm_two_roundings(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF eager's RMSNorm: fp32 ``x·rms`` rounded to the weight dtype, then ``weight·`` rounded again."""
    xw = x.to(torch.float32)  # HF casts to fp32 exactly (even from fp64)
    return weight * (xw * rms_rstd(xw, eps)).to(weight.dtype)


def rmsnorm(x: Tensor, weight: Tensor, eps: float, rounding: Rounding) -> Tensor:
    """RMSNorm of ``x`` over its last dim.

    Unfused (HF eager): fp32 norm, rounded to the weight dtype, then ``weight *`` rounds again.
    Fused: fp32 norm and weight product, one rounding. Either way ``x`` may be a bf16 tensor or
    the fp32 residual sum that a fused add+norm kernel keeps in registers (for a bf16 ``x`` the
    unfused form is HF's ``weight * x.to(input_dtype)``).
    """
    if not rounding.fused:
        return rmsnorm_two_roundings(x, weight, eps)
    xw = wide(x)
    return rmsnorm_one_rounding(xw, rms_rstd(xw, eps), weight)


def add_rmsnorm(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, rounding: Rounding
) -> tuple[Tensor, Tensor]:
    """``residual += x; return norm(residual), residual``, the engines' fused add+norm interface.

    With ``residual=None`` (the first layer) ``x`` itself is normed and becomes the residual.
    Without ``rounding.fp32_sum`` (HF) the sum is a bf16 add and the norm sees the rounded sum;
    with it the norm sees the fp32 sum and only the stored residual is rounded.
    """
    if residual is None:
        return rmsnorm(x, weight, eps, rounding), x
    if not rounding.fp32_sum:
        total = residual + x
        return rmsnorm(total, weight, eps, rounding), total
    total = wide(x) + wide(residual)
    return rmsnorm(total, weight, eps, rounding), total.to(x.dtype)


def attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float,
              rounding: Rounding) -> Tensor:
    """Causal attention ``[B, H, T, D]`` of already repeated (GQA) heads; ``mask`` is additive.

    Unfused (HF eager): bf16 scores, scaled in bf16, fp32 softmax rounded to bf16, bf16 ``P·V``.
    Fused: scores, softmax and ``P·V`` in fp32, one rounding of the output (vLLM's CPU kernel), done as
    ``rounding.to_bf16`` says.
    """
    if not rounding.fused:
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling
        if mask is not None:
            scores = scores + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(probs, value)
    if rounding.kernel_order:  # vLLM's CPU vec kernel: q scaled first; P·V unnormalized, then · 1/sum
        scores = torch.matmul(wide(query) * scaling, wide(key).transpose(2, 3))
        if mask is not None:
            scores = scores + wide(mask)
        numerators = torch.exp(scores - scores.amax(-1, keepdim=True).detach())
        out = torch.matmul(numerators, wide(value)) * (1 / numerators.sum(-1, keepdim=True))
        return round_to(out, query.dtype, rounding.to_bf16)
    scores = torch.matmul(wide(query), wide(key).transpose(2, 3)) * scaling
    if mask is not None:
        scores = scores + wide(mask)
    return round_to(torch.matmul(F.softmax(scores, dim=-1), wide(value)), query.dtype, rounding.to_bf16)
