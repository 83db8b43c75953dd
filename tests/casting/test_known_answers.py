"""Known answers: the noise and every cast pinned by values that no product code computed.

The expected values below were generated once by ``spec_*`` in this file, an implementation of the
specification in the docstrings of faircast_ds/casting/noise.py (FNV-1a name id, mix32, the key chain,
noise16), faircast_ds/casting/modes.py (which stream and step each mode hashes) and faircast_ds/casting/rules.py
(each mode's rule, error feedback's residual update), written from those docstrings alone: plain
Python integers, ``struct`` and ``fractions``, nothing imported from faircast_ds. Rounding is
decided on exact rational values (``Fraction``), not by carrying bits as the product does.

``test_the_oracle_still_yields_the_literals`` recomputes every literal with that code, so a reader
can check them and regenerate them: ``python3 tests/casting/test_known_answers.py`` prints the block.
The product tests then compare faircast_ds.casting.noise, faircast_ds.casting.rules.cast, the fused CPU kernel,
the Triton kernel (in its CPU interpreter) and the ShardCaster on a parameter slice at an offset
with the literals, bit for bit.
"""
from __future__ import annotations

import json
import math
import os
import platform
import struct
import subprocess
import sys
import textwrap
from fractions import Fraction
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# ==== the independent implementation (the specification, restated; imports nothing from faircast_ds)

WORD = 1 << 32


def spec_mix32(x: int) -> int:
    """noise.py's mix32 on one 32-bit word."""
    x %= WORD
    x ^= x >> 16
    x = (x * 0x21F0AAAD) % WORD
    x ^= x >> 15
    x = (x * 0x735A2D97) % WORD
    x ^= x >> 15
    return x


def spec_name_id(name: str) -> int:
    """FNV-1a, 32 bits, of the UTF-8 bytes."""
    h = 0x811C9DC5
    for b in name.encode("utf-8"):
        h = ((h ^ b) * 0x01000193) % WORD
    return h


def spec_key(name: str, stream: int, seed: int, step: int) -> int:
    """The mix32 chain over (name_id, stream, seed_lo, seed_hi, step_lo, step_hi), from 0."""
    running = 0
    for word in (spec_name_id(name), stream, seed % WORD, (seed >> 32) % WORD, step % WORD, (step >> 32) % WORD):
        running = spec_mix32(running ^ word)
    return running


def spec_noise16(index: int, key: int) -> int:
    h = spec_mix32(spec_mix32((index % WORD) ^ key) ^ (index >> 32))
    return h >> 16


# modes.py: stochastic hashes stream 1 at the step, dither stream 2 at step 0
SPEC_STREAM = {"stochastic": (1, True), "dither": (2, False)}


def spec_mode_key(mode: str, name: str, seed: int, step: int) -> int:
    stream, per_step = SPEC_STREAM[mode]
    return spec_key(name, stream, seed, step if per_step else 0)


# ---- floating point formats, on exact values ----------------------------------------------------

INF = math.inf


class Fmt:
    """A binary IEEE format: sign, ``ebits`` exponent bits (bias 2^(ebits-1) - 1), ``mbits`` fraction bits."""

    def __init__(self, ebits: int, mbits: int):
        self.ebits, self.mbits = ebits, mbits
        self.bias = (1 << (ebits - 1)) - 1
        self.emin = 1 - self.bias
        self.emax = self.bias
        self.overflow = Fraction(2) ** (self.emax + 1)  # a rounded magnitude this large is Inf

    def decode(self, bits: int) -> tuple[int, Fraction | float]:
        """(sign, magnitude): magnitude a Fraction, INF, or NaN (math.nan)."""
        sign = bits >> (self.ebits + self.mbits)
        field = (bits >> self.mbits) & ((1 << self.ebits) - 1)
        frac = bits & ((1 << self.mbits) - 1)
        if field == (1 << self.ebits) - 1:
            return sign, (INF if frac == 0 else math.nan)
        if field == 0:
            return sign, Fraction(frac) * Fraction(2) ** (self.emin - self.mbits)
        return sign, (Fraction(1 << self.mbits) + frac) * Fraction(2) ** (field - self.bias - self.mbits)

    def encode(self, sign: int, mag: Fraction | float) -> int:
        top = sign << (self.ebits + self.mbits)
        if mag == INF:
            return top | (((1 << self.ebits) - 1) << self.mbits)
        if mag == 0:
            return top
        e = max(floor_log2(mag), self.emin)
        units = mag / Fraction(2) ** (e - self.mbits)
        assert units.denominator == 1, "not representable"
        if units < (1 << self.mbits):  # subnormal
            assert e == self.emin
            return top | int(units)
        return top | ((e + self.bias) << self.mbits) | (int(units) - (1 << self.mbits))

    def spacing(self, mag: Fraction) -> Fraction:
        """The distance between neighbouring values in the binade of ``mag`` (subnormals: the smallest)."""
        e = self.emin if mag == 0 else max(floor_log2(mag), self.emin)
        return Fraction(2) ** (e - self.mbits)

    def round_nearest_even(self, mag: Fraction) -> Fraction | float:
        q = mag / self.spacing(mag)
        n = math.floor(q)
        rest = q - n
        if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2 == 1):
            n += 1
        out = n * self.spacing(mag)
        return INF if out >= self.overflow else out

    def truncate(self, mag: Fraction) -> Fraction:
        return math.floor(mag / self.spacing(mag)) * self.spacing(mag)


