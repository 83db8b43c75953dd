"""vLLM's CPU kernels round their fp32 results to bf16 by truncation on a CPU without AVX512-BF16 (issue 51):
the ``vllm-cpu-avx2`` profile's RoPE and attention against oracles written here in numpy from the kernels'
arithmetic (``csrc/cpu/pos_encoding.cpp``: fp32 ``x·cos − y·sin`` with the cache in bf16; the conversion
``FP32Vec8_to_BF16Vec8_avx2``: keep the top 16 bits), sharing no code with ``regions.py``; and which
profile ``vllm-cpu`` resolves to on which CPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from faircast_ds.align import profiles
from faircast_ds.align.profiles import VLLM_CPU_AVX2, VLLM_CPU_AVX512BF16, get_profile
from faircast_ds.align.regions import attention, rope, round_to

BF16 = torch.bfloat16


# --- oracles: numpy bit arithmetic --------------------------------------------------------------


def np_truncate(a: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 as the AVX2 kernel converts: the top 16 bits, returned as fp32 values."""
    return (a.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def np_nearest(a: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 rounded to nearest even (finite values), returned as fp32 values."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def bf16_values(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy()


def fp32_samples(n=20000, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 6, n)).astype(np.float32)
    # values one bf16 ulp apart plus half an ulp (exact ties) and a hair either side
    base = np_truncate(a[:300])
    ulp = np.abs(base) * np.float32(2.0 ** -7)
    ties = np.concatenate([base + ulp / 2, base + ulp * np.float32(0.4999), base + ulp * np.float32(0.5001)])
    return np.concatenate([a, -a[:1000], ties.astype(np.float32), np.float32([0.0, -0.0, 1e-40, -1e-40])])


def test_truncation_keeps_the_top_16_bits_and_nearest_is_torchs_cast():
    a = fp32_samples()
    x = torch.from_numpy(a)
    truncated = bf16_values(round_to(x, BF16, "truncate"))
    np.testing.assert_array_equal(truncated.view(np.uint32), np_truncate(a).view(np.uint32))
    assert np.all(np.abs(truncated) <= np.abs(a))  # toward zero
    nearest = bf16_values(round_to(x, BF16, "even"))
    np.testing.assert_array_equal(nearest.view(np.uint32), np_nearest(a).view(np.uint32))
    assert 0.4 < np.mean(truncated != nearest) < 0.6  # about half of the values round up to nearest


def test_truncation_passes_the_gradient_straight_through_and_leaves_other_dtypes_alone():
    x = torch.randn(64, dtype=torch.float32, requires_grad=True)
    (round_to(x, BF16, "truncate").float() * torch.arange(64.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(64.0))
    y = torch.randn(8, dtype=torch.float64)
    assert torch.equal(round_to(y, BF16, "truncate"), y.to(BF16))  # only fp32 -> bf16 is the kernel's
    assert torch.equal(round_to(x.detach(), torch.float16, "truncate"), x.detach().half())
    with pytest.raises(ValueError, match="rounding mode"):
        round_to(x.detach(), BF16, "stochastic")


def rope_case(seed=0, length=24, dim=64, heads=3):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(1, heads, length, dim, generator=g)).to(BF16)
    inv = 1.0 / (100000.0 ** (torch.arange(0, dim, 2).float() / dim))
    ang = torch.arange(length).float()[:, None] * inv
    ang = torch.cat((ang, ang), -1)
    return x, ang.cos()[None, None], ang.sin()[None, None]


def np_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, convert) -> np.ndarray:
    """pos_encoding.cpp's NeoX rotation: cache in bf16, each output ``x1·c − x2·s`` / ``x2·c + x1·s`` in fp32."""
    xv = bf16_values(x)
    c = np_nearest(cos.numpy())  # the cache cast to the query dtype (torch: to nearest)
    s = np_nearest(sin.numpy())
    half = xv.shape[-1] // 2
    x1, x2 = xv[..., :half], xv[..., half:]
    c1, s1 = c[..., :half], s[..., :half]
    out1 = x1 * c1 - x2 * s1
    out2 = x2 * c1 + x1 * s1
    return convert(np.concatenate([out1, out2], axis=-1).astype(np.float32))


@pytest.mark.parametrize("profile, convert", [(VLLM_CPU_AVX2, np_truncate), (VLLM_CPU_AVX512BF16, np_nearest)])
def test_cpu_rope_is_the_kernels_arithmetic_bit_for_bit(profile, convert):
    for seed in range(3):
        x, cos, sin = rope_case(seed)
        got = bf16_values(rope(x, cos, sin, profile.rope))
        np.testing.assert_array_equal(got.view(np.uint32), np_rope(x, cos, sin, convert).view(np.uint32))


