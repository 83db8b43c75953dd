"""Bit patterns of fp32 and bf16 values, and the bf16 spacing: the helpers every cast and every
check reads bits with."""
from __future__ import annotations

from typing import Final

import torch

from faircast_ds.casting.noise import MASK32

_SIGN: Final = 0x80000000
_ABS: Final = 0x7FFFFFFF
_INF_BITS: Final = 0x7F800000
_RN_OVERFLOW: Final = 0x7F7F8000  # smallest |x| bit pattern that round-to-nearest sends to Inf
_INF16: Final = 0x7F80
_QUIET16: Final = 0x0040


def fp32_bits(x: torch.Tensor) -> torch.Tensor:
    """The IEEE bit pattern of an fp32 tensor as int64 values in [0, 2^32)."""
    return x.view(torch.int32).to(torch.int64) & MASK32


def bf16_from_bits(bits16: torch.Tensor) -> torch.Tensor:
    """Build a bf16 tensor from int64 bit patterns in [0, 2^16)."""
    signed = bits16 - ((bits16 & 0x8000) << 1)  # two's complement without relying on a narrowing wrap
    return signed.to(torch.int16).view(torch.bfloat16)


def bf16_bits(y: torch.Tensor) -> torch.Tensor:
    """The bit pattern of a bf16 tensor as int64 values in [0, 2^16)."""
    return y.view(torch.int16).to(torch.int64) & 0xFFFF


def bf16_spacing(y: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing in the binade of each value, as fp32: for a bf16 value the distance to the next one
    away from zero; for an fp32 value the spacing of the bf16 grid around it (subnormals and zero: the
    smallest spacing). The one definition of a spacing that every figure in spacings uses.

    With ``e`` the value's exponent field (bf16 and fp32 share its 8 bits), the spacing is ``2^(max(e, 1) - 134)``
    (``2^121`` for ``e = 255``, the non-finite values). Built here as the power of two ``2^(e - 127)`` that masking
    the value's sign and mantissa bits leaves (0 for ``e = 0``, inf for ``e = 255``), times ``2^-7`` (exact:
    from ``e = 7`` down the products are fp32 subnormals, still powers of two), clamped to ``[2^-133, 2^121]``
    (which changes only ``e = 0`` and ``e = 255``): four passes over the values, ~2x faster than the earlier
    construction from int32 exponents and 6-8x faster than ``ldexp``, the same values
    (tests/shard/test_diagnostics.py checks every bf16 bit pattern and a spread of fp32 ones against frexp).
    Under ``torch.set_flush_denormal(True)`` the spacings below 2^-126 (values under 2^-119 and zero) flush to 0;
    they are subnormal either way, so a division by them is not meaningful there."""
    y = y.detach().contiguous()
    if y.dtype == torch.float32:
        power = (y.view(torch.int32) & 0x7F800000).view(torch.float32)
    else:
        power = (y.view(torch.int16) & 0x7F80).view(torch.bfloat16).float()
    return power.mul_(2.0 ** -7).clamp_(min=2.0 ** -133, max=2.0 ** 121)
