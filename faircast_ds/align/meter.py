"""Mismatch meter: trainer log-probs against an engine profile's reference log-probs.

Both sides score the same token sequences (next-token log-probs, teacher forced). Metrics, per
target token, with ``r = logp_trainer − logp_engine``:

- ``mean_abs``, ``max_abs``: mean and max of ``|r|`` (the per-token gap slime reports);
- ``rms``: ``sqrt(mean(r²))``;
- ``k3_kl``: ``mean(exp(r) − 1 − r)``, Schulman's k3 estimator. Each term is ≥ 0. When tokens are
  sampled by the engine, as in RL rollouts, it is an unbiased estimate of KL(engine ‖ trainer).
  (With the sign of ``r`` flipped it would estimate KL(trainer ‖ engine) under trainer samples;
  the two agree to second order, ≈ rms²/2, at the gaps seen here.)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from faircast_ds.align.patch import align_model, is_aligned
from faircast_ds.align.profile_forward import reference_logits
from faircast_ds.align.profiles import REGIONS, check_regions, get_profile
from faircast_ds.align.regions import wide


@dataclass
class MismatchReport:
    """Gap between trainer and engine log-probs; see the module docstring for each metric.

    Attributes:
        region_share: per region, the share of the *unaligned* trainer's gap variance that
            aligning that region alone removes: ``1 − rms²(aligned on it alone) / rms²(unaligned)``.
            0 for a region the engine rounds like HF. Noisy and not additive: rounding
            perturbations are amplified downstream, so shares need not sum to 1 and can be < 0.
        region_rms: per region, the RMS gap between the unaligned trainer and an engine that
            differs from HF eager in that region only (what the region costs on its own).
    """

    engine: str
    trainer_regions: tuple[str, ...]
    num_tokens: int
    mean_abs: float
    max_abs: float
    rms: float
    k3_kl: float
    region_share: dict[str, float] = field(default_factory=dict)
    region_rms: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        """One line of the headline numbers."""
        aligned = ",".join(self.trainer_regions) or "none"
        shares = " ".join(
            f"{r}={s:.0%}(alone {self.region_rms.get(r, 0.0):.3g})" for r, s in self.region_share.items()
        )
        return (
            f"{self.engine} (trainer aligned: {aligned}) over {self.num_tokens} tokens: "
            f"mean|Δ|={self.mean_abs:.3g} max|Δ|={self.max_abs:.3g} rms={self.rms:.3g} "
            f"k3={self.k3_kl:.3g}" + (f" | share {shares}" if shares else "")
        )


def token_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """Log-prob (at least fp32) of each next token: ``[B, T-1]`` from logits ``[B, T, V]``."""
    logp = F.log_softmax(wide(logits[:, :-1]), dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def gap_stats(logp_trainer: Tensor, logp_engine: Tensor) -> dict[str, float]:
    """``mean_abs``, ``max_abs``, ``rms``, ``k3_kl`` of ``r = logp_trainer − logp_engine``."""
    r = (logp_trainer - logp_engine).double()
    return {
        "mean_abs": r.abs().mean().item(),
        "max_abs": r.abs().max().item(),
        "rms": r.pow(2).mean().sqrt().item(),
        "k3_kl": (torch.expm1(r) - r).mean().item(),
    }


def measure_mismatch(
    model: nn.Module,
    input_ids: Tensor,
    engine: str,
    trainer_regions: Sequence[str] = (),
    attribute: bool = True,
) -> MismatchReport:
    """Gap between the trainer (HF eager, aligned on ``trainer_regions``) and ``engine``'s reference.

    Args:
        model: an unaligned HF Qwen3/Qwen2/Llama ``*ForCausalLM`` with eager attention (the
            reference runs eager attention; another kernel would add its own gap).
        input_ids: ``[B, T]`` token ids, no padding.
        engine: the engine profile the reference forward follows.
        trainer_regions: regions to align on the trainer side for this measurement.
        attribute: also fill ``region_share`` and ``region_rms`` (per region that differs from
            HF: one aligned trainer forward and one reference forward).
    """
    get_profile(engine)  # fail on an unknown engine before any work
    trainer_regions = check_regions(trainer_regions)
    if is_aligned(model):
        raise RuntimeError("measure_mismatch aligns the model itself; remove() the active alignment first")
    attn = getattr(model.config, "_attn_implementation", None)
    if attn != "eager":
        raise ValueError(f"measure_mismatch needs attn_implementation='eager' (the reference's kernel), got {attn!r}")

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            engine_lp = token_logprobs(reference_logits(model, input_ids, engine), input_ids)
            stats = gap_stats(_trainer_logprobs(model, input_ids, engine, trainer_regions), engine_lp)
            shares, region_rms = _attribute(model, input_ids, engine, engine_lp) if attribute else ({}, {})
    finally:
        model.train(was_training)
    return MismatchReport(
        engine, trainer_regions, engine_lp.numel(), **stats, region_share=shares, region_rms=region_rms
    )


def _attribute(
    model: nn.Module, input_ids: Tensor, engine: str, engine_lp: Tensor
) -> tuple[dict[str, float], dict[str, float]]:
    """(region_share, region_rms) of :class:`MismatchReport`."""
    profile = get_profile(engine)
    hf_lp = _trainer_logprobs(model, input_ids, engine, ())
    base = gap_stats(hf_lp, engine_lp)["rms"]
    shares, region_rms = {}, {}
    for region in REGIONS:
        if not profile.differs_from_hf(region) or base == 0.0:
            shares[region] = region_rms[region] = 0.0
            continue
        remaining = gap_stats(_trainer_logprobs(model, input_ids, engine, (region,)), engine_lp)["rms"]
        shares[region] = 1.0 - (remaining / base) ** 2
        only_lp = token_logprobs(reference_logits(model, input_ids, engine, (region,)), input_ids)
        region_rms[region] = gap_stats(hf_lp, only_lp)["rms"]
    return shares, region_rms


def _trainer_logprobs(model: nn.Module, input_ids: Tensor, engine: str, regions: tuple[str, ...]) -> Tensor:
    with align_model(model, engine, regions):
        return token_logprobs(model(input_ids=input_ids).logits, input_ids)
