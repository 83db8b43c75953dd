"""Properties of the pure casts (faircast_ds.casting.rules) and agreement with the slow reference."""
from __future__ import annotations

import math

import pytest
import torch

from faircast_ds.casting.reference import cast_reference
from faircast_ds.casting.bits import bf16_bits, fp32_bits
from faircast_ds.casting.modes import MODES
from faircast_ds.casting.rules import cast

UNBIASED = ("stochastic", "dither", "error_feedback")


def from_bits(bits: list[int]) -> torch.Tensor:
    t = torch.tensor(bits, dtype=torch.int64)
    return (t - ((t & 0x80000000) << 1)).to(torch.int32).view(torch.float32)


def awkward_values(n: int = 3000, seed: int = 0) -> torch.Tensor:
    """Normal weights at several scales, exact bf16 values, subnormals, near-overflow values, signed zeros."""
    g = torch.Generator().manual_seed(seed)
    parts = [
        torch.randn(n, generator=g) * 0.02,
        torch.randn(n // 4, generator=g) * 30.0,
        torch.randn(n // 8, generator=g).to(torch.bfloat16).float(),  # already representable
        from_bits([0x00000001, 0x0000FFFF, 0x00012345, 0x807FFFFF, 0x00800000, 0x80008000]),  # subnormals
        from_bits([0x7F7F7FFF, 0x7F7F0001, 0xFF7F7FFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F7EFFFF]),  # near max
        torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0**-126, 3.0e38]),
    ]
    return torch.cat(parts)


def specials() -> torch.Tensor:
    return from_bits([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7F80FFFF,
                      0x7FFF0000, 0x7F810000])


def run(mode, x, *, seed=7, step=3, name="layer.w", start=0, residual=None, fn=cast):
    if mode == "error_feedback" and residual is None:
        residual = torch.zeros_like(x)
    return fn(x, mode, seed=seed, step=step, name=name, start=start, residual=residual)


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lo = fp32_bits(x) >> 16
    return lo, lo + 1


@pytest.mark.parametrize("mode", MODES)
def test_fast_path_equals_reference_bitwise(mode):
    x = torch.cat([awkward_values(1500), specials()])
    for step in (1, 2, 2**33 + 5):
        r_fast = torch.randn_like(x) * 1e-4 if mode == "error_feedback" else None
        r_ref = r_fast.clone() if r_fast is not None else None
        fast = run(mode, x, step=step, start=11, residual=r_fast)
        ref = run(mode, x, step=step, start=11, residual=r_ref, fn=cast_reference)
        nan = torch.isnan(x)
        assert torch.equal(bf16_bits(fast)[~nan], bf16_bits(ref)[~nan]), f"{mode} step {step}"
        assert torch.isnan(fast[nan].float()).all() and torch.isnan(ref[nan].float()).all()
        if mode != "nearest":  # our NaN bits are specified: quiet, sign and top payload kept
            assert torch.equal(bf16_bits(fast)[nan], bf16_bits(ref)[nan])
        if r_fast is not None:
            assert torch.equal(fp32_bits(r_fast), fp32_bits(r_ref))


def test_nearest_is_what_deepspeed_does_today():
    x = awkward_values()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    out.copy_(x)  # DeepSpeed's bf16.copy_(fp32)
    assert torch.equal(bf16_bits(run("nearest", x)), bf16_bits(out))


@pytest.mark.parametrize("mode", ("stochastic", "dither"))
def test_pieces_equal_whole(mode):
    x = torch.randn(10_007) * 0.05
    whole = run(mode, x, start=0)
    cuts = [0, 1, 333, 5000, 5001, 10_007]
    pieces = torch.cat([run(mode, x[a:b], start=a) for a, b in zip(cuts, cuts[1:])])
    assert torch.equal(bf16_bits(whole), bf16_bits(pieces))
    other_name = run(mode, x, name="layer.other")
    assert not torch.equal(bf16_bits(whole), bf16_bits(other_name)), "noise must depend on the name"


