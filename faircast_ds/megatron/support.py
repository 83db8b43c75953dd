"""Every Megatron-Core setup the cast does not cover, refused before anything is attached, each with
the setting that causes it (the DeepSpeed integration's ``faircast_ds.deepspeed.support`` plays the same role)."""
from __future__ import annotations

from typing import Any, Iterator

from faircast_ds.megatron import compat
from faircast_ds.megatron.layout import global_names, split_of
from faircast_ds.shard.adapter import UnsupportedSetupError


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
