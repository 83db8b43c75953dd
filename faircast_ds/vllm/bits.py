"""What "the same bits" means between the served weights and what an engine computes with.

vLLM's CPU kernels (oneDNN, the vectorized attention and norm code) run with denormals flushed:
a weight of -0.0 reads back +0.0 and a subnormal reads back 0, and HF's matmul flushes the
products of such weights the same way, so neither changes anything the engine computes. The
check therefore compares *canonical* bits: every value below the dtype's smallest normal in
magnitude (±0 and all subnormals) counts as +0. Everything else — NaN payloads included —
must match exactly. Pure torch; no vLLM import.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def canonical(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (floating point) with ±0 and subnormals replaced by +0; other values untouched."""
    t = t.detach()
    if not t.is_floating_point():
        return t.clone()
    tiny = torch.finfo(t.dtype).tiny
    flushed = t.abs() < tiny  # NaN compares False: kept as it is
    return torch.where(flushed, torch.zeros((), dtype=t.dtype, device=t.device), t)


def bit_pattern(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` as same-width integers (flattened, contiguous, on the CPU)."""
    t = t.detach().contiguous().view(-1).cpu()
    return t.view(_BITS[t.element_size()])


def digest(t: torch.Tensor, *, canonicalize: bool = True) -> str:
    """SHA-256 of the (canonical) bit patterns, with the dtype and shape mixed in."""
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    bits = bit_pattern(canonical(t) if canonicalize else t)
    h.update(bits.numpy().tobytes())
    return h.hexdigest()


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of two same-shape tensors differ in canonical bits (the shapes must agree)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare {a.dtype}{list(a.shape)} with {b.dtype}{list(b.shape)}")
    return int((bit_pattern(canonical(a)) != bit_pattern(canonical(b))).sum())


_DTYPES = {str(d): d for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
                               torch.int16, torch.int32, torch.int64)}


def pack(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    """A tensor as (dtype, shape, raw little-endian bytes): what crosses vLLM's process boundaries intact
    (its engine process forwards tensors it received to its worker by pickling, which fails for the
    buffer-backed tensors its own decoder makes)."""
    t = t.detach().contiguous().cpu()
    return str(t.dtype), list(t.shape), bit_pattern(t).numpy().tobytes()


def unpack(packed: tuple[str, list[int], bytes] | list[Any]) -> torch.Tensor:
    dtype, shape, raw = packed
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}")
    width = torch.empty((), dtype=_DTYPES[dtype]).element_size()
    bits = torch.frombuffer(bytearray(raw), dtype=_BITS[width]) if raw else torch.empty(0, dtype=_BITS[width])
    return bits.view(_DTYPES[dtype]).reshape(shape)
