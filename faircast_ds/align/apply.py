"""Config → alignment: the one call the DeepSpeed wiring needs."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from faircast_ds.align.config import AlignRoundingConfig
from faircast_ds.align.patch import AlignmentHandle, align_model


def apply_from_config(model: nn.Module, cfg: AlignRoundingConfig | Mapping[str, Any]) -> AlignmentHandle:
    """Align ``model`` as ``cfg`` says (an :class:`AlignRoundingConfig` or its raw dict).

    Call it on the HF module (``engine.module`` after ``deepspeed.initialize`` works too): the
    patches replace forward computations only, never parameter storage, so ZeRO-3 partitioning
    and its gather hooks are unaffected.
    """
    if not isinstance(cfg, AlignRoundingConfig):
        cfg = AlignRoundingConfig.model_validate(cfg)
    return align_model(model, cfg.engine, cfg.regions)
