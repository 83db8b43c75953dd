"""One adapter per DeepSpeed optimizer class (``zero3``, ``zero12``, ``bf16``); ``registry`` picks one.

Anything we do not handle raises ``UnsupportedSetupError`` naming the setting: Fair Cast never
silently degrades to round-to-nearest.
"""
from __future__ import annotations

from faircast_ds.deepspeed.adapters.registry import adapter_class, make_adapter

__all__ = ["adapter_class", "make_adapter"]
