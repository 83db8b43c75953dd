"""The fp32 -> bf16 casts. This module is the one place that decides a served bit.

Every function here is pure (error feedback updates the residual it is handed, and nothing else).
Each mode's rule is the pure-torch function its spec names (``faircast_ds.casting.modes``; the
functions live in ``faircast_ds.casting.rounding``). ``faircast_ds.casting.reference`` holds a slow, element-by-element version of the same rules; the tests
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
  hi, in 2^-16ths of the spacing) and n the element's ``noise16`` (``faircast_ds.casting.modes`` names the
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

import torch

from faircast_ds.casting.bits import bf16_bits
from faircast_ds.casting.kernels.operands import check_marks
from faircast_ds.casting.marks import or_mask
from faircast_ds.casting.modes import CastRule, ModeSpec, registered, spec
from faircast_ds.casting.noise import noise16, noise16_at
from faircast_ds.casting.runs import Runs


def _check_inputs(x: torch.Tensor, mode: ModeSpec, residual: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 1:
        got = f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"cast expects a 1-D float32 tensor, got {got}")
    if mode.residual:
        if residual is None:
            raise ValueError(f"mode {mode.name!r} needs residual=<float32 tensor shaped like x>")
        if residual.dtype != torch.float32 or residual.shape != x.shape or residual.device != x.device:
            raise ValueError(f"residual must be float32 of shape {tuple(x.shape)} on {x.device}, got "
                             f"{residual.dtype} of shape {tuple(residual.shape)} on {residual.device}")
    elif residual is not None:
        carriers = ", ".join(repr(m) for m in registered() if spec(m).residual)
        raise ValueError(f"residual is only used by mode {carriers}, not {mode.name!r}")


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
    return cast_with(CastRule.of(mode, seed), x, step=step, name=name, start=start, residual=residual, index=index)


def cast_with(rule: CastRule, x: torch.Tensor, *, step: int, name: str, start: int = 0,
              residual: torch.Tensor | None = None, index: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`cast` under a run's :class:`~faircast_ds.casting.modes.CastRule` (its mode already validated)."""
    _check_inputs(x, rule.spec, residual)
    noise = None
    if rule.spec.uses_noise:
        key = rule.key(name, step)
        if index is not None:
            if index.shape != x.shape:
                raise ValueError(f"index has shape {tuple(index.shape)}, x {tuple(x.shape)}")
            noise = noise16_at(index.to(x.device), key)
        else:
            noise = noise16(start, x.numel(), key, device=x.device)
    return rule.spec.rule(x, noise, residual)


def cast_into(out: torch.Tensor,
              x: torch.Tensor,
              mode: str,
              *,
              seed: int,
              step: int,
              name: str,
              start: int = 0,
              residual: torch.Tensor | None = None,
              runs: Runs | None = None,
              marks: torch.Tensor | None = None,
              mark_base: int = 0) -> tuple[int, int]:
    """Write :func:`cast` of ``x`` into the 1-D bf16 buffer ``out`` in place.

    Returns ``(changed, nonfinite)``: how many elements' bits differ from what ``out`` held before,
    and how many outputs are NaN or ±Inf. The fastest path for the tensors' device does it in one
    pass (``faircast_ds.casting.kernels``: fused C++ on CPU, Triton on CUDA; ``FAIRCAST_DS_KERNELS`` =
    ``eager|cpp|triton`` forces one); every path writes exactly the bits :func:`cast` returns.
    ``error_feedback`` updates ``residual`` in place, as in :func:`cast`.
    ``runs`` (:class:`faircast_ds.casting.runs.Runs`): ``x`` holds these runs of the parameter, not the contiguous
    run from ``start`` (which is then ignored); the fused kernels cast them in one call, the eager path
    keys the noise by :meth:`Runs.indices`, as :func:`cast` with ``index``.
    ``marks`` (:mod:`faircast_ds.casting.marks`): a change-mark bitmap ORed with 1 at bit ``mark_base + i``
    for every element ``i`` whose bits changed.
    """
    return cast_into_with(CastRule.of(mode, seed), out, x, step=step, name=name, start=start, residual=residual,
                          runs=runs, marks=marks, mark_base=mark_base)


def cast_into_with(rule: CastRule, out: torch.Tensor, x: torch.Tensor, *, step: int, name: str, start: int = 0,
                   residual: torch.Tensor | None = None, runs: Runs | None = None,
                   marks: torch.Tensor | None = None, mark_base: int = 0) -> tuple[int, int]:
    """:func:`cast_into` under a run's :class:`~faircast_ds.casting.modes.CastRule`. ``marks``: change
    marks (:mod:`faircast_ds.casting.marks`): bit ``mark_base + i`` is ORed with 1 wherever element ``i``'s
    bits changed (every path: the kernels in their pass, the eager path from its comparison)."""
    _check_inputs(x, rule.spec, residual)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or out.shape != x.shape:
        got = f"{out.dtype} tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"cast_into expects a bf16 output shaped like x {tuple(x.shape)}, got {got}")
    if runs is not None:
        if not isinstance(runs, Runs):
            raise TypeError(f"runs must be a faircast_ds.casting.runs.Runs, got {type(runs).__name__}")
        if runs.numel != x.numel():
            raise ValueError(f"runs cover {runs.numel} elements, x has {x.numel()}")
        if not rule.spec.uses_noise:
            runs = None  # a mode without noise: the index does not enter the result
    if marks is not None:
        check_marks(marks, mark_base, out.numel(), out.device)
    from faircast_ds.casting import kernels  # deferred: the kernels are optional and may build on first use

    counts = kernels.fused_cast_into(out, x, rule, step=step, name=name, start=start, residual=residual, runs=runs,
                                     marks=marks, mark_base=mark_base)
    if counts is not None:
        return counts
    index = runs.indices(x.device) if runs is not None else None
    served = cast_with(rule, x, step=step, name=name, start=start, residual=residual, index=index).to(out.device)
    differ = bf16_bits(out) != bf16_bits(served)
    changed = int(differ.sum())
    if marks is not None and changed:
        or_mask(marks, mark_base, differ)
    nonfinite = int((~torch.isfinite(served)).sum())
    out.copy_(served)
    return changed, nonfinite