def floor_log2(v: Fraction) -> int:
    e = v.numerator.bit_length() - v.denominator.bit_length()
    while Fraction(2) ** e > v:
        e -= 1
    while Fraction(2) ** (e + 1) <= v:
        e += 1
    return e


FP32 = Fmt(8, 23)
BF16 = Fmt(8, 7)


def signed(sign: int, mag) -> Fraction | float:
    return -mag if sign else mag


def unsign(v) -> tuple[int, Fraction | float]:
    """A nonzero signed value back to (sign, magnitude); zeros are handled by the callers."""
    return (1, -v) if v < 0 else (0, v)


def fp32_round(v: Fraction) -> tuple[int, Fraction | float]:
    """fp32 round-to-nearest-even of an exact nonzero-or-zero value; an exact zero is +0."""
    if v == 0:
        return 0, Fraction(0)
    sign, mag = unsign(v)
    return sign, FP32.round_nearest_even(mag)


def neighbours(sign: int, mag: Fraction) -> tuple[Fraction, Fraction | float]:
    """(lo, hi) magnitudes: |x| truncated to bf16, and one bf16 step further from zero."""
    lo = BF16.truncate(mag)
    hi = lo + BF16.spacing(lo)
    return lo, (INF if hi >= BF16.overflow else hi)


def spec_nearest(bits: int) -> int | None:
    """bf16 bits of round-to-nearest-even; None for a NaN (its bits are left open)."""
    sign, mag = FP32.decode(bits)
    if isinstance(mag, float) and math.isnan(mag):
        return None
    if mag == INF:
        return BF16.encode(sign, INF)
    return BF16.encode(sign, BF16.round_nearest_even(mag))


def spec_noisy(bits: int, noise: int) -> int:
    """stochastic / dither: hi iff (position of |x| between lo and hi) + noise/2^16 >= 1."""
    sign, mag = FP32.decode(bits)
    if isinstance(mag, float) and math.isnan(mag):
        return (bits >> 16) | 0x0040
    if mag == INF:
        return BF16.encode(sign, INF)
    lo, hi = neighbours(sign, mag)
    position = (mag - lo) / BF16.spacing(lo)  # in [0, 1), a multiple of 2^-16 for an fp32 value
    up = position + Fraction(noise, 1 << 16) >= 1
    if up and hi == INF and BF16.round_nearest_even(mag) != INF:
        up = False
    return BF16.encode(sign, hi if up else lo)


def spec_error_feedback(bits: int, res_bits: int) -> tuple[int, int]:
    """(served bf16 bits, new residual fp32 bits)."""
    sign, mag = FP32.decode(bits)
    if isinstance(mag, float) and math.isnan(mag):
        return (bits >> 16) | 0x0040, 0
    if mag == INF:
        return BF16.encode(sign, INF), 0
    esign, emag = FP32.decode(res_bits)
    assert not isinstance(emag, float), "the residual vectors are finite"
    if emag == 0:
        ysign, ymag = sign, mag
    else:
        ysign, ymag = fp32_round(signed(sign, mag) + signed(esign, emag))
    lo, hi = neighbours(sign, mag)
    lo_v, hi_v = signed(sign, lo), signed(sign, hi)
    candidate = signed(ysign, BF16.round_nearest_even(ymag) if ymag != INF else INF)
    served = min(max(candidate, min(lo_v, hi_v)), max(lo_v, hi_v))
    if served == 0 or (abs(served) == INF and BF16.round_nearest_even(mag) != INF):
        served_sign, served_mag = sign, lo
    else:
        served_sign, served_mag = unsign(served)
    if ymag == INF or served_mag == INF:
        new_res = 0
    else:
        rsign, rmag = fp32_round(signed(ysign, ymag) - signed(served_sign, served_mag))
        new_res = 0 if rmag == INF else FP32.encode(rsign, rmag)
    return BF16.encode(served_sign, served_mag), new_res


