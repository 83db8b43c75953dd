"""The real architectures (faircast_ds.models.builders) built as DeepSpeed users build large models: under
``deepspeed.zero.Init`` for ZeRO-3, so each rank holds only its partition from the start."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from faircast_ds.models import builders as models


class ZeroInit:
    """:class:`faircast_ds.models.builders.Partitioning` for ZeRO-3: build under ``zero.Init``; initialise each
    parameter gathered, rank 0's write kept (DeepSpeed re-partitions what a gathered parameter's
    ``modifier_rank`` wrote and drops writes without one)."""

    def __init__(self, ds_config: dict[str, Any]) -> None:
        self.ds_config = ds_config

    def building(self, dtype: torch.dtype) -> Any:
        import deepspeed

        return deepspeed.zero.Init(config_dict_or_path=self.ds_config, dtype=dtype)

    @contextlib.contextmanager
    def modifying(self, param: torch.nn.Parameter) -> Iterator[None]:
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            yield


def is_zero3(ds_config: dict[str, Any] | None) -> bool:
    return bool(ds_config) and int(ds_config.get("zero_optimization", {}).get("stage", 0)) == 3


def real_causal_lm(name: str, *, ds_config: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """:func:`faircast_ds.models.builders.real_causal_lm` for the DeepSpeed config the model will train under:
    partitioned from the start (``zero.Init``) when it is ZeRO stage 3, built whole otherwise."""
    partitioning = ZeroInit(ds_config) if is_zero3(ds_config) and kwargs.get("device") is None else None
    return models.real_causal_lm(name, partitioning=partitioning, **kwargs)
