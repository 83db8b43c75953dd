"""Counter-based rounding noise: a pure function of (seed, step, parameter name, element index).

No generator state and no stored noise: the same element of the same parameter gets the same
16 noise bits whatever the sharding, the order of calls or the device. This is what makes the
served weights independent of ZeRO stage, world size and offload.

The specification, which every fast path must reproduce bit for bit:

    mix32(x)   = x ^= x >> 16; x = x * 0x21F0AAAD mod 2^32; x ^= x >> 15;
                 x = x * 0x735A2D97 mod 2^32; x ^= x >> 15      (x a 32-bit word, >> logical)
    name_id    = FNV-1a 32-bit of the UTF-8 parameter name: h = 0x811C9DC5, then for each
                 byte b: h = (h ^ b) * 0x01000193 mod 2^32
    key        = chain of mix32 over (name_id, stream, seed_lo, seed_hi, step_lo, step_hi),
                 each word XORed into the running value before mixing; the running value
                 starts at 0, so key = mix32(...mix32(mix32(name_id) ^ stream) ^ seed_lo ... ^ step_hi)
                 (x_lo = x mod 2^32, x_hi = (x >> 32) mod 2^32; seed and step are >= 0, and
                 ``faircast_ds.casting.modes`` says which stream and step each mode hashes)
    h(i)       = mix32(mix32((i mod 2^32) ^ key) ^ (i >> 32))   for element index i (0 <= i < 2^64)
    noise16(i) = h(i) >> 16                                      (uniform on [0, 65536))

The element index i is the element's position in the whole parameter (flattened), not in a shard.

The multipliers are below 2^31 so that the products of 32-bit values fit in a signed int64:
torch's int64 arithmetic then computes the hash exactly, with no reliance on overflow.
"""
from __future__ import annotations

import functools

import torch

MASK32 = 0xFFFFFFFF
_M1 = 0x21F0AAAD
_M2 = 0x735A2D97



def mix32_int(x: int) -> int:
    """The 32-bit mixing function on a Python int (the scalar half of the specification)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    x ^= x >> 15
    return x


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The same mixing function on an int64 tensor holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & MASK32
    return x ^ (x >> 15)


def mix32_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` in place on ``x`` (int64, values in [0, 2^32)), with ``scratch`` (same shape and
    dtype) as its one temporary: no allocation, for loops over chunks of a large slice."""
    torch.bitwise_right_shift(x, 16, out=scratch)
    x.bitwise_xor_(scratch).mul_(_M1).bitwise_and_(MASK32)
    torch.bitwise_right_shift(x, 15, out=scratch)
    x.bitwise_xor_(scratch).mul_(_M2).bitwise_and_(MASK32)
    torch.bitwise_right_shift(x, 15, out=scratch)
    return x.bitwise_xor_(scratch)


@functools.lru_cache(maxsize=1 << 16)
def name_id(name: str) -> int:
    """FNV-1a (32-bit) of the parameter name: a stable id that does not depend on Python's hash seed."""
    h = 0x811C9DC5
    for byte in name.encode("utf-8"):
        h ^= byte
        h = (h * 0x01000193) & MASK32
    return h


def stream_key(*, seed: int, step: int, name: str, stream: int) -> int:
    """The 32-bit key of one (seed, step, parameter, stream); dither passes step=0."""
    if seed < 0 or step < 0:
        raise ValueError(f"seed and step must be non-negative, got seed={seed}, step={step}")
    k = mix32_int(name_id(name))
    for word in (stream, seed & MASK32, (seed >> 32) & MASK32, step & MASK32, (step >> 32) & MASK32):
        k = mix32_int(k ^ word)
    return k


def noise16_int(index: int, key: int) -> int:
    """Noise of one element, in plain Python ints (used by the slow reference)."""
    h = mix32_int((index & MASK32) ^ key)
    h = mix32_int(h ^ (index >> 32))
    return h >> 16


def noise16(start: int, numel: int, key: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Noise of elements [start, start + numel) of one parameter, as an int64 tensor in [0, 65536)."""
    if start < 0:
        raise ValueError(f"start must be non-negative, got {start}")
    index = torch.arange(start, start + numel, dtype=torch.int64, device=device)
    h = mix32((index & MASK32) ^ key)
    h = mix32(h ^ (index >> 32))
    return h >> 16


def noise16_at(index: torch.Tensor, key: int) -> torch.Tensor:
    """Noise of the elements at ``index`` (int64 positions in the whole flattened parameter, any order),
    as an int64 tensor in [0, 65536): ``noise16_at(arange(s, s + n), key)`` equals ``noise16(s, n, key)``.
    For a shard whose elements are not one contiguous run of the parameter (a tensor-parallel slice)."""
    if index.dtype != torch.int64:
        raise TypeError(f"index must be int64, got {index.dtype}")
    h = mix32((index & MASK32) ^ key)
    h = mix32(h ^ (index >> 32))
    return h >> 16
