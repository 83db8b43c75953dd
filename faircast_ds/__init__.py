"""faircast-ds: unbiased fp32 -> bf16 casts for DeepSpeed ZeRO's served weights.

The public API is a handful of names. They are loaded lazily so that the
interpreter-start hook (``faircast_ds.deepspeed.autoload``) costs nothing for programs
that never import DeepSpeed, and importing ``faircast_ds`` imports neither DeepSpeed nor vLLM:
``ServedPush`` and ``VllmServer`` (the served weights into a ``vllm serve`` process, docs/vllm.md)
load their modules on first use.
"""
from __future__ import annotations

from faircast_ds._util import lazy

__version__ = "0.1.0"

_LAZY = {
    "cast": "faircast_ds.casting.rules",
    "cast_into": "faircast_ds.casting.rules",
    "cast_reference": "faircast_ds.casting.reference",
    "MODES": "faircast_ds.casting.modes",
    "FairCastConfig": "faircast_ds.config.section",
    "FairCastConfigError": "faircast_ds.config.section",
    "install": "faircast_ds.deepspeed.attachment",
    "attach": "faircast_ds.deepspeed.attachment",
    "get_fair_cast": "faircast_ds.shard.handle",
    "FairCast": "faircast_ds.shard.handle",
    "UnsupportedSetupError": "faircast_ds.shard.adapter",
    "served_weights": "faircast_ds.export",
    "save_hf": "faircast_ds.export",
    "WeightSender": "faircast_ds.export",
    "WeightReceiver": "faircast_ds.export",
    "ServedPush": "faircast_ds.vllm.transfer.served_push",
    "VllmServer": "faircast_ds.vllm.transfer.server",
}

__all__ = sorted(_LAZY) + ["__version__"]


__getattr__ = lazy.exports(__name__, _LAZY, globals())
