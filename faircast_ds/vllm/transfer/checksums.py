"""Checksums of the bits an engine computes with, on both sides of vLLM's ``/weight_checker``.

Engine side (:func:`kernel_checksums`, installed over ``Worker.compute_weight_checksums`` by the
plugin, :func:`install_checksums`): vLLM hashes each parameter's storage, but on CPU the oneDNN
linear kernels repack their weights and leave ``.weight`` empty (every linear layer then hashes to
SHA-256 of no bytes), and the CPU LM head computes with a packed copy. So every parameter is hashed
from what its kernel computes with: a linear layer (and the LM head) is applied through its own
``quant_method`` to identity rows, an embedding is looked up for every id, and the rest (norm
weights, biases) are read as tensors; the bits are canonical (:mod:`faircast_ds.vllm.bits`: ±0 and
subnormals count as +0, what the kernels flush them to). The keys stay vLLM's
(``dp0:pp0:pcp0:tp0:`` + the vLLM parameter name) so ``action="compare"`` works unchanged.

Trainer side (:func:`served_checksums`): the same checksums from the served weights alone, with no
vLLM code — fused vLLM layers are the concatenation of their HF parts (``qkv_proj`` = q, k, v;
``gate_up_proj`` = gate, up) along the output dimension.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping

import torch

from faircast_ds.vllm.bits import bit_pattern, canonical

# how vLLM fuses HF projections (its models' packed_modules_mapping for Llama/Qwen2/Qwen3), restated here
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PROBE_ROWS = 1024  # identity rows per kernel call when reading a linear weight back


def checksum(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's canonical bits (contiguous, little-endian), what both sides hash."""
    return hashlib.sha256(bit_pattern(canonical(t)).numpy().tobytes()).hexdigest()


# ------------------------------------------------------------------------------ trainer side

def served_checksums(served: Iterable[tuple[str, torch.Tensor]], prefix: str = "dp0:pp0:pcp0:tp0:",
                     *, tied: bool = False) -> dict[str, str]:
    """vLLM-named checksums of served HF-named tensors (bf16 bits as the trainer serves them). ``served``
    may be a ZeRO-3 walk (each tensor valid only until the next): fused parts are copied until their
    group is complete. ``tied``: the engine has no separate ``lm_head.weight`` (tied embeddings)."""
    out: dict[str, str] = {}
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in served:
        path, _, attr = name.rpartition(".")
        parent, _, leaf = path.rpartition(".")
        fused = next((f for f, parts in FUSED.items() if leaf in parts), None)
        if fused is None:
            if not (tied and name == "lm_head.weight"):
                out[prefix + name] = checksum(tensor.detach().cpu())
            continue
        key = f"{parent}.{fused}.{attr}"
        parts = waiting.setdefault(key, {})
        parts[leaf] = tensor.detach().cpu().clone()
        if len(parts) == len(FUSED[fused]):
            out[prefix + key] = checksum(torch.cat([parts[p] for p in FUSED[fused]], dim=0))
            del waiting[key]
    if waiting:
        raise ValueError(f"fused layers with missing parts: {sorted(waiting)[:5]}")
    return out


def compare(engine: Mapping[str, str], served: Mapping[str, str]) -> list[str]:
    """Names whose checksums differ or that only one side has."""
    return sorted(k for k in engine.keys() | served.keys() if engine.get(k) != served.get(k))


# ------------------------------------------------------------------------------ engine side

def kernel_tensors(model: torch.nn.Module, dtype: torch.dtype) -> Iterable[tuple[str, torch.Tensor]]:
    """(vLLM parameter name, the tensor its kernel computes with) for every parameter of ``model``."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    modules = dict(model.named_modules())
    with torch.inference_mode():
        for name, param in model.named_parameters():
            path, _, attr = name.rpartition(".")
            module = modules.get(path)
            # an (unsharded) vocabulary the engine padded is cut back to the checkpoint's rows
            vocab = getattr(module, "org_vocab_size", None)
            if attr == "weight" and isinstance(module, (LinearBase, ParallelLMHead)):
                t = _linear_readback(module, dtype)
                yield name, t[:vocab] if isinstance(module, ParallelLMHead) and vocab else t
            elif attr == "weight" and isinstance(module, VocabParallelEmbedding):
                yield name, module(torch.arange(vocab or param.shape[0], device=param.device))
            else:
                t = param.detach()
                yield name, t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


def _linear_readback(module: Any, dtype: torch.dtype) -> torch.Tensor:
    from vllm.model_executor.layers.linear import LinearBase

    width = module.input_size_per_partition if isinstance(module, LinearBase) else module.embedding_dim
    device = next((t.device for t in module.parameters()), torch.device("cpu"))
    cols = []
    for start in range(0, width, _PROBE_ROWS):
        rows = min(_PROBE_ROWS, width - start)
        eye = torch.zeros(rows, width, dtype=dtype, device=device)
        eye[:, start:start + rows] = torch.eye(rows, dtype=dtype, device=device)
        cols.append(module.quant_method.apply(module, eye))  # [rows, out]: W^T's rows, no bias
    return torch.cat(cols).t().contiguous()


def kernel_checksums(worker: Any) -> dict[str, str]:
    """``Worker.compute_weight_checksums`` as the kernels compute: vLLM's keys, canonical kernel bits."""
    prefix = worker._weight_checksum_prefix()
    model = worker.model_runner.get_model()
    dtype = worker.model_config.dtype
    return {prefix + name: checksum(t.cpu()) for name, t in kernel_tensors(model, dtype)}


def install_checksums() -> None:
    """Make vLLM's worker answer ``compute_weight_checksums`` (``/weight_checker``) with
    :func:`kernel_checksums`. Idempotent (vLLM loads its plugins once per process, possibly more)."""
    from vllm.v1.worker.gpu_worker import Worker

    if getattr(Worker.compute_weight_checksums, "_faircast", False):
        return

    def compute_weight_checksums(self: Any) -> dict[str, str]:
        return kernel_checksums(self)

    compute_weight_checksums._faircast = True  # type: ignore[attr-defined]
    compute_weight_checksums.__doc__ = kernel_checksums.__doc__
    Worker.compute_weight_checksums = compute_weight_checksums
