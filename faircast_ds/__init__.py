"""faircast-ds: unbiased fp32 -> bf16 casts for DeepSpeed ZeRO's served weights.

The public API is a handful of names. They are loaded lazily so that the
interpreter-start hook (``faircast_ds.deepspeed.autoload``) costs nothing for programs
that never import DeepSpeed.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "cast": ("faircast_ds.casts", "cast"),
    "cast_into": ("faircast_ds.casts", "cast_into"),
    "cast_reference": ("faircast_ds.reference", "cast_reference"),
    "MODES": ("faircast_ds.casts", "MODES"),
    "FairCastConfig": ("faircast_ds.config", "FairCastConfig"),
    "FairCastConfigError": ("faircast_ds.config", "FairCastConfigError"),
    "install": ("faircast_ds.deepspeed.engine", "install"),
    "attach": ("faircast_ds.deepspeed.engine", "attach"),
    "get_fair_cast": ("faircast_ds.handle", "get_fair_cast"),
    "FairCast": ("faircast_ds.handle", "FairCast"),
    "UnsupportedSetupError": ("faircast_ds.adapter", "UnsupportedSetupError"),
    "served_weights": ("faircast_ds.export", "served_weights"),
    "save_hf": ("faircast_ds.export", "save_hf"),
    "WeightSender": ("faircast_ds.export", "WeightSender"),
    "WeightReceiver": ("faircast_ds.export", "WeightReceiver"),
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'faircast_ds' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value