def spec_cast(mode: str, xs: list[int], *, seed: int, step: int, name: str, start: int,
              residual: list[int] | None = None) -> tuple[list[int | None], list[int] | None]:
    if mode == "nearest":
        return [spec_nearest(b) for b in xs], None
    if mode == "error_feedback":
        pairs = [spec_error_feedback(b, e) for b, e in zip(xs, residual)]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    key = spec_mode_key(mode, name, seed, step)
    return [spec_noisy(b, spec_noise16(start + k, key)) for k, b in enumerate(xs)], None


# ==== the fixed inputs ================================================================================

X_BITS = [  # fp32 bit patterns
    0x00000000, 0x80000000,                                      # +0, -0
    0x00000001, 0x80000001, 0x0000FFFF, 0x00008000, 0x00018000,  # fp32 subnormals (ties included)
    0x807FFFFF, 0x00012345, 0x80408001,
    0x00400000, 0x00410000, 0x007F8000, 0x00800000, 0x80800001,  # bf16 subnormal range and its edge
    0x3F800000, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F800001,  # around 1 (exact, ties, just above)
    0xBF80C000, 0x3DCCCCCD, 0xC0490FDB, 0xBC23D70A, 0x42F6E979,  # negatives and ordinary values
    0x7F7F0000, 0xFF7F0000, 0x7F7F0001, 0x7F7F7FFF, 0xFF7F7FFF,  # the overflow edge: max bf16, just
    0x7F7F8000, 0xFF7F8000, 0x7F7F8001, 0x7F7FFFFF, 0xFF7FFFFF,  # below / at / above RN's Inf boundary
    0x7F7EFFFF,
    0x7F800000, 0xFF800000,                                      # +-Inf
    0x7F800001, 0xFF800001, 0x7F80FFFF,                          # NaN, payload only in the low 16 bits
    0x7FC00000, 0xFFC00000, 0x7FFF0000, 0x7F810000, 0xFFFFFFFF,  # NaN, payload in the high bits
]

E_BITS = [  # error feedback's incoming residual, one per input (fp32 patterns, all finite)
    0x00000000, 0x00000000,
    0x00000000, 0x00000001, 0x80000001, 0x00000000, 0x00008000,
    0x00000001, 0x80000000, 0x00400000,
    0x80010000, 0x00000000, 0x00000000, 0x80000001, 0x00000000,
    0xBB000000, 0x3B800000, 0x3C400000, 0x00000000, 0x3A000000,  # 1 - a quarter spacing, 3 spacings...
    0xBB400000, 0x3C000000, 0x3D000000, 0xB5000000, 0xC1200000,
    0x7F7F0000, 0x7E000000, 0xFE800000, 0x7B000000, 0x00000000,  # +max bf16 overflows the sum
    0x00000000, 0x7F000000, 0xFB000000, 0x3F800000, 0x80000000,
    0x7F7FFFFF,
    0x3F800000, 0x3F800000,
    0x3F800000, 0x00000000, 0x3F800000,
    0x00000000, 0x3F800000, 0x00000000, 0x3F800000, 0x00000000,
]
assert len(E_BITS) == len(X_BITS)

# (name, seed, step, start): the element index crosses 2^32 in the second case and its high word is
# large in the third; seeds and steps past 2^32 exercise every word of the key.
CASES = {
    "small": ("blocks.0.attn.w", 7, 3, 0),
    "wide": ("layer.é", 2**40 + 3, 2**33 + 5, 2**32 - 20),
    "far": ("h.11.mlp.c_fc.weight", 2**63 - 1, 2**32, 2**45 + 17),
}
DITHER_OTHER_STEP = 2**33 + 6  # dither must not depend on the step

NAMES = ["", "a", "foobar", "blocks.0.attn.w", "layer.é", "h.11.mlp.c_fc.weight"]
KEY_CASES = [  # (name, stream, seed, step)
    ("blocks.0.attn.w", 1, 7, 3),
    ("blocks.0.attn.w", 2, 7, 0),
    ("blocks.0.attn.w", 1, 7, 4),
    ("blocks.0.attn.w", 1, 8, 3),
    ("layer.é", 1, 2**40 + 3, 2**33 + 5),
    ("h.11.mlp.c_fc.weight", 2, 2**63 - 1, 0),
]
NOISE_INDICES = [0, 1, 2, 65535, 2**32 - 1, 2**32, 2**32 + 1, 2**45 + 17, 2**64 - 1]
MIX_INPUTS = [0, 1, 0x80000000, 0xFFFFFFFF, 0x12345678, 0xDEADBEEF]


