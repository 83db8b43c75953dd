"""Pick and install the adapter for an engine's optimizer class."""
from __future__ import annotations

from typing import Any

from faircast_ds.adapters.base import Adapter, UnsupportedSetupError
from faircast_ds.adapters.support import check_supported, engine_config
from faircast_ds.shard_caster import ShardCaster


def _adapters() -> dict[type, type[Adapter]]:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from faircast_ds.adapters.zero3 import Zero3Adapter

    return {DeepSpeedZeroOptimizer_Stage3: Zero3Adapter}


def adapter_for(engine: Any, caster: ShardCaster) -> Adapter:
    """Check the engine's setup, then install the adapter for its optimizer (exact class match:
    a subclass such as MiCS or SuperOffload may cast elsewhere)."""
    check_supported(engine_config(engine))
    if engine.optimizer is None:
        raise UnsupportedSetupError("fair_cast: the engine has no optimizer; Fair Cast replaces the cast that "
                                    "follows the optimizer step, so it needs a training engine")
    table = _adapters()
    cls = table.get(type(engine.optimizer))
    if cls is None:
        known = ", ".join(c.__name__ for c in table)
        raise UnsupportedSetupError(f"fair_cast: optimizer class {type(engine.optimizer).__name__} is not supported "
                                    f"(supported: {known})")
    adapter = cls(engine.optimizer, caster)
    adapter.install()
    return adapter
