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

from faircast_ds.adapter import Adapter, Setup, UnsupportedSetupError
from faircast_ds.megatron import compat
from faircast_ds.megatron.layout import global_names, split_of
from faircast_ds.megatron.shards import ParamShard, fp32_shards, low_precision_shards
from faircast_ds.shard_caster import ShardCaster, ShardSlice

def distributed_optimizers(optimizer: Any) -> list[Any]:
    """The DistributedOptimizer instances behind ``optimizer`` (itself, or a ChainedOptimizer's)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def parameter_names(optimizer: Any) -> dict:
    """parameter -> the name of the full parameter it is (part of), the noise id: wrappers' ``module.``
    prefixes removed, pipeline stages' layer numbers made global (:func:`faircast_ds.megatron.layout.
    global_names`), so every layout names one parameter alike."""
    return global_names(optimizer.model_chunks)


def check_supported(optimizer: Any) -> None:
    """Raise UnsupportedSetupError listing every setting whose served copy we do not route."""
    problems = list(_problems(optimizer))
    if problems:
        raise UnsupportedSetupError("fair_cast is enabled but this Megatron-Core setup is not supported:\n  - " +
                                    "\n  - ".join(problems))


def _problems(optimizer: Any) -> Iterator[str]:
    from megatron.core import parallel_state
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    release = compat.release_problem()
    if release is not None:
        yield release
        return
    if type(optimizer) is not DistributedOptimizer:
        yield (f"optimizer class {type(optimizer).__name__}: only DistributedOptimizer "
               "(use_distributed_optimizer=True) is routed through the cast")
        return
    cfg, ddp = optimizer.config, optimizer.ddp_config
    if not cfg.bf16 or cfg.fp16:
        yield "the optimizer config must say bf16=True (the served copy must be bf16)"
    if cfg.use_precision_aware_optimizer or cfg.optimizer_cpu_offload:
        yield ("use_precision_aware_optimizer / optimizer_cpu_offload: the main params live in the optimizer, "
               "which writes the model params itself")
    quantized = compat.quantized_param_settings(cfg, ddp)  # the fields this release has (compat)
    if quantized:
        yield f"{', '.join(quantized)}: fp8 / fp4 parameters: the served copy is quantized, not cast"
    if compat.uses_megatron_fsdp(ddp):
        yield f"{' / '.join(compat.fsdp_fields(ddp))}: Megatron-FSDP copies main weights in its own buffer"
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_expert_model_parallel_world_size() > 1:
        yield (f"expert_model_parallel_size {parallel_state.get_expert_model_parallel_world_size()}: a rank's local "
               "expert numbers are not mapped to the model's global expert ids (the noise id), so the served bits "
               "would depend on the expert layout; use expert_model_parallel_size 1")
    yield from _split_problems(optimizer)
    yield from compat.missing_internals(optimizer)  # a release that moved what the adapter reads


def _split_problems(optimizer: Any) -> Iterator[str]:
    """Each tensor-parallel parameter whose split Megatron's attributes do not describe, and a stage whose
    global names collide (then the noise id would not name one element)."""
    try:
        global_names(optimizer.model_chunks)
    except ValueError as exc:
        yield str(exc)
    for chunk in optimizer.model_chunks:
        for name, param in chunk.named_parameters():
            try:
                split_of(param)
            except ValueError as exc:
                yield f"{name}: its tensor-parallel split is not one Fair Cast maps to the full parameter ({exc})"


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