def compute_literals() -> dict:
    """Every expected value, from the spec_* code alone."""
    out: dict = {
        "mix32": [spec_mix32(x) for x in MIX_INPUTS],
        "name_id": [spec_name_id(n) for n in NAMES],
        "key": [spec_key(*c) for c in KEY_CASES],
        "noise16": [[spec_noise16(i, spec_key(*c)) for i in NOISE_INDICES] for c in KEY_CASES],
        "nearest": spec_cast("nearest", X_BITS, seed=0, step=0, name="w", start=0)[0],
    }
    for mode in ("stochastic", "dither"):
        for case, (name, seed, step, start) in CASES.items():
            out[f"{mode}/{case}"] = spec_cast(mode, X_BITS, seed=seed, step=step, name=name, start=start)[0]
    served, res = spec_cast("error_feedback", X_BITS, seed=0, step=0, name="w", start=0, residual=E_BITS)
    out["error_feedback"] = served
    out["error_feedback/residual"] = res
    return out


# ==== the literals (generated by compute_literals(); regenerate with `python3 tests/casting/test_known_answers.py`)

LITERALS = {
    'mix32': [
        0x00000000, 0x86D2FA73, 0xE0BD5472, 0x99B5E683, 0x16E776BD, 0x2A2ACAF2,
    ],
    'name_id': [
        0x811C9DC5, 0xE40C292C, 0xBF9CF968, 0xF053B439, 0xA9FEB928, 0x185DE947,
    ],
    'key': [
        0x34BF0091, 0xBFBFEA50, 0x974D648B, 0x7A91726C, 0x017EBC0D, 0x214C4D8D,
    ],
    'noise16': [
        [0x8D43, 0xF661, 0x2D8F, 0xC385, 0x2AAB, 0x99B2, 0x8E3D, 0xD0D0, 0xF80C],
        [0x546D, 0x10C3, 0x7B65, 0x20D4, 0x22A7, 0x1FA0, 0xCFB9, 0xE9BB, 0x37B6],
        [0x8FC4, 0x3343, 0x6E61, 0xD900, 0x196D, 0x4EB0, 0xA96A, 0x937E, 0x76DD],
        [0x7879, 0x4146, 0xE47A, 0x4D50, 0x4872, 0xD131, 0x3F79, 0xE02E, 0xFE59],
        [0x5479, 0x46B9, 0xBAEC, 0x63AD, 0x5FFD, 0xD030, 0x9FCA, 0x66FB, 0x153A],
        [0xFF65, 0x87D3, 0x3558, 0x8223, 0xE756, 0x793F, 0x8E17, 0x6C1D, 0x1728],
    ],
    'nearest': [
        0x0000, 0x8000, 0x0000, 0x8000, 0x0001, 0x0000, 0x0002, 0x8080, 0x0001, 0x8041,
        0x0040, 0x0041, 0x0080, 0x0080, 0x8080, 0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x3F80,
        0xBF81, 0x3DCD, 0xC049, 0xBC24, 0x42F7, 0x7F7F, 0xFF7F, 0x7F7F, 0x7F7F, 0xFF7F,
        0x7F80, 0xFF80, 0x7F80, 0x7F80, 0xFF80, 0x7F7F, 0x7F80, 0xFF80, None, None,
        None, None, None, None, None, None,
    ],
    'stochastic/small': [
        0x0000, 0x8000, 0x0000, 0x8000, 0x0001, 0x0000, 0x0001, 0x8080, 0x0001, 0x8041,
        0x0040, 0x0041, 0x007F, 0x0080, 0x8080, 0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x3F80,
        0xBF80, 0x3DCC, 0xC049, 0xBC24, 0x42F7, 0x7F7F, 0xFF7F, 0x7F7F, 0x7F7F, 0xFF7F,
        0x7F80, 0xFF80, 0x7F80, 0x7F80, 0xFF80, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0,
        0x7FC0, 0x7FC0, 0xFFC0, 0x7FFF, 0x7FC1, 0xFFFF,
    ],
    'stochastic/wide': [
        0x0000, 0x8000, 0x0000, 0x8000, 0x0001, 0x0001, 0x0001, 0x8080, 0x0002, 0x8041,
        0x0040, 0x0041, 0x007F, 0x0080, 0x8080, 0x3F80, 0x3F80, 0x3F81, 0x3F81, 0x3F80,
        0xBF81, 0x3DCD, 0xC049, 0xBC24, 0x42F7, 0x7F7F, 0xFF7F, 0x7F7F, 0x7F7F, 0xFF7F,
        0x7F7F, 0xFF80, 0x7F7F, 0x7F80, 0xFF80, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0,
        0x7FC0, 0x7FC0, 0xFFC0, 0x7FFF, 0x7FC1, 0xFFFF,
    ],
    'stochastic/far': [
        0x0000, 0x8000, 0x0000, 0x8000, 0x0001, 0x0000, 0x0002, 0x8080, 0x0001, 0x8041,
        0x0040, 0x0041, 0x007F, 0x0080, 0x8080, 0x3F80, 0x3F81, 0x3F81, 0x3F81, 0x3F80,
        0xBF81, 0x3DCD, 0xC049, 0xBC24, 0x42F7, 0x7F7F, 0xFF7F, 0x7F7F, 0x7F7F, 0xFF7F,
        0x7F7F, 0xFF80, 0x7F7F, 0x7F80, 0xFF80, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0,
        0x7FC0, 0x7FC0, 0xFFC0, 0x7FFF, 0x7FC1, 0xFFFF,
    ],
    'dither/small': [
        0x0000, 0x8000, 0x0000, 0x8000, 0x0001, 0x0001, 0x0002, 0x8080, 0x0001, 0x8040,
        0x0040, 0x0041, 0x007F, 0x0080, 0x8080, 0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x3F80,
        0xBF80, 0x3DCD, 0xC049, 0xBC24, 0x42F6, 0x7F7F, 0xFF7F, 0x7F7F, 0x7F7F, 0xFF7F,
        0x7F7F, 0xFF7F, 0x7F80, 0x7F80, 0xFF80, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0,
        0x7FC0, 0x7FC0, 0xFFC0, 0x7FFF, 0x7FC1, 0xFFFF,
    ],
    'dither/wide': [
        0x0000, 0x8000, 0x0000, 0x8000, 0x0001, 0x0001, 0x0001, 0x8080, 0x0001, 0x8041,
        0x0040, 0x0041, 0x007F, 0x0080, 0x8080, 0x3F80, 0x3F80, 0x3F81, 0x3F81, 0x3F80,
        0xBF81, 0x3DCD, 0xC049, 0xBC24, 0x42F7, 0x7F7F, 0xFF7F, 0x7F7F, 0x7F7F, 0xFF7F,
        0x7F7F, 0xFF7F, 0x7F80, 0x7F80, 0xFF80, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0,
        0x7FC0, 0x7FC0, 0xFFC0, 0x7FFF, 0x7FC1, 0xFFFF,
    ],
    'dither/far': [
        0x0000, 0x8000, 0x0000, 0x8000, 0x0001, 0x0000, 0x0001, 0x8080, 0x0001, 0x8041,
        0x0040, 0x0041, 0x0080, 0x0080, 0x8080, 0x3F80, 0x3F80, 0x3F81, 0x3F81, 0x3F80,
        0xBF81, 0x3DCD, 0xC049, 0xBC24, 0x42F7, 0x7F7F, 0xFF7F, 0x7F7F, 0x7F7F, 0xFF7F,
        0x7F7F, 0xFF7F, 0x7F80, 0x7F80, 0xFF80, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0,
        0x7FC0, 0x7FC0, 0xFFC0, 0x7FFF, 0x7FC1, 0xFFFF,
    ],
    'error_feedback': [
        0x0000, 0x8000, 0x0000, 0x8000, 0x0001, 0x0000, 0x0002, 0x8080, 0x0001, 0x8040,
        0x0040, 0x0041, 0x0080, 0x0080, 0x8080, 0x3F80, 0x3F81, 0x3F82, 0x3F81, 0x3F80,
        0xBF81, 0x3DCD, 0xC049, 0xBC24, 0x42F6, 0x7F7F, 0xFF7F, 0x7F7F, 0x7F7F, 0xFF7F,
        0x7F80, 0xFF7F, 0x7F7F, 0x7F80, 0xFF80, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0,
        0x7FC0, 0x7FC0, 0xFFC0, 0x7FFF, 0x7FC1, 0xFFFF,
    ],
    'error_feedback/residual': [
        0x00000000, 0x00000000, 0x00000001, 0x00000000, 0x80000002, 0x00008000, 0x00000000, 0x00000002,
        0x00002345, 0x003F7FFF, 0x80010000, 0x00000000, 0x80008000, 0x80000001, 0x80000001, 0xBB000000,
        0x00000000, 0x3C000000, 0xB4000000, 0x3A000800, 0xBA800000, 0x3BFCCCD0, 0x3CF81280, 0x371BD800,
        0xC118B438, 0x00000000, 0x7E000000, 0xFE7FFFFC, 0x7B7FFF00, 0xFAFFFE00, 0x00000000, 0x7EFF0000,
        0x73800000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000,
        0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000,
    ],
}


