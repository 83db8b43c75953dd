"""The real architectures (faircast_bench.builders) built as DeepSpeed users build large models: under
``deepspeed.zero.Init`` for ZeRO-3, so each rank holds only its partition from the start."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from faircast_bench import builders as models


class ZeroInit:
    """:class:`faircast_ds.models.pretrained.Partitioning` for ZeRO-3: build under ``zero.Init``; initialise each
    parameter gathered, rank 0's write kept (DeepSpeed re-partitions what a gathered parameter's
    ``modifier_rank`` wrote and drops writes without one)."""

    def __init__(self, ds_config: dict[str, Any]) -> None:
        self.ds_config = ds_config

    def building(self, dtype: torch.dtype) -> Any:
        """``zero.Init`` building parameters in ``dtype``. The dtype comes from the config when the config
        implies it: on an accelerator without fp16 (the CPU accelerator), DeepSpeed 0.16-0.19 ignore an
        explicit ``dtype=`` and build bf16 (``dtype or fp16 if fp16 supported else bf16`` binds as
        ``(dtype or fp16) if ... else bf16``), so an fp32 model asked for there came out bf16. Whatever
        DeepSpeed settles on is checked: a model built in another dtype than asked is refused."""
        import deepspeed

        implied = config_dtype(self.ds_config)
        init = deepspeed.zero.Init(config_dict_or_path=self.ds_config, dtype=None if implied == dtype else dtype)
        if init.dtype != dtype:
            raise RuntimeError(f"deepspeed.zero.Init would build {init.dtype} parameters where {dtype} was asked "
                               f"(the DeepSpeed config implies {implied}); give a config whose bf16/fp16 "
                               f"sections match the dtype")
        return init

    @contextlib.contextmanager
    def modifying(self, param: torch.nn.Parameter) -> Iterator[None]:
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            yield


def config_dtype(ds_config: dict[str, Any]) -> torch.dtype:
    """The parameter dtype a DeepSpeed config trains in: bf16, fp16, or fp32 when neither is enabled."""
    def enabled(key: str) -> bool:
        section = ds_config.get(key) or {}
        return bool(section.get("enabled", False)) if isinstance(section, dict) else False

    if enabled("bf16") or enabled("bfloat16"):
        return torch.bfloat16
    if enabled("fp16") or enabled("float16"):
        return torch.float16
    return torch.float32


def is_zero3(ds_config: dict[str, Any] | None) -> bool:
    return bool(ds_config) and int(ds_config.get("zero_optimization", {}).get("stage", 0)) == 3


def real_causal_lm(name: str, *, ds_config: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """:func:`faircast_bench.builders.real_causal_lm` for the DeepSpeed config the model will train under:
    partitioned from the start (``zero.Init``) when it is ZeRO stage 3, built whole otherwise."""
    partitioning = ZeroInit(ds_config) if is_zero3(ds_config) and kwargs.get("device") is None else None
    return models.real_causal_lm(name, partitioning=partitioning, **kwargs)
