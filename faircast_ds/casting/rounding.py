"""The per-element rounding rules the modes' specs point at (``faircast_ds.casting.modes``): each is pure
(error feedback updates the residual it is handed, and nothing else); their definitions are in
``faircast_ds.casting.rules``' docstring."""
from __future__ import annotations

import torch

from faircast_ds.casting.bits import (
    _ABS,
    _INF16,
    _INF_BITS,
    _QUIET16,
    _RN_OVERFLOW,
    _SIGN,
    bf16_from_bits,
    fp32_bits,
)


def round_with_noise(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Add 16-bit noise to the magnitude bits and truncate: rounds away from zero with probability
    equal to the fraction of a bf16 spacing that |x| lies above its lower neighbour."""
    b = fp32_bits(x)
    mag = b & _ABS
    r = (mag + noise) >> 16
    # Near the top of the range the carry would produce Inf where round-to-nearest stays finite.
    overflow = (mag < _RN_OVERFLOW) & (r >= _INF16)
    r = torch.where(overflow, mag >> 16, r)
    out = ((b & _SIGN) >> 16) | r
    return torch.where(mag > _INF_BITS, quiet_nan(x), bf16_from_bits(out))


def quiet_nan(x: torch.Tensor) -> torch.Tensor:
    """The bf16 NaN our unbiased modes return for a NaN input: sign and top payload bits kept, quiet
    bit set, so a payload that sat only in the low 16 bits cannot turn into Inf."""
    return bf16_from_bits((fp32_bits(x) >> 16) | _QUIET16)


def error_feedback_step(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """served = RN(x + e), kept between the two bf16 neighbours of x; e <- x + e - served, in place.

    Keeping the result next to the master bounds what any rank can serve, and costs nothing in
    expectation: whatever the clamp holds back stays in the residual. A non-finite master is served
    as in the other modes and resets its residual to 0; so does a residual that overflows.
    """
    b = fp32_bits(x)
    lo = bf16_from_bits(b >> 16).float()
    hi = bf16_from_bits((b >> 16) + 1).float()
    y = torch.where(residual == 0, x, x + residual)  # keeps -0.0 when there is nothing to add
    served = y.to(torch.bfloat16).float().clamp(torch.minimum(lo, hi), torch.maximum(lo, hi))
    # a zero result is x's zero neighbour, sign included (torch's clamp breaks the +0/-0 tie differently
    # in its vector loop and its scalar tail, which would make the bits depend on the shard's layout)
    served = torch.where(served == 0, lo, served)
    served = torch.where(torch.isinf(served) & torch.isfinite(x.to(torch.bfloat16)), lo, served)
    new_residual = y - served
    finite = torch.isfinite(x)
    residual.copy_(torch.where(finite & torch.isfinite(new_residual), new_residual, torch.zeros_like(y)))
    out = served.to(torch.bfloat16)
    return torch.where(finite, out, torch.where(torch.isnan(x), quiet_nan(x), x.to(torch.bfloat16)))