# ==== checks of the oracle ==========================================================================

def test_the_oracle_still_yields_the_literals():
    assert compute_literals() == LITERALS


def test_the_oracle_matches_published_fnv1a_vectors():
    # the FNV-1a 32-bit test vectors of the algorithm's authors: the oracle's name id is FNV-1a itself
    assert spec_name_id("") == 0x811C9DC5
    assert spec_name_id("a") == 0xE40C292C
    assert spec_name_id("foobar") == 0xBF9CF968


def test_the_oracle_rounds_as_ieee_does():
    """The rational-arithmetic rounding against Python's own fp32 conversion (struct, IEEE RNE)."""
    for bits in X_BITS + E_BITS:
        sign, mag = FP32.decode(bits)
        if isinstance(mag, float) and math.isnan(mag):
            continue
        value = struct.unpack("<f", struct.pack("<I", bits))[0]
        assert (mag == INF and math.isinf(value)) or Fraction(abs(value)) == mag
        assert math.copysign(1.0, value) == (-1.0 if sign else 1.0)
        assert FP32.encode(sign, mag) == bits
    # sums that struct rounds (via float64, exact for these: same binade region, few bits)
    for a, b in ((1.0, 2.0**-24), (1.0, 2.0**-24 + 2.0**-40), (1.0 + 2.0**-23, 2.0**-24), (3.0e38, 3.0e38)):
        want = struct.unpack("<I", struct.pack("<f", a + b))[0] if a + b < 3.4028235677973366e38 else 0x7F800000
        s, m = fp32_round(Fraction(a) + Fraction(b))
        assert FP32.encode(s, m) == want, (a, b)


