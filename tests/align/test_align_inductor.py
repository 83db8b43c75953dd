"""The ``vllm-inductor`` profile against the real compiler.

vLLM's compiled path runs its ``forward_native`` torch code through Inductor. These tests compile
the same expressions (vLLM's bf16 ops and explicit casts, re-typed here) and check that Inductor's
fused output equals the profile's one-rounding reference bit for bit, and that with
``emulate_precision_casts`` it falls back to HF eager's roundings. If a torch release changes
what Inductor fuses, these fail and the profile needs revisiting.
"""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from faircast_ds.align.profiles import HF, SGLANG, VLLM_INDUCTOR
from faircast_ds.align.regions import add_rmsnorm, rope, swiglu
from faircast_bench.builders import single_thread

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor's CPU backend needs a C++ compiler")
BF16 = torch.bfloat16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(params=[False, True], ids=["fused", "emulated-casts"])
def emulate(request):
    saved = torch._inductor.config.emulate_precision_casts
    torch._inductor.config.emulate_precision_casts = request.param
    torch._dynamo.reset()
    yield request.param
    torch._inductor.config.emulate_precision_casts = saved
    torch._dynamo.reset()


def silu_and_mul(x):  # vLLM SiluAndMul.forward_native
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rms_norm_static(x, residual, weight, eps):  # vLLM RMSNorm.forward_static, with residual
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    x = x + residual
    residual = x.to(orig_dtype)
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x.to(orig_dtype) * weight, residual


def rope_native(q, cos, sin):  # vLLM apply_rotary_emb_torch, NeoX style
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    x1, x2 = torch.chunk(q, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def data(seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(BF16)

    angles = torch.arange(64).float()[:, None] / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    return randn(64, 512, scale=2), randn(64, 256, scale=0.05), randn(64, 256), randn(64, 8, 64, scale=2), angles


def test_compiled_swiglu_rounds_once(emulate):
    gate_up = data()[0]
    got = torch.compile(silu_and_mul)(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = swiglu(gate, up, HF.swiglu if emulate else VLLM_INDUCTOR.swiglu)
    assert torch.equal(got, expected)


def test_compiled_add_rmsnorm_norms_the_fp32_sum_and_rounds_once(emulate):
    _, x, residual, _, _ = data()
    weight = (1 + 0.3 * torch.randn(256, generator=torch.Generator().manual_seed(1))).to(BF16)
    out, new_residual = torch.compile(rms_norm_static)(x, residual, weight, 1e-6)
    expected, expected_residual = add_rmsnorm(x, residual, weight, 1e-6, VLLM_INDUCTOR.rmsnorm)
    assert torch.equal(new_residual, expected_residual)
    if emulate:  # the second rounding comes back: what uncompiled forward_native computes
        total = x.float() + residual.float()
        expected = weight * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6)).to(BF16)
    assert torch.equal(out, expected)


def test_compiled_rope_rounds_once_with_vllms_bf16_cache(emulate):
    *_, q, angles = data()
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # [T, 1, D/2]
    got = torch.compile(rope_native)(q, cos.to(BF16), sin.to(BF16))  # vLLM stores the cache in bf16
    full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    expected = rope(q, full_cos, full_sin, HF.rope if emulate else VLLM_INDUCTOR.rope)
    assert torch.equal(got, expected)


def test_compiled_rope_with_an_fp32_cache_would_be_sglangs_rounding(monkeypatch):
    # Why the profile depends on vLLM casting its cache at init: Inductor also drops the
    # cos.to(bf16) rounding when the cache is fp32.
    monkeypatch.setattr(torch._inductor.config, "emulate_precision_casts", False)
    torch._dynamo.reset()
    *_, q, angles = data()
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    got = torch.compile(rope_native)(q, cos, sin)
    assert torch.equal(got, rope(q, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), SGLANG.rope))