def test_the_two_cpu_ropes_differ_on_about_half_the_elements():
    x, cos, sin = rope_case(1)
    a, b = rope(x, cos, sin, VLLM_CPU_AVX2.rope), rope(x, cos, sin, VLLM_CPU_AVX512BF16.rope)
    assert 0.3 < (a != b).double().mean().item() < 0.7
    assert torch.all(a.float().abs() <= b.float().abs())


def np_attention(q, k, v, scale) -> np.ndarray:
    """Causal softmax attention in float64 (the kernel's fp32 up to summation order)."""
    q, k, v = (bf16_values(t).astype(np.float64) for t in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) * scale
    s = s + np.triu(np.full(s.shape[-2:], -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("profile, convert", [(VLLM_CPU_AVX2, np_truncate), (VLLM_CPU_AVX512BF16, np_nearest)])
def test_cpu_attention_rounds_its_fp32_output_once_as_the_kernel_converts(profile, convert):
    g = torch.Generator().manual_seed(3)
    q, k, v = ((2 * torch.randn(1, 4, 32, 64, generator=g)).to(BF16) for _ in range(3))
    mask = torch.full((32, 32), torch.finfo(BF16).min, dtype=BF16).triu(1)
    got = bf16_values(attention(q, k, v, mask, 0.125, profile.attention))
    exact = np_attention(q, k, v, 0.125)
    want = convert(exact.astype(np.float32))
    other = (np_nearest if convert is np_truncate else np_truncate)(exact.astype(np.float32))
    # fp32 against float64 sums: a value within an fp32 ulp of a bf16 boundary may go either way
    assert np.mean(got == want) > 0.99
    assert np.mean(got == other) < 0.75
    ulp = np.abs(want) * 2.0 ** -7 + 1e-30
    assert np.all(np.abs(got - want) <= ulp * 1.01)


# --- which profile ``vllm-cpu`` is ---------------------------------------------------------------


@pytest.mark.parametrize("machine, bf16, variant", [("x86_64", False, VLLM_CPU_AVX2), ("x86_64", True, VLLM_CPU_AVX512BF16),
                                                    ("aarch64", False, VLLM_CPU_AVX512BF16)])
def test_vllm_cpu_is_the_variant_of_the_hosts_cpu(monkeypatch, machine, bf16, variant):
    import platform

    monkeypatch.setattr(profiles, "host_has_avx512_bf16", lambda: bf16)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    resolved = get_profile("vllm-cpu")
    assert resolved.name == "vllm-cpu"
    for region in ("rope", "swiglu", "rmsnorm", "attention"):
        assert resolved.region(region).same_numerics(variant.region(region)), region


def test_the_cpu_variants_differ_only_in_how_rope_and_attention_round():
    for region in ("swiglu", "rmsnorm"):
        assert VLLM_CPU_AVX2.region(region) == VLLM_CPU_AVX512BF16.region(region)
    for region in ("rope", "attention"):
        assert VLLM_CPU_AVX2.region(region).to_bf16 == "truncate"
        assert VLLM_CPU_AVX512BF16.region(region).to_bf16 == "even"
        assert not VLLM_CPU_AVX2.region(region).same_numerics(VLLM_CPU_AVX512BF16.region(region))
    assert "truncated" in VLLM_CPU_AVX2.rounding_table()
    with pytest.raises(ValueError, match="fused"):
        profiles.Rounding(fused=False, where="", source="", to_bf16="truncate")


def test_host_detection_reads_the_cpu_flags():
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    assert profiles.host_has_avx512_bf16() == ("avx512_bf16" in flags)
    assert profiles.host_has_avx512_bf16() == bool(torch.cpu._is_avx512_bf16_supported())


# --- the whole aligned model against the profile's reference forward, for both CPUs ---------------


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("engine", ["vllm-cpu-avx2", "vllm-cpu-avx512bf16"])
def test_aligned_trainer_equals_the_cpu_variants_reference_bitwise(family, engine):
    from faircast_ds.align import align_model, reference_logits
    from faircast_bench.builders import alignment_lm, token_ids

    model, ids = alignment_lm(family), token_ids()
    with align_model(model, engine), torch.no_grad():
        got = model(input_ids=ids).logits
    assert torch.equal(got, reference_logits(model, ids, engine))
