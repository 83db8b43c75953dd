"""Pick and install the adapter for an engine's optimizer class."""
from __future__ import annotations

from typing import Any

from faircast_ds.adapter import Adapter, UnsupportedSetupError
from faircast_ds.shard_caster import ShardCaster


def _adapters() -> dict[type, type[Adapter]]:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from faircast_ds.deepspeed.adapters.bf16 import BF16OptimizerAdapter
    from faircast_ds.deepspeed.adapters.zero3 import Zero3Adapter
    from faircast_ds.deepspeed.adapters.zero12 import Zero12Adapter

    return {DeepSpeedZeroOptimizer_Stage3: Zero3Adapter, DeepSpeedZeroOptimizer: Zero12Adapter,
            BF16_Optimizer: BF16OptimizerAdapter}


_HINTS = {
    "FP16_Optimizer": "ZeRO stage 0 (bf16 data parallel without ZeRO) keeps its fp32 master in FP16_Optimizer, "
                      "which is not routed through the cast; use ZeRO stage 1, 2 or 3",
    "FP16_UnfusedOptimizer": "ZeRO stage 0 is not routed through the cast; use ZeRO stage 1, 2 or 3",
    "MiCS_Optimizer": "MiCS partitions differently and is not verified",
}


def adapter_class(optimizer: Any) -> type[Adapter]:
    """The adapter for an optimizer's exact class (a subclass such as MiCS or SuperOffload may cast
    elsewhere); UnsupportedSetupError names the class otherwise."""
    table = _adapters()
    cls = table.get(type(optimizer))
    if cls is None:
        known = ", ".join(c.__name__ for c in table)
        name = type(optimizer).__name__
        hint = f": {_HINTS[name]}" if name in _HINTS else ""
        raise UnsupportedSetupError(f"fair_cast: optimizer class {name} is not supported{hint} (supported: {known})")
    return cls


def make_adapter(engine: Any, caster: ShardCaster) -> Adapter:
    """The adapter for the engine's optimizer (not installed yet)."""
    if engine.optimizer is None:
        raise UnsupportedSetupError("fair_cast: the engine has no optimizer; Fair Cast replaces the cast that "
                                    "follows the optimizer step, so it needs a training engine")
    return adapter_class(engine.optimizer)(engine.optimizer, caster, engine.param_names)
