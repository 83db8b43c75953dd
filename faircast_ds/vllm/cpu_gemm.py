"""The engine's bf16 matrix products on CPU computed as fp32 products of the bf16 values, rounded once.

vLLM's CPU build sends every unquantized linear layer and LM head through one dispatcher
(``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``): oneDNN where it builds a bf16 matmul
(a CPU with AVX-512 BF16 or AMX), otherwise ``torch.nn.functional.linear`` in bf16, PyTorch's generic loop.
On an AVX2 CPU that loop is 5-13x slower than an fp32 product of the same values (SmolLM2's shapes, one
thread: the tied LM head at a decode batch of 16, 320 ms against 45 ms), and sampling 16 answers of 16
tokens from SmolLM2-135M took ~24 s.

``FAIRCAST_VLLM_CPU_GEMM=fp32`` in a vLLM process's environment (``VllmServer(gemm="fp32")``, the GRPO job's
``--engine-gemm fp32``, the TRL recipe's ``--gemm``) makes that dispatcher give every 2-D bf16 layer
:func:`linear`: the exact products of the bf16 input and weight, summed in fp32, rounded once to bf16 — the
arithmetic of a GPU's bf16 GEMM and of the trainer's ``--gemm fp32`` (faircast_ds/models/gemm.py), and of
PyTorch's own fallback up to the order of the sums (on random matrices 0.01-0.03% of outputs differ from it,
each by the last bit), so the engine's sampled tokens may differ from a stock CPU engine's.

**Batch-invariant.** An fp32 GEMM library picks its blocking by the number of rows, so a row's sums (and now
and then its rounded bf16) would depend on how many other requests shared its forward, which depends on when
requests arrive. :func:`linear` multiplies in fixed blocks of :data:`ROWS` rows (the last one padded with
zeros): a row's bits are then those of the row alone, wherever it sits and whatever shares its call (measured
here on this CPU's fp32 kernels at 1 and 2 threads, and checked by tests/vllm_tests/test_cpu_gemm.py), so the
engine samples the same tokens from the same weights and seeds run after run, as with vLLM's own loop.

The weights are the engine's own: the layer reads its live ``.weight`` at every call (nothing is packed or
copied at load), so a reload or an in-place delta is what the next product uses, and ``/weight_checker`` reads
the same bits through it. ``native`` (or unset) leaves vLLM's dispatch alone. Any other value stops the process
at start naming the variable.
"""
from __future__ import annotations

import os
import sys

import torch

ENV = "FAIRCAST_VLLM_CPU_GEMM"
CHOICES = ("native", "fp32")
ROWS = 16  # the fixed block of rows each fp32 product is computed in (a decode batch of up to 16 is one call)
WEIGHT_ROWS = 512  # output rows of the weight converted to fp32 at a time (see linear)


def linear(x, weight, bias=None, *, weight_rows=WEIGHT_ROWS):
    """``round_bf16(x @ weight.T + bias)`` from fp32 products and sums of the bf16 values, in blocks of
    :data:`ROWS` rows so that each row's bits do not depend on the rows beside it.

    The weight is converted to fp32 ``weight_rows`` output rows at a time, and each converted block is multiplied
    by every block of input rows in one batched product (``torch.bmm`` of ROWS-row problems) before the next block
    is made: it stays in cache, and there is one call (one fork and join of the threads) per weight block instead
    of one per row block (``benchmarks/engine_gemm_blocks.py`` times it against the earlier form). The bits are
    those of one fp32 product per row block of the whole weight when the GEMM's sums along the input dimension
    depend neither on how many output rows share the call nor on the batch around a problem: measured on this
    CPU's kernels at 1 and 2 threads, and checked by tests/vllm_tests/test_cpu_gemm.py."""
    flat = x.reshape(-1, x.shape[-1]).float()
    rows, n_out = flat.shape[0], weight.shape[0]
    if rows == 0:
        return x.new_empty(*x.shape[:-1], n_out)
    pad = -rows % ROWS
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
    blocks = flat.view(-1, ROWS, flat.shape[1])  # [row blocks, ROWS, in]
    out = flat.new_empty(blocks.shape[0], ROWS, n_out)
    for j in range(0, n_out, weight_rows):
        w = weight[j:j + weight_rows].float()
        wt = w.t().expand(blocks.shape[0], *w.t().shape)  # the same block for every row block: a view, no copy
        if bias is None:
            out[:, :, j:j + weight_rows] = torch.bmm(blocks, wt)
        else:
            b = bias[j:j + weight_rows].float().expand(blocks.shape[0], ROWS, w.shape[0])
            out[:, :, j:j + weight_rows] = torch.baddbmm(b, blocks, wt)
    return out.view(-1, n_out)[:rows].to(x.dtype).reshape(*x.shape[:-1], n_out)


def chosen(environ=os.environ) -> str:
    """The environment's choice; a value not in :data:`CHOICES` is an error naming the variable."""
    value = environ.get(ENV, "native").strip() or "native"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: choose from {', '.join(CHOICES)}")
    return value


def install(environ=os.environ) -> bool:
    """Send vLLM's CPU GEMM dispatch through fp32 products when the environment asks for it (idempotent).
    Returns whether the dispatch is now the fp32 one."""
    if chosen(environ) != "fp32":
        return False
    from vllm.model_executor.layers import utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "faircast_fp32", False):
        return True
    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer, remove_weight: bool) -> None:
        weight = layer.weight
        if weight.is_meta or weight.ndim != 2 or weight.dtype != torch.bfloat16:
            return original(layer, remove_weight)  # not a bf16 matrix: vLLM's own choice
        layer.cpu_linear = linear  # called with the layer's live weight each time

    dispatch.faircast_fp32 = True
    utils.dispatch_cpu_unquantized_gemm = dispatch
    print(f"[fair_cast] {ENV}=fp32: this vLLM process computes its bf16 matrix products on CPU from fp32 sums "
          f"of the bf16 values, rounded once (pid {os.getpid()})", file=sys.stderr, flush=True)
    return True
