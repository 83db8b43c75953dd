"""Pick and install the adapter for an engine's optimizer class."""
from __future__ import annotations

from typing import Any

from faircast_ds.shard.adapter import Adapter, UnsupportedSetupError
from faircast_ds.shard.caster import ShardCaster


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


def will_train(optimizer: Any, ds_config: Any) -> bool:
    """Whether ``deepspeed.initialize`` is about to build a training optimizer: a client optimizer (or
    callable) was passed, or the config names one (DeepSpeed's own test, before the engine exists)."""
    return bool(optimizer) or bool(getattr(ds_config, "optimizer_name", None))


def stand_in(engine: Any) -> str | None:
    """Why a built engine has no training optimizer (a reference, evaluation or inference engine),
    or None when it has one. Such an engine never steps, so nothing refreshes its bf16 weights from an
    fp32 master: there is no cast to replace, and it is left as DeepSpeed builds it.

    Without an optimizer DeepSpeed still puts something in ``engine.optimizer``: ZeRO-3's
    ``DeepSpeedZeRoOffload`` (parameter partitioning only), or a ``BF16_Optimizer`` around a
    ``DummyOptim`` (bf16 without ZeRO); in both cases ``engine.basic_optimizer`` stays None.
    """
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:
        return "no optimizer"
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    if isinstance(optimizer, DeepSpeedZeRoOffload):
        return "DeepSpeedZeRoOffload: ZeRO-3 parameter partitioning without an optimizer"
    try:
        from deepspeed.runtime.utils import DummyOptim
    except ImportError:  # pragma: no cover - every supported release has it
        DummyOptim = ()  # type: ignore[assignment,misc]
    if DummyOptim and isinstance(getattr(optimizer, "optimizer", None), DummyOptim):
        return f"{type(optimizer).__name__} around DeepSpeed's DummyOptim (no optimizer was given)"
    if getattr(engine, "basic_optimizer", optimizer) is None and not getattr(engine, "client_optimizer", None):
        return f"{type(optimizer).__name__} without a basic optimizer (no optimizer was given)"
    return None


def make_adapter(engine: Any, caster: ShardCaster) -> Adapter:
    """The adapter for the engine's optimizer (not installed yet)."""
    if engine.optimizer is None:
        raise UnsupportedSetupError("fair_cast: the engine has no optimizer; Fair Cast replaces the cast that "
                                    "follows the optimizer step, so it needs a training engine")
    return adapter_class(engine.optimizer)(engine.optimizer, caster, engine.param_names)
