"""Slow, element-by-element reference of every cast, written from the rounding definitions.

It decides by comparing values (in float64, where the needed differences are exact), not by
carrying bits, so it is an independent statement of the rules in ``faircast_ds.casts``. Use it on
small tensors only: it runs a Python loop.
"""
from __future__ import annotations

import math
import struct

import numpy as np
import torch

from faircast_ds.modes import noise_key, uses_noise
from faircast_ds.noise import noise16_int

_TOP = 2.0**128  # where the "next value" after the largest bf16 sits, for rounding purposes


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
    y = v if e == 0 else float(np.float32(v) + np.float32(e))  # the fp32 sum, rounded once
    lo, hi = _neighbours(v)
    candidate = _bf16_value(nearest_bits(y))
    served = min(max(candidate, min(_bf16_value(lo), _bf16_value(hi))), max(_bf16_value(lo), _bf16_value(hi)))
    if served == 0:  # a zero is x's zero neighbour, sign included (-0.0 == 0.0 in the clamp above)
        served = _bf16_value(lo)
    if math.isinf(served) and not math.isinf(_bf16_value(nearest_bits(v))):
        served = _bf16_value(lo)
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
    """Reference of :func:`faircast_ds.casts.cast` with the same signature and semantics."""
    values = x.detach().cpu().tolist()
    out: list[int] = []
    if mode == "nearest":
        out = [nearest_bits(v) for v in values]
    elif uses_noise(mode):
        key = noise_key(mode, seed=seed, step=step, name=name)
        out = [round_up_bits(v, noise16_int(start + i, key)) for i, v in enumerate(values)]
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
