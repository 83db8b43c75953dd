"""Refuse every DeepSpeed setup whose served bf16 copy we do not route through the cast.

The checks read DeepSpeed's parsed config (``DeepSpeedConfig``), so they run before the engine
builds anything: a user learns in seconds, not after a long initialize or a DeepSpeed error about
something else.
"""
from __future__ import annotations

from typing import Any, Iterator

from faircast_ds.deepspeed import compat
from faircast_ds.shard.adapter import UnsupportedSetupError


def engine_config(engine: Any) -> Any:
    """The engine's parsed DeepSpeedConfig."""
    return engine._config


def raw_config(ds_config: Any) -> dict[str, Any]:
    """The config as the user wrote it; DeepSpeed keeps unknown top-level keys such as ``fair_cast`` here."""
    parsed = getattr(ds_config, "_param_dict", None)
    return parsed if isinstance(parsed, dict) else {}


def check_supported(ds_config: Any) -> None:
    """Raise UnsupportedSetupError listing every setting Fair Cast cannot honour."""
    problems = list(_problems(ds_config))
    if problems:
        raise UnsupportedSetupError("fair_cast is enabled but this DeepSpeed setup is not supported:\n  - " +
                                    "\n  - ".join(problems))


def _problems(cfg: Any) -> Iterator[str]:
    # every release difference is read through compat (feature detection; the range is its one
    # version comparison)
    outside = compat.release_problem()
    if outside is not None:
        yield outside
        return
    precision = compat.precision(cfg)
    if precision.fp16:
        yield "fp16.enabled: Fair Cast serves bf16; use \"bf16\": {\"enabled\": true} instead"
    elif not precision.bf16:
        yield "bf16 is not enabled: set \"bf16\": {\"enabled\": true} (the served copy must be bf16)"
    if compat.bf16_optimizer_config(cfg) and not compat.bf16_optimizer_buildable():
        yield ("bf16 + zero_optimization.stage 1 + data_types.grad_accum_dtype fp32: this DeepSpeed names its DDP "
               "bf16 wrapper like BF16_Optimizer's and builds FP16_UnfusedOptimizer (no ZeRO) instead, which Fair "
               "Cast does not route; drop data_types.grad_accum_dtype (ZeRO-1 then runs DeepSpeedZeroOptimizer) "
               "or use a release without the clash (0.18.9 and later, or 0.17.x and earlier)")
    if compat.torch_autocast_enabled(cfg):
        yield "torch_autocast: parameters stay fp32, there is no bf16 copy to cast"
    zero = cfg.zero_config
    for what in ("offload_param", "offload_optimizer"):
        if compat.offload_device(getattr(zero, what, None)) == "nvme":
            yield f"zero_optimization.{what}.device nvme: NVMe offload casts inside the swapper, not supported"
    if compat.super_offload_enabled(zero):
        yield "zero_optimization.offload_optimizer.super_offload: SuperOffload has its own cast, not supported"
    if compat.zenflow_enabled(zero):
        yield "zero_optimization.zenflow: ZenFlow has its own cast, not supported"
    if precision.low_precision_masters:
        yield "low-precision master weights: there is no fp32 master to cast from"
    if zero.zero_quantized_weights or zero.zero_quantized_nontrainable_weights:
        yield "zero_optimization.zero_quantized_weights: the quantized all-gather changes the served bits"
    if zero.zero_hpz_partition_size > 1:
        yield "zero_optimization.zero_hpz_partition_size > 1: hierarchical partitioning is not verified"
