"""Region references (``regions.py``) and their fast path (``fused.py``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3 import modeling_qwen3

from faircast_ds.align.fused import fused_rmsnorm, fused_swiglu
from faircast_ds.align.profiles import HF, SGLANG, VLLM_CUDA
from faircast_ds.align.regions import add_rmsnorm, rmsnorm, rope, swiglu
from faircast_bench.builders import single_thread

BF16 = torch.bfloat16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


def randn(*shape, scale=2.0, seed=0, dtype=BF16):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


def angles(length=16, dim=8):
    freqs = torch.arange(length).float()[:, None] / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.cat((freqs, freqs), dim=-1)
    return freqs.cos()[None, None], freqs.sin()[None, None]  # fp32 [1, 1, T, D]


def ulp_error(approx, exact):
    """|approx − exact| in units of the bf16 spacing at ``exact``."""
    spacing = torch.finfo(BF16).eps * exact.abs().clamp_min(torch.finfo(BF16).tiny).float()
    spacing = 2.0 ** torch.floor(torch.log2(spacing))  # bf16 ulp of the binade
    return ((approx.double() - exact) / spacing.double()).abs()


# --- HF-kind references reproduce transformers' own ops -------------------------------------


def test_hf_rope_is_transformers_apply_rotary_pos_emb():
    q, k = randn(2, 4, 16, 8), randn(2, 4, 16, 8, seed=1)
    cos, sin = angles()
    q_hf, k_hf = modeling_qwen3.apply_rotary_pos_emb(q, k, cos[0].to(BF16), sin[0].to(BF16))
    assert torch.equal(rope(q, cos, sin, HF.rope), q_hf)
    assert torch.equal(rope(k, cos, sin, HF.rope), k_hf)


def test_hf_rmsnorm_is_transformers_rmsnorm():
    norm = modeling_qwen3.Qwen3RMSNorm(32).to(BF16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(32))
    x = randn(3, 5, 32)
    assert torch.equal(rmsnorm(x, norm.weight, norm.variance_epsilon, HF.rmsnorm), norm(x))


def test_hf_swiglu_is_silu_then_product():
    g, u = randn(64, 48), randn(64, 48, seed=1)
    assert torch.equal(swiglu(g, u, HF.swiglu), F.silu(g) * u)


# --- fused kinds round once -----------------------------------------------------------------


def test_fused_swiglu_is_correctly_rounded_and_hf_is_not():
    g, u = randn(256, 256), randn(256, 256, seed=1)
    exact = F.silu(g.double()) * u.double()
    fused_err = ulp_error(swiglu(g, u, SGLANG.swiglu), exact)
    hf_err = ulp_error(swiglu(g, u, HF.swiglu), exact)
    # One rounding of an fp32 result: within half an ulp (+ fp32 slack). Two roundings: not.
    assert fused_err.max() <= 0.5 + 1e-3
    assert hf_err.max() > 0.5 + 1e-3
    assert hf_err.mean() > 1.25 * fused_err.mean()  # measured 0.35 vs 0.25 ulp


def test_fused_rope_is_correctly_rounded_given_its_table():
    q = randn(2, 4, 16, 8)
    cos, sin = angles()
    for rounding, table in ((SGLANG.rope, torch.float64), (VLLM_CUDA.rope, BF16)):
        c, s = cos.to(table).double(), sin.to(table).double()
        qd = q.double()
        exact = qd * c + torch.cat((-qd[..., 4:], qd[..., :4]), dim=-1) * s
        assert ulp_error(rope(q, cos, sin, rounding), exact).max() <= 0.5 + 1e-3
    # The fp32 table is what separates SGLang from vLLM here.
    assert not torch.equal(rope(q, cos, sin, SGLANG.rope), rope(q, cos, sin, VLLM_CUDA.rope))


def test_fused_add_rmsnorm_norms_the_fp32_sum_and_stores_the_hf_residual():
    x, r = randn(4, 8, 32, scale=0.05), randn(4, 8, 32, seed=1)  # small x: its low bits get lost in bf16
    w = (1 + 0.3 * torch.randn(32)).to(BF16)
    out, residual = add_rmsnorm(x, r, w, 1e-6, SGLANG.rmsnorm)
    _, hf_residual = add_rmsnorm(x, r, w, 1e-6, HF.rmsnorm)
    assert torch.equal(residual, hf_residual)  # the stored residual is HF's bf16 sum
    assert torch.equal(out, rmsnorm(x.float() + r.float(), w, 1e-6, SGLANG.rmsnorm))
    assert not torch.equal(out, rmsnorm(hf_residual, w, 1e-6, SGLANG.rmsnorm))  # not the rounded sum


def test_fused_rmsnorm_returns_the_weight_dtype_for_an_fp32_input():
    w = torch.ones(16, dtype=BF16)
    assert rmsnorm(torch.randn(2, 16), w, 1e-6, SGLANG.rmsnorm).dtype == BF16
    assert fused_rmsnorm(torch.randn(2, 16), w, 1e-6).dtype == BF16


# --- fast path: same forward bits, correct backward -----------------------------------------


def test_fast_path_forward_is_the_reference_bit_for_bit():
    g, u = randn(8, 64), randn(8, 64, seed=1)
    assert torch.equal(fused_swiglu(g, u), swiglu(g, u, SGLANG.swiglu))
    w = (1 + 0.3 * torch.randn(64)).to(BF16)
    for x in (g, g.float() + u.float()):
        assert torch.equal(fused_rmsnorm(x, w, 1e-6), rmsnorm(x, w, 1e-6, SGLANG.rmsnorm))


def test_fast_path_backward_passes_fp64_gradcheck():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    w = (1 + 0.3 * torch.randn(16, dtype=torch.float64, generator=gen)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: fused_rmsnorm(x, w, 1e-6), (x, w))
    g = torch.randn(4, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    u = torch.randn(4, 7, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(fused_swiglu, (g, u))


@pytest.mark.parametrize("x_dtype", [BF16, torch.float32])
def test_fast_path_backward_matches_reference_autograd_in_bf16(x_dtype):
    x = randn(4, 64, 32, dtype=x_dtype).requires_grad_()
    w = (1 + 0.3 * torch.randn(32)).to(BF16).requires_grad_()
    grad_out = randn(4, 64, 32, seed=2)
    fast = torch.autograd.grad(fused_rmsnorm(x, w, 1e-6), (x, w), grad_out)
    slow = torch.autograd.grad(rmsnorm(x, w, 1e-6, SGLANG.rmsnorm), (x, w), grad_out)
    for a, b in zip(fast, slow, strict=True):
        assert a.dtype == b.dtype
        # Same math in another order: within one fp32 rounding (bf16 results come out equal).
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

    g, u = randn(4, 64, 48).requires_grad_(), randn(4, 64, 48, seed=1).requires_grad_()
    grad_out = randn(4, 64, 48, seed=2)
    fast = torch.autograd.grad(fused_swiglu(g, u), (g, u), grad_out)
    slow = torch.autograd.grad(swiglu(g, u, SGLANG.swiglu), (g, u), grad_out)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)  # the same aten ops autograd would run


def test_fast_path_skips_gradients_nobody_asked_for():
    w = torch.ones(16, dtype=BF16)  # frozen weight
    x = randn(2, 16).requires_grad_()
    (d_x,) = torch.autograd.grad(fused_rmsnorm(x, w, 1e-6).float().sum(), (x,))
    assert d_x.shape == x.shape and w.grad is None
