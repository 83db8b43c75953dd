"""The engine's rollouts (issue 49 item 1): the bf16 -> fp32 conversion of each weight inside
faircast_ds/vllm/cpu_gemm.py's ``linear``, whole at once or in blocks of output rows, at a decode batch.

``linear`` converts a layer's bf16 weight to fp32 ``weight_rows`` output rows at a time (``WEIGHT_ROWS``, since
2026-12-07) and multiplies each block by every block of input rows before it converts the next; before, it
converted the whole weight at every call. Both forms are the shipped ``linear`` itself (``weight_rows`` = the
weight's rows, against ``--block``). For SmolLM2-135M's linear layers (fused qkv and gate/up as vLLM holds them, 30 layers) and its tied LM
head, one decode step of 16 rows, this times both forms alternately (``--repeats``), prints the medians and
their ratio, and whether every bf16 output is the same to the bit (the product of a block of output rows is its
rows of the whole product if the fp32 GEMM's sums along the input dimension do not depend on how many output
rows share the call: measured here, not assumed).

    python3 benchmarks/engine_gemm_blocks.py [--threads 2] [--block 512] [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from faircast_ds.vllm.cpu_gemm import linear

# (out, in) of SmolLM2-135M's linear layers as vLLM fuses them, then the tied head
LAYERS = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rows", type=int, default=16, help="the decode batch (608: a prefill of 16 prompts of 38 tokens)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen).bfloat16() for shape in LAYERS]
    inputs = {n: torch.randn(args.rows, n, generator=gen).bfloat16() for n in {c for _, c in LAYERS}}

    def step(form) -> tuple[float, list[torch.Tensor]]:
        began = time.perf_counter()
        outs = [form(inputs[w.shape[1]], w) for w in weights]
        return time.perf_counter() - began, outs

    a, b, same = [], [], True
    for _ in range(args.repeats):
        ta, oa = step(lambda x, w: linear(x, w, weight_rows=w.shape[0]))
        tb, ob = step(lambda x, w: linear(x, w, weight_rows=args.block))
        a.append(ta)
        b.append(tb)
        same = same and all(torch.equal(u, v) for u, v in zip(oa, ob))
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"{args.threads} thread(s), one step of {args.rows} rows over SmolLM2-135M's linear layers and head: "
          f"whole-weight conversion {ma * 1e3:.0f} ms, {args.block}-row blocks {mb * 1e3:.0f} ms (medians of "
          f"{args.repeats}), ratio {mb / ma:.2f}; every output the same to the bit: {same}")


if __name__ == "__main__":
    main()