def test_the_noisy_rule_is_unbiased_on_the_inputs():
    """The restated rule means what the docstring says it is for: |x| at position m/2^16 between
    its neighbours goes up for exactly the m largest of the 2^16 noise values, so E[result] = x."""
    for bits in X_BITS:
        sign, mag = FP32.decode(bits)
        if isinstance(mag, float) or neighbours(sign, mag)[1] == INF:
            continue  # NaN, Inf, and the overflow edge's guard (pinned by the literals)
        lo, hi = neighbours(sign, mag)
        m = (mag - lo) / BF16.spacing(lo) * (1 << 16)
        assert m.denominator == 1
        first_up = (1 << 16) - int(m)  # noise values first_up .. 2^16 - 1 round up: m of them
        assert spec_noisy(bits, first_up - 1) == BF16.encode(sign, lo)
        if m:
            assert spec_noisy(bits, first_up) == BF16.encode(sign, hi)
            assert spec_noisy(bits, (1 << 16) - 1) == BF16.encode(sign, hi)
        assert lo + BF16.spacing(lo) * m / (1 << 16) == mag


# ==== the product against the literals ===============================================================

def _f32(bits: list[int]):
    t = torch.tensor(bits, dtype=torch.int64)
    return (t - ((t & 0x80000000) << 1)).to(torch.int32).view(torch.float32)


def _bits16(y) -> list[int]:
    return (y.view(torch.int16).to(torch.int64) & 0xFFFF).tolist()


def _bits32(x) -> list[int]:
    return (x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF).tolist()


def _is_nan16(b: int) -> bool:
    return (b & 0x7F80) == 0x7F80 and (b & 0x007F) != 0


def assert_served(got: list[int], want: list[int | None], what: str) -> None:
    """Bit for bit; where the literal is None (nearest of a NaN) any NaN."""
    bad = [(k, hex(X_BITS[k]), hex(g), None if w is None else hex(w)) for k, (g, w) in enumerate(zip(got, want))
           if (w is None and not _is_nan16(g)) or (w is not None and g != w)]
    assert not bad, f"{what}: {len(bad)} of {len(want)} differ (index, input, got, want): {bad[:6]}"


def test_noise_equals_the_literals():
    from faircast_ds.casting import noise

    assert [noise.mix32_int(x) for x in MIX_INPUTS] == LITERALS["mix32"]
    assert noise.mix32(torch.tensor(MIX_INPUTS, dtype=torch.int64)).tolist() == LITERALS["mix32"]
    assert [noise.name_id(n) for n in NAMES] == LITERALS["name_id"]
    keys = [noise.stream_key(name=n, stream=s, seed=seed, step=step) for n, s, seed, step in KEY_CASES]
    assert keys == LITERALS["key"]
    for key, want in zip(keys, LITERALS["noise16"]):
        assert [noise.noise16_int(i, key) for i in NOISE_INDICES] == want
        # the tensor form over runs of indices, including across 2^32 and up to 2^63 - 1
        for i, w in zip(NOISE_INDICES, want):
            if i < 2**63 - 2:
                assert noise.noise16(i, 2, key).tolist()[0] == w, (key, i)


