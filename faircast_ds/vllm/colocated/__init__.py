"""The colocated setup: a vLLM engine the trainer holds in its own job (:class:`VllmEngine`, an
in-process ``LLM`` or one vLLM spawns), loaded through a worker extension
(:mod:`faircast_ds.vllm.colocated.worker`) by :class:`WeightPush`, tensors handed over in memory; and
TRL's colocated engine synced and checked the same way (:func:`install_trl_sync`).

Importing this package does not import vLLM.
"""
from __future__ import annotations

from faircast_ds._util import lazy

_LAZY = {
    "VllmEngine": "faircast_ds.vllm.colocated.inference",
    "EngineUnavailable": "faircast_ds.vllm.colocated.inference",
    "WORKER_EXTENSION": "faircast_ds.vllm.colocated.inference",
    "WeightPush": "faircast_ds.vllm.colocated.push",
    "install_trl_sync": "faircast_ds.vllm.colocated.trl_sync",
    "TrlReloadSync": "faircast_ds.vllm.colocated.trl_sync",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy.exports(__name__, _LAZY, globals())
