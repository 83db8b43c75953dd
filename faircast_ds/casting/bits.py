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

    With ``e`` the value's exponent field (bf16 and fp32 share its 8 bits), the spacing is ``2^(max(e, 1) - 134)``:
    a power of two built here from its fp32 bit pattern in int32 (a normal fp32 with exponent field
    ``max(e, 1) - 7`` from ``e = 8`` up, below that the fp32 subnormal ``2^-149 x 2^(max(e, 1) + 15)``), which
    is 3-4x faster per element than computing the power with ``ldexp`` and gives the same values
    (tests/shard/test_diagnostics.py checks every bf16 bit pattern and a spread of fp32 ones against frexp)."""
    y = y.detach().contiguous()
    if y.dtype == torch.float32:
        exponent = (y.view(torch.int32) >> 23) & 0xFF
    else:
        exponent = (y.view(torch.int16).to(torch.int32) >> 7) & 0xFF
    exponent.clamp_(min=1)
    return torch.where(exponent >= 8, (exponent - 7) << 23, 1 << (exponent + 15)).view(torch.float32)