def test_mode_keys_use_the_documented_streams_and_steps():
    from faircast_ds.casting import modes

    assert modes.noise_key("stochastic", seed=7, step=3, name="blocks.0.attn.w") == LITERALS["key"][0]
    assert modes.noise_key("dither", seed=7, step=3, name="blocks.0.attn.w") == LITERALS["key"][1]
    assert modes.noise_key("dither", seed=7, step=99, name="blocks.0.attn.w") == LITERALS["key"][1]
    assert modes.noise_key("stochastic", seed=7, step=4, name="blocks.0.attn.w") == LITERALS["key"][2]
    assert modes.noise_key("stochastic", seed=8, step=3, name="blocks.0.attn.w") == LITERALS["key"][3]


def _runs():
    """(label, mode, name, seed, step, start, literal key) of every cast with known answers."""
    yield "nearest", "nearest", "w", 0, 0, 0, "nearest"
    for mode in ("stochastic", "dither"):
        for case, (name, seed, step, start) in CASES.items():
            yield f"{mode}/{case}", mode, name, seed, step, start, f"{mode}/{case}"
    name, seed, step, start = CASES["wide"]
    yield "dither/wide, another step", "dither", name, seed, DITHER_OTHER_STEP, start, "dither/wide"
    yield "error_feedback", "error_feedback", "w", 5, 9, 3, "error_feedback"


RUNS = list(_runs())


@pytest.mark.parametrize("label,mode,name,seed,step,start,lit", RUNS, ids=[r[0] for r in RUNS])
def test_cast_equals_the_literals(label, mode, name, seed, step, start, lit):
    from faircast_ds.casting.rules import cast

    res = _f32(E_BITS) if mode == "error_feedback" else None
    y = cast(_f32(X_BITS), mode, seed=seed, step=step, name=name, start=start, residual=res)
    assert_served(_bits16(y), LITERALS[lit], f"casts.cast {label}")
    if res is not None:
        assert _bits32(res) == LITERALS["error_feedback/residual"]


@pytest.mark.parametrize("label,mode,name,seed,step,start,lit", RUNS, ids=[r[0] for r in RUNS])
def test_reference_equals_the_literals(label, mode, name, seed, step, start, lit):
    """faircast_ds.casting.reference is what the other tests compare the fast paths with: pin it too."""
    from faircast_ds.casting.reference import cast_reference

    res = _f32(E_BITS) if mode == "error_feedback" else None
    y = cast_reference(_f32(X_BITS), mode, seed=seed, step=step, name=name, start=start, residual=res)
    assert_served(_bits16(y), LITERALS[lit], f"reference {label}")
    if res is not None:
        assert _bits32(res) == LITERALS["error_feedback/residual"]


