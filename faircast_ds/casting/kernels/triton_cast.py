"""The fused cast for CUDA tensors, in Triton: one pass, the noise hashed in registers.

Same bits as ``faircast_ds.casting.rules.cast`` (checked by tests/casting/test_kernels.py where CUDA is present, in
Triton's CPU interpreter where Triton is installed, and by benchmarks/gpu_check.py on awkward
inputs). This module imports Triton: ``faircast_ds.casting.kernels`` imports it only for CUDA tensors.

Choices that keep the bits exact on the GPU:
- the hash is uint32 arithmetic (Triton's unsigned multiply wraps mod 2^32, ``>>`` is logical);
- every comparison of floats is done on their bit patterns mapped to an unsigned order, so no
  flush-to-zero mode can change a compare;
- error feedback's one fp32 add and one fp32 subtract are PTX ``add.rn.f32``/``sub.rn.f32`` on
  NVIDIA GPUs: round-to-nearest, subnormals kept, never fused into an FMA.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from faircast_ds.casting.kernels.nan import torch_nan16
from faircast_ds.casting.kernels.operands import check_marks, contiguous, write_back
from faircast_ds.casting.modes import kernel_code

BLOCK = 4096
NUM_WARPS = 8

@triton.jit
def mix32(x):
    x ^= x >> 16
    x *= 0x21F0AAAD
    x ^= x >> 15
    x *= 0x735A2D97
    x ^= x >> 15
    return x

@triton.jit
def order_key(u, sign_bit):
    # Float bits -> an unsigned key with the same order as the (non-NaN) floats; +0 and -0 equal.
    u = tl.where((u & 0x7FFFFFFF) == 0, 0, u)
    return tl.where((u >> 31) != 0, ~u, u | sign_bit)

@triton.jit
def fadd(a, b, USE_PTX: tl.constexpr):
    if USE_PTX:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a + b

@triton.jit
def fsub(a, b, USE_PTX: tl.constexpr):
    if USE_PTX:
        return tl.inline_asm_elementwise("sub.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a - b

@triton.jit(do_not_specialize=["n", "start", "key", "nruns", "steps", "mark_base"])
def cast_kernel(x_ptr, res_ptr, out_ptr, partial_ptr, n, start, key, offsets_ptr, starts_ptr, nruns, steps,
                marks_ptr, mark_base,
                MODE: tl.constexpr, NAN16: tl.constexpr, COUNT_CHANGED: tl.constexpr,
                USE_PTX: tl.constexpr, RUNS: tl.constexpr, MARKS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    b = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)  # fp32 bits
    sign_bit = tl.full([BLOCK], 1, tl.uint32) << 31
    mag = b & 0x7FFFFFFF
    t = b >> 16
    if MODE == 0:  # nearest: round-to-nearest-even, NaN as torch makes it on this device
        o = (b + 0x7FFF + (t & 1)) >> 16
        o = tl.where(mag > 0x7F800000, NAN16, o)
    elif MODE == 3:  # error feedback (casts.error_feedback_step)
        rb = tl.load(res_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
        lo = t << 16
        hi = (t + 1) << 16
        lo_smaller = order_key(lo, sign_bit) < order_key(hi, sign_bit)
        mn = tl.where(lo_smaller, lo, hi)
        mx = tl.where(lo_smaller, hi, lo)
        xv = b.to(tl.float32, bitcast=True)
        rv = rb.to(tl.float32, bitcast=True)
        y = tl.where((rb & 0x7FFFFFFF) == 0, xv, fadd(xv, rv, USE_PTX))  # -0.0 kept when e == 0
        yb = y.to(tl.uint32, bitcast=True)
        yr = ((yb + 0x7FFF + ((yb >> 16) & 1)) >> 16) << 16  # RN(y) as fp32 bits
        # clamp, ties as torch's vectorized clamp: max(a, b) = a > b ? a : b, min(a, b) = a < b ? a : b
        s = tl.where(order_key(yr, sign_bit) > order_key(mn, sign_bit), yr, mn)
        s = tl.where(order_key(s, sign_bit) < order_key(mx, sign_bit), s, mx)
        s = tl.where(((s & 0x7FFFFFFF) == 0x7F800000) & (mag < 0x7F7F8000), lo, s)
        r_new = fsub(y, s.to(tl.float32, bitcast=True), USE_PTX).to(tl.uint32, bitcast=True)
        keep = (mag < 0x7F800000) & ((r_new & 0x7F800000) != 0x7F800000)
        tl.store(res_ptr + offs, tl.where(keep, r_new, 0).to(tl.int32, bitcast=True), mask=mask)
        served = tl.where((yb & 0x7FFFFFFF) > 0x7F800000, NAN16, s >> 16)
        special = tl.where(mag > 0x7F800000, t | 0x40, t)
        o = tl.where(mag < 0x7F800000, served, special)
    else:  # stochastic and dither (casts.round_with_noise)
        if RUNS:  # run r holds elements [offsets[r], offsets[r + 1]) at indices starts[r], starts[r] + 1, ...
            # binary search for the last run starting at or before each element: lo <= r < hi throughout
            lo = tl.zeros([BLOCK], tl.int32)
            hi = tl.full([BLOCK], 0, tl.int32) + nruns
            for _ in range(steps):  # ceil(log2(nruns)) halvings leave hi == lo + 1
                mid = (lo + hi) // 2
                below = tl.load(offsets_ptr + mid) <= offs
                lo = tl.where(below, mid, lo)
                hi = tl.where(below, hi, mid)
            index = tl.load(starts_ptr + lo) + (offs - tl.load(offsets_ptr + lo))
        else:
            index = offs + start
        index_lo = index.to(tl.uint32)  # truncation: index mod 2^32
        index_hi = (index >> 32).to(tl.uint32)
        noise = mix32(mix32(index_lo ^ key.to(tl.uint32, bitcast=True)) ^ index_hi) >> 16
        r = (mag + noise) >> 16
        r = tl.where((mag < 0x7F7F8000) & (r >= 0x7F80), mag >> 16, r)
        o = tl.where(mag > 0x7F800000, t | 0x40, (t & 0x8000) | r)
    o = o & 0xFFFF
    if COUNT_CHANGED:  # the old bits, read before this program overwrites them
        old = tl.load(out_ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
        changed = tl.sum(((old != o) & mask).to(tl.int32), axis=0)
        if MARKS:  # change marks: bit mark_base + i of the 32-bit words at marks_ptr, ORed atomically
            pos = offs + mark_base
            bit = tl.full([BLOCK], 1, tl.int32) << (pos & 31).to(tl.int32)
            tl.atomic_or(marks_ptr + (pos >> 5), bit, mask=(old != o) & mask)
    else:
        changed = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)
    tl.store(out_ptr + offs, o.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    nonfinite = tl.sum((((o & 0x7F80) == 0x7F80) & mask).to(tl.int32), axis=0)
    tl.store(partial_ptr + 2 * pid, changed)
    tl.store(partial_ptr + 2 * pid + 1, nonfinite)


def _use_ptx() -> bool:
    return torch.version.cuda is not None and os.environ.get("TRITON_INTERPRET", "0") != "1"


def cast_into(out: torch.Tensor, x: torch.Tensor, mode: str, *, key: int, start: int,
              residual: torch.Tensor | None, count_changed: bool = True, runs=None,
              marks: torch.Tensor | None = None, mark_base: int = 0) -> tuple[int, int]:
    """Run the Triton kernel on CUDA tensors already checked by ``casts.cast_into``.

    Returns (changed, nonfinite); with ``count_changed=False`` the old output is not read (2 bytes
    less per element) and ``changed`` is reported as -1. ``runs`` (a ``faircast_ds.casting.runs.Runs`` covering
    ``x``): the elements' parameter indices, in place of ``start``; one launch casts them all.
    ``marks``: change marks (a uint8 bitmap of whole 32-bit words on the device,
    :mod:`faircast_ds.casting.marks`) ORed with a 1 at bit ``mark_base + i`` for every element ``i``
    whose bits changed (needs ``count_changed``).
    """
    if marks is not None:
        if not count_changed:
            raise ValueError("change marks need the old bits: count_changed=True")
        check_marks(marks, mark_base, x.numel(), x.device)
    n = x.numel()
    if n == 0:
        return 0, 0
    dst, src, res = contiguous(out, x, residual)
    grid = (n + BLOCK - 1) // BLOCK
    partial = torch.empty((grid, 2), dtype=torch.int32, device=x.device)
    key_i32 = key - (1 << 32) if key >= (1 << 31) else key  # always an i32 argument
    if runs is not None:
        offsets, starts = runs.on(x.device)
        nruns = starts.numel()
        steps = (nruns - 1).bit_length()
    else:
        offsets = starts = partial  # not read
        nruns, steps = 1, 0
    cast_kernel[(grid,)](
        src.view(torch.int32), (res if res is not None else src).view(torch.int32), dst.view(torch.int16), partial,
        n, start, key_i32, offsets, starts, nruns, steps,
        marks.view(torch.int32) if marks is not None else partial, mark_base,
        MODE=kernel_code(mode, "triton"), NAN16=torch_nan16(x.device), COUNT_CHANGED=count_changed, USE_PTX=_use_ptx(),
        RUNS=runs is not None, MARKS=marks is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)
    write_back(out, dst, residual, res)
    changed, nonfinite = partial.sum(0, dtype=torch.int64).tolist()
    return (changed if count_changed else -1), nonfinite
