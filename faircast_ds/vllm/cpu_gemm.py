"""The engine's bf16 matrix products on CPU computed as fp32 products of the bf16 values, rounded once.

vLLM's CPU build routes every unquantized linear layer and LM head through one dispatcher
(``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``): oneDNN where it builds a bf16 matmul
(a CPU with AVX-512 BF16 or AMX), otherwise ``torch.nn.functional.linear`` in bf16, PyTorch's generic loop.
On an AVX2 CPU that loop is 5-13x slower than an fp32 product of the same values (SmolLM2's shapes, one
thread: the tied LM head at a decode batch of 16, 320 ms against 45 ms), and sampling 16 answers of 16
tokens from SmolLM2-135M took ~24 s.

``FAIRCAST_VLLM_CPU_GEMM=fp32`` in a vLLM process's environment (``VllmServer(gemm="fp32")``, the GRPO job's
``--engine-gemm fp32``) makes that dispatcher give every 2-D bf16 layer
:func:`faircast_ds.models.gemm.fp32_linear`: the exact products of the bf16 input and weight, summed in fp32,
rounded once to bf16 — the arithmetic of a GPU's bf16 GEMM and of the trainer's ``--gemm fp32``, and of
PyTorch's own fallback up to the order of the sums (on random matrices 0.01-0.02% of outputs differ from it,
each by the last bit). So the engine's sampled tokens may differ from a stock CPU engine's; the weights it
computes with do not: the layer reads its live ``.weight`` at every call (nothing is packed or copied at
load), so a reload or an in-place delta is what the next product uses, and ``/weight_checker`` reads the same
bits through it. ``native`` (or unset) leaves vLLM's dispatch alone. Any other value stops the process at
start naming the variable.
"""
from __future__ import annotations

import os
import sys

ENV = "FAIRCAST_VLLM_CPU_GEMM"
CHOICES = ("native", "fp32")


def chosen(environ=os.environ) -> str:
    """The environment's choice; a value not in :data:`CHOICES` is an error naming the variable."""
    value = environ.get(ENV, "native").strip() or "native"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: choose from {', '.join(CHOICES)}")
    return value


def install(environ=os.environ) -> bool:
    """Route vLLM's CPU GEMM dispatch through fp32 products when the environment asks for it (idempotent).
    Returns whether the dispatch is now the fp32 one."""
    if chosen(environ) != "fp32":
        return False
    from vllm.model_executor.layers import utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "faircast_fp32", False):
        return True
    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer, remove_weight: bool) -> None:
        import torch

        weight = layer.weight
        if weight.is_meta or weight.ndim != 2 or weight.dtype != torch.bfloat16:
            return original(layer, remove_weight)  # not a bf16 matrix: vLLM's own choice
        from faircast_ds.models.gemm import fp32_linear

        layer.cpu_linear = fp32_linear  # called with the layer's live weight each time

    dispatch.faircast_fp32 = True
    utils.dispatch_cpu_unquantized_gemm = dispatch
    print(f"[fair_cast] {ENV}=fp32: this vLLM process computes its bf16 matrix products on CPU from fp32 sums "
          f"of the bf16 values, rounded once (pid {os.getpid()})", file=sys.stderr, flush=True)
    return True
