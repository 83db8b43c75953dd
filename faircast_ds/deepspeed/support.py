"""Refuse every DeepSpeed setup whose served bf16 copy we do not route through the cast.

The checks read DeepSpeed's parsed config (``DeepSpeedConfig``), so they run before the engine
builds anything: a user learns in seconds, not after a long initialize or a DeepSpeed error about
something else.
"""
from __future__ import annotations

from typing import Any, Iterator

from faircast_ds.adapter import UnsupportedSetupError

VERIFIED_DEEPSPEED = ("0.19.8",)


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


def _device(offload_cfg: Any) -> str:
    device = getattr(offload_cfg, "device", None) if offload_cfg is not None else None
    return str(getattr(device, "value", device) or "none")


def _problems(cfg: Any) -> Iterator[str]:
    import deepspeed  # here, not at import: importing deepspeed runs our engine hook, which imports us

    if deepspeed.__version__ not in VERIFIED_DEEPSPEED:
        yield (f"DeepSpeed {deepspeed.__version__} is not verified (verified: {', '.join(VERIFIED_DEEPSPEED)}); "
               "its fp32->bf16 cast sites may have moved. Install a verified version.")
        return
    if cfg.float16_config.enabled:
        yield "fp16.enabled: Fair Cast serves bf16; use \"bf16\": {\"enabled\": true} instead"
    elif not cfg.bfloat16_config.enabled:
        yield "bf16 is not enabled: set \"bf16\": {\"enabled\": true} (the served copy must be bf16)"
    if getattr(cfg, "torch_autocast_enabled", False):
        yield "torch_autocast: parameters stay fp32, there is no bf16 copy to cast"
    zero = cfg.zero_config
    for what in ("offload_param", "offload_optimizer"):
        if _device(getattr(zero, what, None)) == "nvme":
            yield f"zero_optimization.{what}.device nvme: NVMe offload casts inside the swapper, not supported"
    if getattr(getattr(zero, "offload_optimizer", None), "super_offload", False):
        yield "zero_optimization.offload_optimizer.super_offload: SuperOffload has its own cast, not supported"
    if getattr(zero, "zenflow", None) is not None:
        yield "zero_optimization.zenflow: ZenFlow has its own cast, not supported"
    if cfg.bfloat16_config.bf16_master_weights_and_grads or cfg.float16_config.fp16_master_weights_and_grads:
        yield "low-precision master weights: there is no fp32 master to cast from"
    if zero.zero_quantized_weights or zero.zero_quantized_nontrainable_weights:
        yield "zero_optimization.zero_quantized_weights: the quantized all-gather changes the served bits"
    if zero.zero_hpz_partition_size > 1:
        yield "zero_optimization.zero_hpz_partition_size > 1: hierarchical partitioning is not verified"
