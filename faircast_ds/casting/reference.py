"""Slow, element-by-element reference of every cast, written from the rounding definitions.

It decides by comparing values (in float64, where the needed differences are exact), not by
carrying bits, so it is an independent statement of the rules in ``faircast_ds.casting.rules``. The noise
is restated here too, from the specification in ``faircast_ds.casting.noise``'s docstring (and the streams
of ``faircast_ds.casting.modes``'s), rather than imported: this module imports nothing from faircast_ds,
so a test comparing a fast path with it compares two codes written apart. Use it on small tensors
only: it runs a Python loop.
"""
from __future__ import annotations

import math
import struct

import numpy as np
import torch

_TOP = 2.0**128  # where the "next value" after the largest bf16 sits, for rounding purposes

# ---- the noise, from the specification (noise.py's docstring), one plain step at a time ----------

_MOD = 2**32
# mix32 as its stages: (right shift to XOR in, multiplier applied after it; None for the last XOR)
_MIX_STAGES = ((16, 0x21F0AAAD), (15, 0x735A2D97), (15, None))
# the noise modes: stream tag, and whether the key follows the step (dither keeps step 0)
_STREAMS = {"stochastic": (1, True), "dither": (2, False)}


def _mix(word: int) -> int:
    for shift, multiplier in _MIX_STAGES:
        word ^= word // 2**shift
        if multiplier is not None:
            word = word * multiplier % _MOD
    return word


def _fnv1a(text: str) -> int:
    value = 2166136261  # FNV-1a's 32-bit offset basis; its prime is 16777619
    for byte in text.encode("utf-8"):
        value = (value ^ byte) * 16777619 % _MOD
    return value


def _words(n: int) -> tuple[int, int]:
    """(low, high) 32-bit words of a non-negative integer below 2^64."""
    return n % _MOD, n // _MOD % _MOD


def stream_chain(mode: str, *, seed: int, step: int, name: str) -> int:
    """The key of a noise mode's stream: mix32 chained over the name id, the stream tag and the
    32-bit words of the seed and of the step (step 0 for dither), starting from 0."""
    if seed < 0 or step < 0:
        raise ValueError(f"seed and step must be non-negative, got seed={seed}, step={step}")
    stream, per_step = _STREAMS[mode]
    chain = 0
    for word in (_fnv1a(name), stream, *_words(seed), *_words(step if per_step else 0)):
        chain = _mix(chain ^ word)
    return chain


def element_noise(chain: int, index: int) -> int:
    """The 16 noise bits of element ``index`` (of the whole parameter) under a stream's key."""
    low, high = _words(index)
    return _mix(_mix(low ^ chain) ^ high) // 2**16


def _f32_bits(v: float) -> int:
    return struct.unpack(">I", struct.pack(">f", v))[0]


def _bf16_value(bits16: int) -> float:
    return struct.unpack(">f", struct.pack(">I", bits16 << 16))[0]


def _neighbours(v: float) -> tuple[int, int]:
    """Bit patterns (sign included) of the bf16 values just below and just above |v| in magnitude."""
    lo = _f32_bits(v) >> 16
    return lo, lo + 1


def _magnitude(bits16: int) -> float:
    v = abs(_bf16_value(bits16 & 0x7FFF))
    return _TOP if math.isinf(v) else v


def nearest_bits(v: float) -> int:
    """Round-to-nearest-even, decided by distances. NaN gives a NaN (its bits are not specified)."""
    if math.isnan(v):
        return 0x7FC0
    if math.isinf(v):
        return _f32_bits(v) >> 16
    lo, hi = _neighbours(v)
    a, m_lo, m_hi = abs(v), _magnitude(lo), _magnitude(hi)
    if a == m_lo:
        return lo
    d_lo, d_hi = a - m_lo, m_hi - a
    if d_lo < d_hi or (d_lo == d_hi and lo % 2 == 0):
        return lo
    return hi


def round_up_bits(v: float, noise: int) -> int:
    """Round |v| up to the next bf16 iff noise/65536 >= 1 - p, p = the position of |v| between its
    neighbours; this makes P(up) = p, so E[result] = v."""
    if math.isnan(v):
        return (_f32_bits(v) >> 16) | 0x0040
    if math.isinf(v):
        return _f32_bits(v) >> 16
    lo, hi = _neighbours(v)
    a, m_lo, m_hi = abs(v), _magnitude(lo), _magnitude(hi)
    if a == m_lo:
        return lo
    p = (a - m_lo) / (m_hi - m_lo)
    up = noise / 65536.0 >= 1.0 - p
    if up and math.isinf(_bf16_value(hi)) and not math.isinf(_bf16_value(nearest_bits(v))):
        return lo  # never create an Inf that round-to-nearest would not
    return hi if up else lo


def error_feedback_element(v: float, e: float) -> tuple[int, float]:
    """One element of error feedback: (served bits, new residual)."""
    if math.isnan(v):
        return (_f32_bits(v) >> 16) | 0x0040, 0.0
    if math.isinf(v):
        return _f32_bits(v) >> 16, 0.0
    with np.errstate(over="ignore"):  # a sum past the fp32 range is Inf, as the rules expect
        y = v if e == 0 else float(np.float32(v) + np.float32(e))  # the fp32 sum, rounded once
    lo, hi = _neighbours(v)
    candidate = _bf16_value(nearest_bits(y))
    served = min(max(candidate, min(_bf16_value(lo), _bf16_value(hi))), max(_bf16_value(lo), _bf16_value(hi)))
    if served == 0:  # a zero is x's zero neighbour, sign included (-0.0 == 0.0 in the clamp above)
        served = _bf16_value(lo)
    if math.isinf(served) and not math.isinf(_bf16_value(nearest_bits(v))):
        served = _bf16_value(lo)
    with np.errstate(over="ignore"):
        r = float(np.float32(y) - np.float32(served)) if math.isfinite(y) else math.inf
    bits = _f32_bits(served) >> 16
    return bits, (r if math.isfinite(r) else 0.0)


def cast_reference(x: torch.Tensor,
                   mode: str,
                   *,
                   seed: int,
                   step: int,
                   name: str,
                   start: int = 0,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of :func:`faircast_ds.casting.rules.cast` with the same signature and semantics."""
    values = x.detach().cpu().tolist()
    out: list[int] = []
    if mode == "nearest":
        out = [nearest_bits(v) for v in values]
    elif mode in _STREAMS:
        if start < 0:
            raise ValueError(f"start must be non-negative, got {start}")
        chain = stream_chain(mode, seed=seed, step=step, name=name)
        out = [round_up_bits(v, element_noise(chain, start + i)) for i, v in enumerate(values)]
    elif mode == "error_feedback":
        if residual is None:
            raise ValueError("mode 'error_feedback' needs a residual")
        new_res = []
        for v, e in zip(values, residual.detach().cpu().tolist()):
            bits, r = error_feedback_element(v, e)
            out.append(bits)
            new_res.append(r)
        residual.copy_(torch.tensor(new_res, dtype=torch.float32))
    else:
        raise ValueError(f"unknown mode {mode!r}")
    signed = [b - 0x10000 if b >= 0x8000 else b for b in out]
    return torch.tensor(signed, dtype=torch.int16).view(torch.bfloat16).to(x.device)
