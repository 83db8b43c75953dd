"""The fp32 -> bf16 casts. This module is the one place that decides a served bit.

Every function here is pure (error feedback updates the residual it is handed, and nothing else).
``faircast_ds.reference`` holds a slow, element-by-element version of the same rules; the tests
compare the two bit for bit.

Rules shared by every unbiased mode (``stochastic``, ``dither``, ``error_feedback``):
- the result is one of the two bf16 neighbours of the input (the input itself if representable);
- NaN stays NaN (a quiet NaN with the input's sign and top payload bits), ±Inf stays ±Inf,
  -0.0 stays -0.0, subnormals round like any other value (bf16 shares fp32's exponent range);
- a finite input becomes ±Inf only where round-to-nearest of it is ±Inf.

Each mode, element by element (x the fp32 input at index ``start + k`` of its parameter; "lo" is x
truncated toward zero to bf16, i.e. the top 16 bits of x's pattern, and "hi" is lo one bf16 step
away from zero, the pattern lo + 1; subnormals are kept everywhere, never flushed to zero):
- ``nearest``: IEEE round-to-nearest-even to bf16 (|x| >= 2^128 - 2^119, pattern 0x7F7F8000, goes to
  ±Inf). A NaN gives torch's NaN for the device, whose bits are left open (``kernels.nan``).
- ``stochastic``, ``dither``: with m the low 16 bits of x's pattern (where |x| lies between lo and
  hi, in 2^-16ths of the spacing) and n the element's ``noise16`` (``faircast_ds.modes`` names the
  stream and step), the result is hi if m + n >= 2^16, else lo; except that a finite x whose
  round-to-nearest is finite is served lo where hi is ±Inf. A NaN gives the bf16 pattern
  (x's pattern >> 16) | 0x0040; ±Inf gives ±Inf.
- ``error_feedback``, with residual e: y = x if e is ±0, else the fp32 sum x + e (rounded once, to
  nearest even); the served value is round-to-nearest-even of y to bf16, clamped to
  [min(lo, hi), max(lo, hi)]; a zero there is lo (x's zero, sign included), and a ±Inf there is lo
  when x's own round-to-nearest is finite. The new residual is the fp32 difference y - served (an
  exact zero is +0), or +0 where x is not finite or that difference is not (y overflowed). A NaN x
  gives the pattern (x's pattern >> 16) | 0x0040, ±Inf gives ±Inf (residual +0 for both).
"""
from __future__ import annotations

from typing import Final

import torch

from faircast_ds.modes import MODES, noise_key, uses_noise
from faircast_ds.noise import MASK32, noise16, noise16_at
from faircast_ds.runs import Runs

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
    smallest spacing). The one definition of a spacing that every figure in spacings uses."""
    if y.dtype == torch.float32:
        exponent = (fp32_bits(y.detach().contiguous()) >> 23) & 0xFF
    else:
        exponent = (bf16_bits(y.detach().contiguous()) >> 7) & 0xFF
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), torch.clamp(exponent, min=1) - 134)


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


def _check_inputs(x: torch.Tensor, mode: str, residual: torch.Tensor | None) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown fair cast mode {mode!r}; accepted: {', '.join(MODES)}")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 1:
        got = f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"cast expects a 1-D float32 tensor, got {got}")
    if mode == "error_feedback":
        if residual is None:
            raise ValueError("mode 'error_feedback' needs residual=<float32 tensor shaped like x>")
        if residual.dtype != torch.float32 or residual.shape != x.shape or residual.device != x.device:
            raise ValueError(f"residual must be float32 of shape {tuple(x.shape)} on {x.device}, got "
                             f"{residual.dtype} of shape {tuple(residual.shape)} on {residual.device}")
    elif residual is not None:
        raise ValueError(f"residual is only used by mode 'error_feedback', not {mode!r}")


def cast(x: torch.Tensor,
         mode: str,
         *,
         seed: int,
         step: int,
         name: str,
         start: int = 0,
         residual: torch.Tensor | None = None,
         index: torch.Tensor | None = None) -> torch.Tensor:
    """Cast a 1-D fp32 slice holding elements ``[start, start + len(x))`` of parameter ``name`` to bf16.

    Casting a whole parameter, or its pieces at their ``start`` offsets, gives identical bits: the
    noise of an element depends only on (seed, step, name, index). ``dither`` ignores ``step``: its
    per-element threshold is fixed for the run. ``error_feedback`` updates ``residual`` in place.
    ``index`` (int64, one per element): the elements' indices in the parameter when they are not the
    contiguous run from ``start`` (a tensor-parallel slice); ``start`` is then ignored.
    """
    _check_inputs(x, mode, residual)
    if mode == "nearest":
        return x.to(torch.bfloat16)
    if mode == "error_feedback":
        return error_feedback_step(x, residual)
    key = noise_key(mode, seed=seed, step=step, name=name)
    if index is not None:
        if index.shape != x.shape:
            raise ValueError(f"index has shape {tuple(index.shape)}, x {tuple(x.shape)}")
        return round_with_noise(x, noise16_at(index.to(x.device), key))
    return round_with_noise(x, noise16(start, x.numel(), key, device=x.device))


def cast_into(out: torch.Tensor,
              x: torch.Tensor,
              mode: str,
              *,
              seed: int,
              step: int,
              name: str,
              start: int = 0,
              residual: torch.Tensor | None = None,
              runs: Runs | None = None) -> tuple[int, int]:
    """Write :func:`cast` of ``x`` into the 1-D bf16 buffer ``out`` in place.

    Returns ``(changed, nonfinite)``: how many elements' bits differ from what ``out`` held before,
    and how many outputs are NaN or ±Inf. The fastest path for the tensors' device does it in one
    pass (``faircast_ds.kernels``: fused C++ on CPU, Triton on CUDA; ``FAIRCAST_DS_KERNELS`` =
    ``eager|cpp|triton`` forces one); every path writes exactly the bits :func:`cast` returns.
    ``error_feedback`` updates ``residual`` in place, as in :func:`cast`.
    ``runs`` (:class:`faircast_ds.runs.Runs`): ``x`` holds these runs of the parameter, not the contiguous
    run from ``start`` (which is then ignored); the fused kernels cast them in one call, the eager path
    keys the noise by :meth:`Runs.indices`, as :func:`cast` with ``index``.
    """
    _check_inputs(x, mode, residual)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or out.shape != x.shape:
        got = f"{out.dtype} tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"cast_into expects a bf16 output shaped like x {tuple(x.shape)}, got {got}")
    if runs is not None:
        if not isinstance(runs, Runs):
            raise TypeError(f"runs must be a faircast_ds.runs.Runs, got {type(runs).__name__}")
        if runs.numel != x.numel():
            raise ValueError(f"runs cover {runs.numel} elements, x has {x.numel()}")
        if not uses_noise(mode):
            runs = None  # nearest and error feedback draw no noise: the index does not enter the result
    from faircast_ds import kernels  # deferred: the kernels are optional and may build on first use

    counts = kernels.fused_cast_into(out, x, mode, seed=seed, step=step, name=name, start=start,
                                     residual=residual, runs=runs)
    if counts is not None:
        return counts
    index = runs.indices(x.device) if runs is not None else None
    served = cast(x, mode, seed=seed, step=step, name=name, start=start, residual=residual,
                  index=index).to(out.device)
    changed = int((bf16_bits(out) != bf16_bits(served)).sum())
    nonfinite = int((~torch.isfinite(served)).sum())
    out.copy_(served)
    return changed, nonfinite
