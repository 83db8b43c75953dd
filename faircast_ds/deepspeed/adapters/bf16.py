"""BF16_Optimizer (``deepspeed/runtime/bf16_optimizer.py``): bf16 + ZeRO-1 with fp32 gradient
accumulation, and pipelines. ``step()`` -> ``update_lp_params()``: copy each local partition, then
``all_gather_dp_groups``; the cast takes the place of those copies as in ZeRO-1/2's
``update_lp_params`` (``compat.lp_params_copy``)."""
from __future__ import annotations

from typing import Any

import torch

from faircast_ds.deepspeed.adapters.zero12 import GatherSiteAdapter


class BF16OptimizerAdapter(GatherSiteAdapter):
    zero_stage = 1

    def __init__(self, optimizer: Any, caster: Any, names: dict) -> None:
        from deepspeed.runtime import bf16_optimizer

        self.module = bf16_optimizer
        super().__init__(optimizer, caster, names)

    def lp_groups(self) -> list[list[torch.Tensor]]:
        return self.optimizer.bf16_groups

    def masters(self) -> list[torch.Tensor]:
        return self.optimizer.fp32_groups_flat_partition

    def partitions(self) -> list[list[torch.Tensor]]:
        return self.optimizer.bf16_partitioned_groups

    def groups_flat(self) -> list[torch.Tensor]:
        return self.optimizer.bf16_groups_flat
