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

**The fp32 copies (``FAIRCAST_VLLM_CPU_GEMM_CACHE=1``).** Converting every weight to fp32 at every forward was a
third of the engine worker's samples in its products (py-spy during the SmolLM2 campaign); timed alone, keeping the
copies saves 7-9% of a decode step's products (SmolLM2-135M, 16 rows, 2 threads: 105 -> 98 ms;
benchmarks/engine_gemm_cache.py), since the copies are read at 4 bytes per weight where the conversion read 2. With
the variable set, a ``vllm serve`` worker keeps each weight's fp32 blocks from one forward to the next, and drops
them all whenever its worker is asked for anything but a forward: the worker's RPC loop
(``WorkerProc._execute_worker_rpc``) runs ``execute_model`` and ``sample_tokens`` with the copies and every other
call (a weight update, a reload, ``/weight_checker``, a pickled function) without them, emptying them first. A
served engine's weights change only inside such calls, so a forward computes with the weights as they are then; the
products are the same calls on the same fp32 values, so the same bits (tests/vllm_tests/test_cpu_gemm.py). An
engine whose worker runs in its caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, TRL's colocated engine, an
external launcher), where the caller may write the weights directly, never arms the copies. This rests on vLLM's
worker running every call in one loop (vLLM 0.32's CPU build: the multiprocess executor, no async scheduling);
calls that run every step without touching the weights but are not forwards (``take_draft_token_ids`` under
speculative decoding, ``execute_dummy_batch`` under data parallelism) would drop the copies each time: slower, not
wrong. The price: 4 bytes per weight element (513 MiB for SmolLM2-135M). ``0`` or unset: no copies; needs
``FAIRCAST_VLLM_CPU_GEMM=fp32``.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

import torch

ENV = "FAIRCAST_VLLM_CPU_GEMM"
CHOICES = ("native", "fp32")
ROWS = 16  # the fixed block of rows each fp32 product is computed in (a decode batch of up to 16 is one call)
WEIGHT_ROWS = 512  # output rows of the weight converted to fp32 at a time (see linear)
CACHE_ENV = "FAIRCAST_VLLM_CPU_GEMM_CACHE"
FORWARDS = ("execute_model", "sample_tokens")  # the worker calls that may use the fp32 copies


class WeightCopies:
    """The fp32 blocks of each weight (as :func:`linear` converts them), kept from one forward to the next.
    Used only while :attr:`armed`: :meth:`during` arms it for a forward and, for any other call, empties it
    before the call, which runs unarmed."""

    def __init__(self) -> None:
        self.armed = False
        self._blocks: dict[tuple, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.fills = self.hits = self.drops = 0
        self.announced = False  # the worker's log said it keeps copies

    def __len__(self) -> int:
        return len(self._blocks)

    def blocks(self, weight: torch.Tensor, weight_rows: int) -> list[torch.Tensor] | None:
        """``weight``'s fp32 blocks of ``weight_rows`` output rows, kept or made now; None when unarmed."""
        if not self.armed:
            return None
        key = (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, weight_rows)
        entry = self._blocks.get(key)
        if entry is None:
            # each block converted on its own, as linear converts it uncached: the same tensors to the bit
            blocks = [weight[j:j + weight_rows].float() for j in range(0, weight.shape[0], weight_rows)]
            self._blocks[key] = entry = (weight, blocks)  # the weight held: its address is not reused meanwhile
            self.fills += 1
        else:
            self.hits += 1
        return entry[1]

    def drop(self) -> None:
        if self._blocks:
            self.drops += 1
        self._blocks.clear()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for _, blocks in self._blocks.values() for b in blocks)

    @contextlib.contextmanager
    def during(self, method: Any) -> Iterator[None]:
        """Around one worker call: ``method`` is its name (a pickled function is anything else)."""
        if method in FORWARDS:
            self.armed = True
            try:
                yield
            finally:
                self.armed = False
            return
        self.drop()  # nothing is kept while the call runs (it is unarmed), so the next forward fills afresh
        yield


COPIES = WeightCopies()  # this process's (install arms it in a multiprocess vLLM worker)


def linear(x, weight, bias=None, *, weight_rows=WEIGHT_ROWS, copies=None):
    """``round_bf16(x @ weight.T + bias)`` from fp32 products and sums of the bf16 values, in blocks of
    :data:`ROWS` rows so that each row's bits do not depend on the rows beside it.

    The weight is converted to fp32 ``weight_rows`` output rows at a time, and each converted block is multiplied
    by every block of input rows in one batched product (``torch.bmm`` of ROWS-row problems) before the next block
    is made: it stays in cache, and there is one call (one fork and join of the threads) per weight block instead
    of one per row block (``benchmarks/engine_gemm_blocks.py`` times it against the earlier form). The bits are
    those of one fp32 product per row block of the whole weight when the GEMM's sums along the input dimension
    depend neither on how many output rows share the call nor on the batch around a problem: measured on this
    CPU's kernels at 1 and 2 threads, and checked by tests/vllm_tests/test_cpu_gemm.py.

    ``copies``: a :class:`WeightCopies` whose blocks are used while it is armed (the same fp32 tensors)."""
    flat = x.reshape(-1, x.shape[-1]).float()
    rows, n_out = flat.shape[0], weight.shape[0]
    if rows == 0:
        return x.new_empty(*x.shape[:-1], n_out)
    pad = -rows % ROWS
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
    blocks = flat.view(-1, ROWS, flat.shape[1])  # [row blocks, ROWS, in]
    out = flat.new_empty(blocks.shape[0], ROWS, n_out)
    kept = copies.blocks(weight, weight_rows) if copies is not None else None
    for k, j in enumerate(range(0, n_out, weight_rows)):
        w = kept[k] if kept is not None else weight[j:j + weight_rows].float()
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


def copies_chosen(environ=os.environ) -> bool:
    """Whether the environment asks for the fp32 copies (:data:`CACHE_ENV`: 1, or 0 / unset); they need the fp32
    products. Anything else is an error naming the variable."""
    value = environ.get(CACHE_ENV, "0").strip() or "0"
    if value not in ("0", "1"):
        raise ValueError(f"{CACHE_ENV}={value!r}: 1 (keep fp32 copies of the weights between forwards) or 0")
    if value == "1" and chosen(environ) != "fp32":
        raise ValueError(f"{CACHE_ENV}=1 keeps fp32 copies for the fp32 products: it needs {ENV}=fp32, "
                         f"not {chosen(environ)!r}")
    return value == "1"


def install(environ=os.environ) -> bool:
    """Send vLLM's CPU GEMM dispatch through fp32 products when the environment asks for it (idempotent), and
    with :data:`CACHE_ENV` set, keep the weights' fp32 copies between a multiprocess worker's forwards.
    Returns whether the dispatch is now the fp32 one."""
    keep = copies_chosen(environ)
    if chosen(environ) != "fp32":
        return False
    from vllm.model_executor.layers import utils

    if keep:
        _arm_in_workers()
    if getattr(utils.dispatch_cpu_unquantized_gemm, "faircast_fp32", False):
        return True
    original = utils.dispatch_cpu_unquantized_gemm

    def with_copies(x, weight, bias=None):  # COPIES is armed only by _arm_in_workers' wrapper: unarmed, none kept
        return linear(x, weight, bias, copies=COPIES)

    def dispatch(layer, remove_weight: bool) -> None:
        weight = layer.weight
        if weight.is_meta or weight.ndim != 2 or weight.dtype != torch.bfloat16:
            return original(layer, remove_weight)  # not a bf16 matrix: vLLM's own choice
        layer.cpu_linear = with_copies  # called with the layer's live weight each time

    dispatch.faircast_fp32 = True
    utils.dispatch_cpu_unquantized_gemm = dispatch
    kept = f"; {CACHE_ENV}=1: a worker keeps the weights' fp32 copies between its forwards" if keep else ""
    print(f"[fair_cast] {ENV}=fp32: this vLLM process computes its bf16 matrix products on CPU from fp32 sums "
          f"of the bf16 values, rounded once{kept} (pid {os.getpid()})", file=sys.stderr, flush=True)
    return True


def _arm_in_workers() -> None:
    """Wrap vLLM's multiprocess worker RPC loop so that :data:`COPIES` is armed for forwards only (idempotent)."""
    from vllm.v1.executor import multiproc_executor

    proc = multiproc_executor.WorkerProc
    original = getattr(proc, "_execute_worker_rpc", None)
    if original is None:
        import vllm

        raise RuntimeError(f"{CACHE_ENV}=1 needs vLLM's WorkerProc._execute_worker_rpc to know when the weights may "
                           f"change; vLLM {vllm.__version__} has none: unset {CACHE_ENV}")
    if getattr(original, "faircast_copies", False):
        return

    def _execute_worker_rpc(self, rpc_request):
        with COPIES.during(rpc_request[0]):
            original(self, rpc_request)
        if COPIES.hits and not COPIES.announced:  # once per process, after the first forward that reused copies
            COPIES.announced = True
            print(f"[fair_cast] {CACHE_ENV}=1: this worker keeps fp32 copies of {len(COPIES)} weights "
                  f"({COPIES.nbytes / 2**20:.0f} MiB) between its forwards and reused them (pid {os.getpid()})",
                  file=sys.stderr, flush=True)

    _execute_worker_rpc.faircast_copies = True
    proc._execute_worker_rpc = _execute_worker_rpc
