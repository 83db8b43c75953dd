"""Megatron-Core's DistributedOptimizer (``megatron/core/optimizer/distrib_optimizer.py``).

After every successful step, ``step_with_ready_grads`` calls ``_copy_main_params_to_model_params``:
each rank copies its fp32 main shards into its range of the param buffer (round to nearest), then
the param all-gather builds the full bf16 parameters. That copy is the one refresh site; no
checkpoint load refreshes bf16 from fp32 (loads restore the model's bf16 weights and the main
params separately). The runtime route replaces the method on the optimizer instance with the same
copy done by the caster, shard by shard; a Megatron-Core carrying
``patches/megatron-core-0.16.1-fair-cast.patch`` calls our hook instead (``faircast_ds.megatron.hook``).
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from faircast_ds.megatron.layout import global_names, split_of
from faircast_ds.megatron.shards import ParamShard, fp32_shards, low_precision_shards
from faircast_ds.shard.adapter import Adapter, Setup
from faircast_ds.shard.caster import ShardCaster, ShardSlice


def distributed_optimizers(optimizer: Any) -> list[Any]:
    """The DistributedOptimizer instances behind ``optimizer`` (itself, or a ChainedOptimizer's)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def parameter_names(optimizer: Any) -> dict:
    """parameter -> the name of the full parameter it is (part of), the noise id: wrappers' ``module.``
    prefixes removed, pipeline stages' layer numbers made global (:func:`faircast_ds.megatron.layout.
    global_names`), so every layout names one parameter alike."""
    return global_names(optimizer.model_chunks)


class MegatronAdapter(Adapter):
    """One DistributedOptimizer's shards: one flat group per owned parameter shard, keyed (name, start)."""

    setup = Setup.of(optimizer="DistributedOptimizer")  # what the banner says and the state file keeps

    def __init__(self, optimizer: Any, caster: ShardCaster, names: dict) -> None:
        super().__init__(optimizer, caster, names)
        if optimizer.is_stub_optimizer:  # no parameters on this rank
            self._shards: list[tuple[ParamShard, torch.Tensor, torch.Tensor]] = []
            self._fp32: list[tuple[torch.Tensor, torch.Tensor]] = []
        else:
            self._shards = list(low_precision_shards(optimizer, names))
            self._fp32 = list(fp32_shards(optimizer))
        self._by_param = {id(p): names[p] for group in getattr(optimizer, "model_float16_groups", []) for p in group}
        self._hook_slices: dict[tuple[int, int, int], list[ShardSlice]] = {}

    def flat_groups(self) -> Iterator[tuple[Any, torch.Tensor, torch.Tensor, list[ShardSlice]]]:
        for shard, main, served in self._shards:
            yield shard.key, main, served, shard.slices()

    def name_of(self, model_param: torch.nn.Parameter) -> str:
        return self._by_param[id(model_param)]

    def slices_of(self, model_param: torch.nn.Parameter, start: int, numel: int) -> list[ShardSlice]:
        """The caster's slices for elements ``[start, start + numel)`` of this rank's ``model_param`` (keyed
        by the full parameter's name and indices), computed once per shard: the hook route's."""
        key = (id(model_param), start, numel)
        slices = self._hook_slices.get(key)
        if slices is None:
            slices = ParamShard(self.name_of(model_param), start, numel, 0, 0, 0, split_of(model_param)).slices()
            self._hook_slices[key] = slices
        return slices

    def install(self) -> None:
        self.optimizer._copy_main_params_to_model_params = self.refresh

    @torch.no_grad()
    def refresh(self) -> None:
        """Replaces ``_copy_main_params_to_model_params``: one optimizer step's refresh."""
        if self.optimizer.is_stub_optimizer:
            return
        self.caster.begin_step()
        self.cast_all()
        for main, served in self._fp32:
            served.copy_(main)

    @torch.no_grad()
    def publish(self) -> None:
        """All-gather the served shards now (outside a step, e.g. after rewriting them)."""
        for chunk in self.optimizer.model_chunks:
            chunk.start_param_sync(force_sync=True)
