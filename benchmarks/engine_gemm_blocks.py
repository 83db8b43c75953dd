"""The engine's fp32 products (issue 49 item 1): faircast_ds/vllm/cpu_gemm.py's ``linear`` as shipped against the
form it had until 2026-12-07, over SmolLM2-135M's linear layers, at a decode batch or a prefill.

Before (written out here, as it was shipped until commit 3c12b9d): convert the layer's whole bf16 weight to fp32
at every call, then one ``F.linear`` per block of 16 input rows. Now (``cpu_gemm.linear`` itself): the weight
converted ``WEIGHT_ROWS`` output rows at a time, each block multiplied by every block of 16 input rows in one
batched product (``torch.bmm`` of 16-row problems), so a converted block stays in cache and the calls, each
a fork and join of the threads, go from one per row block to one per weight block. For SmolLM2's layers (fused
qkv and gate/up as vLLM holds them, 30 layers) and, with ``--head``, its tied LM head (vLLM computes the head
on the last row of each request only: 16 rows at a prefill of 16 prompts too), this times both forms
alternately (``--repeats``), prints the medians and their ratio, and whether every bf16 output is the same to
the bit.

    python3 benchmarks/engine_gemm_blocks.py [--threads 2] [--rows 16] [--repeats 7]
    python3 benchmarks/engine_gemm_blocks.py --rows 608 --no-head   # a prefill of 16 prompts of 38 tokens
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from faircast_ds.vllm.cpu_gemm import ROWS, linear
from timing import alternately

# (out, in) of SmolLM2-135M's linear layers as vLLM fuses them; the tied head apart
LAYERS = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
HEAD = (49152, 576)


def before(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """cpu_gemm.linear as shipped until 3c12b9d (no bias: SmolLM2 has none)."""
    flat = x.reshape(-1, x.shape[-1]).float()
    rows = flat.shape[0]
    w = weight.float()
    pad = -rows % ROWS
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
    out = torch.cat([F.linear(flat[i:i + ROWS], w) for i in range(0, flat.shape[0], ROWS)])[:rows]
    return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def smollm2_products(doc: str) -> tuple[argparse.Namespace, list[torch.Tensor], dict[int, torch.Tensor]]:
    """The command line both engine-products benchmarks take (this one and engine_gemm_cache.py), with the
    threads it asks for set: SmolLM2's weights (and head unless ``--no-head``) and a bf16 input per input width."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rows", type=int, default=16, help="rows per layer (16: a decode step of 16 rollouts; 608: "
                   "the prefill of 16 prompts of 38 tokens)")
    p.add_argument("--no-head", dest="head", action="store_false", help="leave the LM head out (a prefill: vLLM "
                   "computes it on each request's last row only)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes = LAYERS + ([HEAD] if args.head else [])
    weights = [torch.randn(shape, generator=gen).bfloat16() for shape in shapes]
    inputs = {n: torch.randn(args.rows, n, generator=gen).bfloat16() for n in {c for _, c in shapes}}
    return args, weights, inputs


def main() -> None:
    args, weights, inputs = smollm2_products(__doc__)
    runs = alternately({"before": lambda: [before(inputs[w.shape[1]], w) for w in weights],
                        "now": lambda: [linear(inputs[w.shape[1]], w) for w in weights]}, args.repeats)
    ma, mb = (statistics.median(t for t, _ in runs[form]) for form in ("before", "now"))
    same = all(torch.equal(u, v) for (_, oa), (_, ob) in zip(runs["before"], runs["now"]) for u, v in zip(oa, ob))
    print(f"{args.threads} thread(s), {args.rows} rows through SmolLM2-135M's linear layers"
          f"{' and head' if args.head else ''}: before {ma * 1e3:.0f} ms, now {mb * 1e3:.0f} ms (medians of "
          f"{args.repeats}), ratio {mb / ma:.2f}; every output the same to the bit: {same}")


if __name__ == "__main__":
    main()