def test_error_feedback_pieces_equal_whole():
    x, e = torch.randn(4099) * 0.05, torch.randn(4099) * 1e-5
    e_whole, e_pieces = e.clone(), e.clone()
    whole = run("error_feedback", x, residual=e_whole)
    pieces = torch.cat([run("error_feedback", x[:1000], residual=e_pieces[:1000]),
                        run("error_feedback", x[1000:], start=1000, residual=e_pieces[1000:])])
    assert torch.equal(bf16_bits(whole), bf16_bits(pieces)) and torch.equal(e_whole, e_pieces)


def test_stochastic_noise_changes_with_step_and_seed_dither_does_not_change_with_step():
    x = torch.randn(20_000) * 0.05
    base = bf16_bits(run("stochastic", x, step=1))
    assert (bf16_bits(run("stochastic", x, step=2)) != base).float().mean() > 0.2
    assert (bf16_bits(run("stochastic", x, step=1, seed=8)) != base).float().mean() > 0.2
    d = bf16_bits(run("dither", x, step=1))
    assert torch.equal(d, bf16_bits(run("dither", x, step=999)))
    assert (bf16_bits(run("dither", x, seed=8)) != d).float().mean() > 0.2


@pytest.mark.parametrize("mode", MODES)
def test_representable_values_come_back_unchanged(mode):
    x = torch.cat([torch.randn(5000).to(torch.bfloat16).float(), torch.tensor([0.0, -0.0, 2.0**-133])])
    e = torch.zeros_like(x)
    out = run(mode, x, residual=e if mode == "error_feedback" else None)
    assert torch.equal(fp32_bits(out.float()), fp32_bits(x))
    assert torch.count_nonzero(e) == 0


@pytest.mark.parametrize("mode", MODES)
def test_every_output_is_a_bf16_neighbour(mode):
    x = awkward_values(20_000)
    lo, hi = neighbours(x)
    for step in range(1, 6):
        e = torch.randn_like(x) * 1e-3 * x.abs() if mode == "error_feedback" else None
        out = bf16_bits(run(mode, x, step=step, residual=e))
        assert bool(((out == lo) | (out == hi)).all()), mode


@pytest.mark.parametrize("mode", ("stochastic", "dither"))
def test_unbiased(mode):
    """E[served] = x. Over N elements x T draws the mean rounding error, in units of the local
    spacing, has standard deviation <= 0.5/sqrt(N*T); we allow 5 sigma."""
    n, steps = 4096, 64
    g = torch.Generator().manual_seed(1)
    base = torch.randn(n, generator=g) * 0.05
    if mode == "dither":  # unbiased across elements: many elements share one value
        x = torch.full((n,), 0.0123456)
        xs = [x]
        names = [f"p{i}" for i in range(steps)]
    else:
        xs = [base]
        names = ["p"] * steps
    total, count = 0.0, 0
    for t in range(steps):
        x = xs[0]
        lo, hi = neighbours(x)
        spacing = ((hi << 16).to(torch.int32).view(torch.float32).double() -
                   (lo << 16).to(torch.int32).view(torch.float32).double()).abs()
        out = run(mode, x, step=t + 1, name=names[t]).double()
        total += float(((out - x.double()) / spacing).sum())
        count += x.numel()
    mean_err = total / count
    assert abs(mean_err) < 5 * 0.5 / math.sqrt(count), mean_err


def test_stochastic_unbiased_for_negative_and_subnormal_values():
    n = 8192
    for value_bits in (0xBC4CCCCD, 0x00012345, 0x80034567):  # -0.0125, two subnormals
        x = from_bits([value_bits] * n)
        lo, hi = neighbours(x)
        lo_v = (lo << 16).to(torch.int32).view(torch.float32).double()
        hi_v = (hi << 16).to(torch.int32).view(torch.float32).double()
        mean = torch.stack([run("stochastic", x, step=s, name=f"q{s}").double() for s in range(1, 17)]).mean()
        sd = float((hi_v - lo_v).abs()[0]) * 0.5 / math.sqrt(16 * n)
        assert abs(float(mean) - float(x[0])) < 5 * sd


