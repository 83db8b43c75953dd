"""Refuse, at initialize, every DeepSpeed setup whose served bf16 copy we do not route through the cast."""
from __future__ import annotations

from typing import Any

import deepspeed

from faircast_ds.adapters.base import UnsupportedSetupError

VERIFIED_DEEPSPEED = ("0.19.8",)


def raw_config(engine: Any) -> dict[str, Any]:
    """The engine's config as the user wrote it (DeepSpeed keeps unknown top-level keys here)."""
    parsed = getattr(getattr(engine, "_config", None), "_param_dict", None)
    if isinstance(parsed, dict):
        return parsed
    return engine.config if isinstance(engine.config, dict) else {}


def check_engine_supported(engine: Any) -> None:
    """Raise UnsupportedSetupError naming the first setting Fair Cast cannot honour."""
    problems = list(_problems(engine))
    if problems:
        raise UnsupportedSetupError("fair_cast is enabled but this DeepSpeed setup is not supported:\n  - " +
                                    "\n  - ".join(problems))


def _offload_device(cfg: Any) -> str:
    device = getattr(cfg, "device", None) if cfg is not None else None
    return str(getattr(device, "value", device) or "none")


def _problems(engine: Any):
    if deepspeed.__version__ not in VERIFIED_DEEPSPEED:
        yield (f"DeepSpeed {deepspeed.__version__} is not verified (verified: {', '.join(VERIFIED_DEEPSPEED)}); "
               "its fp32->bf16 cast sites may have moved. Install a verified version.")
        return
    if engine.optimizer is None:
        yield "no optimizer: Fair Cast replaces the cast after the optimizer step, so it needs a training engine"
    if engine.fp16_enabled():
        yield "fp16.enabled: Fair Cast serves bf16; use \"bf16\": {\"enabled\": true}"
    elif not engine.bfloat16_enabled():
        yield "bf16 is not enabled: set \"bf16\": {\"enabled\": true} (the served copy must be bf16)"
    if engine.torch_autocast_enabled():
        yield "torch_autocast: parameters stay fp32, there is no bf16 copy to cast"
    stage = engine.zero_optimization_stage()
    if stage != 3:
        yield (f"zero_optimization.stage {stage}: only ZeRO stage 3 is supported in this release "
               "(stages 0-2 and BF16_Optimizer are not yet routed through the cast)")
    for what, cfg in (("offload_param", engine.zero_offload_param()),
                      ("offload_optimizer", engine.zero_offload_optimizer())):
        if _offload_device(cfg) == "nvme":
            yield f"zero_optimization.{what}.device nvme: NVMe offload casts inside the swapper, not supported"
    if engine.super_offload():
        yield "zero_optimization.offload_optimizer.super_offload: SuperOffload has its own cast, not supported"
    if engine.zenflow_config() is not None:
        yield "zero_optimization.zenflow: ZenFlow has its own cast, not supported"
    if engine.bf16_master_weights_and_gradients() or engine.fp16_master_weights_and_gradients():
        yield "low-precision master weights: there is no fp32 master to cast from"
    if engine.zero_quantized_weights() or engine.zero_quantized_nontrainable_weights():
        yield "zero_quantized_weights: the quantized all-gather changes the served bits after our cast"
    if engine.zero_hpz_partition_size() > 1:
        yield "zero_hpz_partition_size > 1: hierarchical partitioning is not verified"
