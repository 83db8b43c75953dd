"""``align_rounding`` configuration, as embedded in the ``fair_cast`` section of a DeepSpeed JSON.

    "fair_cast": {"align_rounding": {"engine": "sglang", "regions": ["rope", "swiglu", "rmsnorm"]}}

Pydantic only: importing this module does not import torch or transformers.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from faircast_ds.align.profiles import REGIONS, EngineName, RegionName, check_regions


class AlignRoundingConfig(BaseModel):
    """Align the trainer's rounding to an inference engine's; each key documents itself in its
    ``Field(description=...)``. Unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineName = Field(description=(
        "The engine profile to match: `hf` (transformers eager; alignment is a no-op), `vllm-cuda` "
        "(vLLM custom ops), `vllm-inductor` (vLLM compiled `forward_native`), `sglang` (FlashInfer), `vllm-cpu` "
        "(vLLM's CPU build, eager)."))
    regions: list[RegionName] = Field(default_factory=lambda: list(REGIONS), description=(
        "Which regions to align, each at most once: `rope`, `swiglu`, `rmsnorm` (residual add + "
        "RMSNorm) and `attention`; default all four."))

    @field_validator("regions")
    @classmethod
    def _no_repeats(cls, regions: list[str]) -> list[str]:
        check_regions(regions)  # a repeated region is almost certainly a typo for another one
        return regions
