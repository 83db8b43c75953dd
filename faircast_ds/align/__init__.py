"""Rounding-location alignment: the trainer rounds to bf16 where the inference engine rounds.

Public API (loaded lazily, so ``faircast_ds.align.config`` stays torch-free)::

    handle = align_model(model, engine="sglang")          # or apply_from_config(model, cfg)
    report = measure_mismatch(model, input_ids, engine="sglang")
    handle.remove()                                        # back to HF eager, bit for bit
"""
from __future__ import annotations

from faircast_ds._util import lazy

_LAZY = {
    "ENGINES": "faircast_ds.align.profiles",
    "REGIONS": "faircast_ds.align.profiles",
    "PROFILES": "faircast_ds.align.profiles",
    "EngineProfile": "faircast_ds.align.profiles",
    "get_profile": "faircast_ds.align.profiles",
    "AlignRoundingConfig": "faircast_ds.align.config",
    "align_model": "faircast_ds.align.patch",
    "AlignmentHandle": "faircast_ds.align.patch",
    "UnsupportedModelError": "faircast_ds.align.families",
    "apply_from_config": "faircast_ds.align.apply",
    "reference_logits": "faircast_ds.align.profile_forward",
    "measure_mismatch": "faircast_ds.align.meter",
    "MismatchReport": "faircast_ds.align.meter",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy.exports(__name__, _LAZY, globals())
