"""One adapter per DeepSpeed optimizer class. Only this package touches DeepSpeed internals.

``adapter_for(engine, caster)`` checks that the engine's setup is one we handle, picks the adapter
for the engine's optimizer class and installs it. Anything we do not handle raises
``UnsupportedSetupError`` naming the setting: Fair Cast never silently degrades to round-to-nearest.
"""
from __future__ import annotations

from faircast_ds.adapters.base import Adapter, UnsupportedSetupError
from faircast_ds.adapters.registry import adapter_for

__all__ = ["Adapter", "UnsupportedSetupError", "adapter_for"]