def _cpu_builds() -> list[str]:
    """native, and on x86 the narrower builds this CPU can run (AVX2, SSE4.2 code paths)."""
    builds = ["native"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags = Path("/proc/cpuinfo").read_text()
        builds += [arch for arch, flag in (("x86-64-v3", "avx512f"), ("x86-64-v2", "avx2")) if flag in flags]
    return builds


@pytest.fixture(scope="module")
def cpu_kernel():
    from faircast_ds.casting import kernels
    from faircast_ds.casting.kernels import cpu

    if kernels.requested_backend() == "eager":
        pytest.skip("FAIRCAST_DS_KERNELS=eager: this session simulates a machine without the fused kernel")
    cpu.load()  # a build failure is a failure here, with the compiler's reason
    return cpu


@pytest.mark.parametrize("arch", _cpu_builds())
def test_fused_cpu_kernel_equals_the_literals(cpu_kernel, monkeypatch, arch):
    from faircast_ds.casting import kernels, modes
    from faircast_ds.casting.rules import cast_into

    for label, mode, name, seed, step, start, lit in RUNS:
        res = _f32(E_BITS) if mode == "error_feedback" else None
        x = _f32(X_BITS)
        old = torch.zeros(len(X_BITS), dtype=torch.bfloat16)
        out = old.clone()
        if arch == "native":  # through the dispatcher, forced to the kernel
            monkeypatch.setenv(kernels.ENV_VAR, "cpp")
            changed, nonfinite = cast_into(out, x, mode, seed=seed, step=step, name=name, start=start, residual=res)
        else:
            key = modes.noise_key(mode, seed=seed, step=step, name=name)
            changed, nonfinite = cpu_kernel.cast_into(out, x, mode, key=key, start=start, residual=res, arch=arch)
        got = _bits16(out)
        assert_served(got, LITERALS[lit], f"fused {arch} {label}")
        assert changed == sum(g != 0 for g in got), label
        assert nonfinite == sum((g & 0x7F80) == 0x7F80 for g in got), label
        if res is not None:
            assert _bits32(res) == LITERALS["error_feedback/residual"], f"fused {arch} residual"


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("mode", ["nearest", "stochastic", "dither", "error_feedback"])
def test_shard_caster_serves_the_literals_for_a_slice_at_an_offset(mode, staged):
    """A flat shard holding padding, the known inputs as elements [start, start + n) of one
    parameter at flat offset 5, and another parameter: the served slice is the literals, at the
    ShardCaster's own step and the config's seed; error feedback's residual too. Both of the
    caster's routes: casting in place, and through a staging buffer (offload's)."""
    from faircast_ds.config.section import FairCastConfig
    from faircast_ds.shard.caster import ShardCaster, ShardSlice, with_padding

    name, seed, step, start = CASES["wide"] if mode != "error_feedback" else ("w", 5, 9, 3)
    n, offset = len(X_BITS), 5
    total = offset + n + 4
    slices = with_padding([ShardSlice(name, start, n, offset), ShardSlice("other", 0, 4, offset + n)], total)
    caster = ShardCaster(FairCastConfig(mode=mode, seed=seed, on_nonfinite="propagate"), force_staging=staged)
    caster.step = step - 1
    assert caster.begin_step() == step
    master = torch.cat([torch.full((offset,), 0.3), _f32(X_BITS), torch.full((4,), -0.7)])
    served = torch.zeros(total, dtype=torch.bfloat16)
    if mode == "error_feedback":
        caster.residuals["flat0"] = torch.cat([torch.zeros(offset), _f32(E_BITS), torch.zeros(4)])
    caster.cast_flat("flat0", master, served, slices)
    lit = "nearest" if mode == "nearest" else "error_feedback" if mode == "error_feedback" else f"{mode}/wide"
    assert_served(_bits16(served[offset:offset + n]), LITERALS[lit], f"ShardCaster {mode}")
    if mode == "error_feedback":
        assert _bits32(caster.residuals["flat0"][offset:offset + n]) == LITERALS["error_feedback/residual"]


TRITON_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from faircast_ds.casting import modes
    from faircast_ds.casting.kernels import triton_cast
    runs, x_bits, e_bits = json.loads(sys.stdin.read())
    def f32(bits):
        t = torch.tensor(bits, dtype=torch.int64)
        return (t - ((t & 0x80000000) << 1)).to(torch.int32).view(torch.float32)
    results = []
    for label, mode, name, seed, step, start, lit in runs:
        res = f32(e_bits) if mode == "error_feedback" else None
        out = torch.zeros(len(x_bits), dtype=torch.bfloat16)
        key = modes.noise_key(mode, seed=seed, step=step, name=name)
        counts = triton_cast.cast_into(out, f32(x_bits), mode, key=key, start=start, residual=res)
        results.append([(out.view(torch.int16).to(torch.int64) & 0xFFFF).tolist(),
                        None if res is None else (res.view(torch.int32).to(torch.int64) & 0xFFFFFFFF).tolist(),
                        list(counts)])
    print("RESULTS " + json.dumps(results))
""")


def test_triton_kernel_in_the_cpu_interpreter_equals_the_literals():
    """Triton's interpreter (TRITON_INTERPRET=1) runs the kernel's own code on CPU tensors; in a
    subprocess because the interpreter is chosen when Triton is imported."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (launch/setup.d/40-triton.sh installs it)")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], input=json.dumps([RUNS, X_BITS, E_BITS]),
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    for (label, mode, *_, lit), (got, res, counts) in zip(RUNS, json.loads(lines[0][8:])):
        assert_served(got, LITERALS[lit], f"triton {label}")
        assert counts == [sum(g != 0 for g in got), sum((g & 0x7F80) == 0x7F80 for g in got)], label
        if mode == "error_feedback":
            assert res == LITERALS["error_feedback/residual"]


# ==== regenerating the literals =====================================================================

def format_literals(lits: dict) -> str:
    def row(values, width):
        return ", ".join("None" if v is None else f"0x{v:0{width}X}" for v in values)

    lines = ["LITERALS = {"]
    for k, v in lits.items():
        if k == "noise16":
            lines.append(f"    {k!r}: [")
            lines += [f"        [{row(r, 4)}]," for r in v]
            lines.append("    ],")
            continue
        width = 8 if k in ("mix32", "name_id", "key", "error_feedback/residual") else 4
        lines.append(f"    {k!r}: [")
        per = 8 if width == 8 else 10
        for i in range(0, len(v), per):
            lines.append(f"        {row(v[i:i + per], width)},")
        lines.append("    ],")
    lines.append("}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_literals(compute_literals()))