def test_error_feedback_is_unbiased_over_time_and_sums_match_exactly():
    """Within a binade the fp32 add master + e is exact, so sum(served) - sum(master) = -e_T exactly."""
    g = torch.Generator().manual_seed(2)
    master = 1.0 + torch.rand(2048, generator=g) * 0.9  # stays in [1, 2)
    e = torch.zeros_like(master)
    sum_served = torch.zeros(2048, dtype=torch.float64)
    sum_master = torch.zeros(2048, dtype=torch.float64)
    for t in range(200):
        master = (master + torch.randn(2048, generator=g) * 1e-4).clamp(1.0, 1.99)
        served = run("error_feedback", master, step=t + 1, residual=e)
        half_spacing = 2.0**-8  # bf16 spacing in [1, 2) is 2^-7
        assert float(e.abs().max()) <= half_spacing
        sum_served += served.double()
        sum_master += master.double()
    assert torch.equal(sum_served - sum_master, -e.double())


def test_error_feedback_residual_within_half_spacing_everywhere():
    x = awkward_values(20_000)
    e = torch.zeros_like(x)
    for t in range(5):
        served = run("error_feedback", x * (1 + 1e-4 * t), step=t, residual=e)
        finite = torch.isfinite(served.float())
        lo, hi = neighbours(served.float()[finite])
        spacing = ((hi << 16).to(torch.int32).view(torch.float32) -
                   (lo << 16).to(torch.int32).view(torch.float32)).abs()
        assert bool((e[finite].abs() <= spacing / 2).all())


@pytest.mark.parametrize("mode", MODES)
def test_special_values(mode):
    x = specials()
    out = run(mode, x).float()
    assert torch.isnan(out[4:]).all() and torch.isnan(out[2:4]).all(), "NaN of any payload stays NaN"
    assert out[0] == math.inf and out[1] == -math.inf
    zeros = run(mode, torch.tensor([-0.0, 0.0]))
    assert bf16_bits(zeros).tolist() == [0x8000, 0x0000]


@pytest.mark.parametrize("mode", MODES)
def test_finite_never_becomes_inf_unless_nearest_does(mode):
    x = from_bits([0x7F7F7FFF, 0x7F7F4000, 0xFF7F7FFF, 0x7F7F0001] * 2048)
    for step in range(1, 9):
        e = torch.full_like(x, 1e30) if mode == "error_feedback" else None
        out = run(mode, x, step=step, residual=e).float()
        assert torch.isfinite(out).all(), mode
    big = from_bits([0x7F7FC000] * 4096)  # round-to-nearest gives Inf here; Inf is then a neighbour
    lo, hi = neighbours(big)
    out = bf16_bits(run(mode, big))
    assert bool(((out == lo) | (out == hi)).all())


def test_bad_arguments_are_named():
    x = torch.randn(8)
    with pytest.raises(ValueError, match="unknown fair cast mode 'stochastc'.*stochastic"):
        cast(x, "stochastc", seed=0, step=0, name="w")
    with pytest.raises(TypeError, match="1-D float32"):
        cast(x.double(), "stochastic", seed=0, step=0, name="w")
    with pytest.raises(ValueError, match="needs residual"):
        cast(x, "error_feedback", seed=0, step=0, name="w")
    with pytest.raises(ValueError, match="only used by mode 'error_feedback'"):
        cast(x, "dither", seed=0, step=0, name="w", residual=torch.zeros(8))
    with pytest.raises(ValueError, match="non-negative"):
        cast(x, "stochastic", seed=-1, step=0, name="w")
