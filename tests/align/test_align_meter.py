"""The mismatch meter: metric definitions, direction, and per-region attribution."""
from __future__ import annotations

import math

import pytest
import torch

from faircast_ds.align import REGIONS, align_model, measure_mismatch
from faircast_ds.align.meter import gap_stats, token_logprobs
from faircast_ds.align.patch import is_aligned
from faircast_ds.align.profiles import get_profile
from faircast_bench.builders import alignment_lm, single_thread, token_ids


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def model():
    return alignment_lm("qwen3")


IDS = token_ids(batch=4, length=32)


def test_gap_stats_on_known_values():
    trainer = torch.tensor([0.0, 0.0, 0.0, 0.0])
    engine = torch.tensor([-0.1, 0.1, -0.3, 0.3])  # r = trainer − engine = [0.1, −0.1, 0.3, −0.3]
    stats = gap_stats(trainer, engine)
    r = torch.tensor([0.1, -0.1, 0.3, -0.3], dtype=torch.float64)
    assert stats["mean_abs"] == pytest.approx(0.2)
    assert stats["max_abs"] == pytest.approx(0.3)
    assert stats["rms"] == pytest.approx(math.sqrt(0.05))
    assert stats["k3_kl"] == pytest.approx((torch.exp(r) - 1 - r).mean().item())


def test_k3_uses_r_equal_trainer_minus_engine():
    # One token the trainer likes more than the engine: r = +1 gives e − 2 ≈ 0.718; the
    # opposite sign convention would give 1/e ≈ 0.368.
    stats = gap_stats(torch.tensor([0.0]), torch.tensor([-1.0]))
    assert stats["k3_kl"] == pytest.approx(math.e - 2)


def test_token_logprobs_scores_next_tokens():
    logits = torch.zeros(1, 3, 5)
    logits[0, 0, 2] = 10.0  # position 0 predicts token 2 confidently
    lp = token_logprobs(logits, torch.tensor([[0, 2, 4]]))
    assert lp.shape == (1, 2)
    assert lp[0, 0] > -1e-3 and lp[0, 1] == pytest.approx(-math.log(5))


def test_hf_engine_and_fully_aligned_trainer_show_no_gap(model):
    assert measure_mismatch(model, IDS, "hf").rms == 0.0
    for engine in ("vllm-cuda", "vllm-inductor", "sglang"):
        report = measure_mismatch(model, IDS, engine, trainer_regions=REGIONS, attribute=False)
        assert (report.mean_abs, report.max_abs, report.rms, report.k3_kl) == (0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("engine", ["vllm-cuda", "vllm-inductor", "sglang"])
def test_unaligned_gap_and_region_attribution(model, engine):
    report = measure_mismatch(model, IDS, engine)
    assert report.num_tokens == IDS.shape[0] * (IDS.shape[1] - 1)
    assert report.rms > 5e-3  # measured 0.03–0.04
    assert report.mean_abs <= report.rms <= report.max_abs
    assert report.k3_kl == pytest.approx(report.rms**2 / 2, rel=0.1)  # small gaps: k3 ≈ r²/2
    assert set(report.region_share) == set(report.region_rms) == set(REGIONS)
    profile = get_profile(engine)
    for region in REGIONS:
        if profile.differs_from_hf(region):
            assert report.region_rms[region] > 1e-3
        else:
            assert report.region_share[region] == 0.0 and report.region_rms[region] == 0.0
    assert engine in report.summary() and "rope=" in report.summary()


def test_vllm_cuda_gap_is_all_rope(model):
    report = measure_mismatch(model, IDS, "vllm-cuda")
    assert report.region_share == {"rope": 1.0, "swiglu": 0.0, "rmsnorm": 0.0, "attention": 0.0}
    assert report.region_rms["rope"] == pytest.approx(report.rms)


def test_aligning_part_of_the_trainer_is_measured_as_asked(model):
    unaligned = measure_mismatch(model, IDS, "sglang", attribute=False)
    partial = measure_mismatch(model, IDS, "sglang", trainer_regions=["rmsnorm"], attribute=False)
    assert partial.trainer_regions == ("rmsnorm",)
    assert 0.0 < partial.rms != unaligned.rms


def test_meter_restores_mode_and_leaves_the_model_unaligned(model):
    model.train()
    try:
        measure_mismatch(model, IDS, "sglang")
        assert model.training and not is_aligned(model)
    finally:
        model.eval()


def test_meter_refuses_an_aligned_model_or_a_non_eager_kernel(model):
    with align_model(model, "sglang"), pytest.raises(RuntimeError, match="remove"):
        measure_mismatch(model, IDS, "sglang")
    with pytest.raises(ValueError, match="eager"):
        measure_mismatch(alignment_lm("qwen3", attn="sdpa"), IDS, "sglang")
    with pytest.raises(ValueError, match="unknown engine"):
        measure_mismatch(model, IDS, "vllm")
