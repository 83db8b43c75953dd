"""The engine side: a vLLM worker extension (``worker_extension_cls``) that loads and reads back weights.

vLLM mixes this class into its worker; the trainer side calls its methods through
``LLM.collective_rpc("faircast_...", args=...)`` (every call is executed by each worker, in the
process that holds the model, between engine steps).

Loading goes through ``Worker.reload_weights(weights_iterator, is_checkpoint_format=True)``: the
checkpoint-format (HF-named) tensors are buffered layer by layer and each vLLM layer is rebuilt
and re-processed (on CPU: its linear weight repacked for oneDNN) once *all* of its tensors
arrived. Loading directly (``model.load_weights``) does not work on vLLM's CPU build, whose
linear layers keep no usable ``.weight`` after repacking. A vLLM layer that receives only some of
its tensors — ``q_proj`` without ``k_proj``/``v_proj`` for the fused ``qkv_proj`` — is rebuilt
with the missing part left uninitialized, so callers send whole groups
(:func:`faircast_ds.vllm.fused.packed_groups`).

Reading back asks the kernels themselves (:func:`faircast_ds.vllm.engine_weights.read_back`): a linear layer
(and the LM head) is applied to identity rows through its own ``quant_method``, an embedding is looked
up for every id, and only tensors a kernel reads directly (norm weights, biases) are read as tensors.
What comes back is what the engine computes with, canonicalized as in :mod:`faircast_ds.vllm.bits`.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from faircast_ds.vllm.bits import canonical, digest, pack, unpack
from faircast_ds.vllm.engine_weights import (
    quiet_reload,
    read_back,
    refresh_tied_heads,
    ties_head,
)


class FairCastWorkerExtension:
    """Methods vLLM adds to its worker when ``worker_extension_cls`` names this class
    (``faircast_ds.vllm.colocated.worker.FairCastWorkerExtension``)."""

    # -- what the engine holds ---------------------------------------------------------------
    def _faircast_model(self) -> torch.nn.Module:
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def faircast_describe(self) -> dict[str, Any]:
        """The model's packed (fused) modules and dtype, for the trainer side to group its pushes, and
        whether its LM head computes with the embedding (then the trainer checks it as ``lm_head.weight``)."""
        model = self._faircast_model()
        packed = {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}
        return {"packed": packed, "dtype": str(self.model_config.dtype),  # type: ignore[attr-defined]
                "architecture": type(model).__name__, "tied_head": ties_head(model)}

    # -- loading -----------------------------------------------------------------------------
    def faircast_reload(self, items: list[tuple[str, Any]]) -> dict[str, float]:
        """Load checkpoint-format tensors (HF names) in place; returns the seconds it took. A tensor may
        come packed (:func:`faircast_ds.vllm.bits.pack`), as it must across vLLM's processes."""
        began = time.perf_counter()
        items = [(n, t if isinstance(t, torch.Tensor) else unpack(t)) for n, t in items]
        with quiet_reload(), torch.inference_mode():
            self.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)  # type: ignore[attr-defined]
            refresh_tied_heads(self._faircast_model(), [n for n, _ in items])  # vLLM's reload leaves them as they were
        return {"seconds": time.perf_counter() - began, "tensors": float(len(items))}

    def faircast_transfer_last(self) -> dict[str, Any]:
        """The ``faircast`` weight-transfer engine's account of its last update (version, kind, bytes,
        ``receive_seconds``, ``loaded`` tensors, ``load_seconds`` inside vLLM's ``reload_weights``); empty
        when the backend is another or no update arrived. JSON-safe: ``vllm serve`` answers it on
        ``POST /collective_rpc``."""
        engine = getattr(self, "weight_transfer_engine", None)
        last = getattr(engine, "last", None)
        return {k: v for k, v in (last or {}).items() if isinstance(v, (int, float, str, bool))}

    # -- reading back ------------------------------------------------------------------------
    def faircast_read(self, name: str, shape: list[int]) -> tuple[str, list[int], bytes]:
        """What the kernels compute with for the HF tensor ``name`` of ``shape``, canonical, packed."""
        with torch.inference_mode():
            return pack(canonical(self._faircast_readback(name, tuple(shape))))

    def faircast_digests(self, specs: list[tuple[str, list[int]]]) -> dict[str, str]:
        """:func:`faircast_ds.vllm.bits.digest` of each read-back tensor, one at a time."""
        out = {}
        with torch.inference_mode():
            for name, shape in specs:
                try:
                    out[name] = digest(self._faircast_readback(name, tuple(shape)))
                except Exception as exc:  # noqa: BLE001 - reported per tensor, the trainer side raises
                    out[name] = f"error: {type(exc).__name__}: {exc}"
        return out

    def _faircast_readback(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return read_back(self._faircast_model(), name, shape, self.model_config.dtype)  # type: ignore[attr-defined]
