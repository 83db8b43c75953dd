"""The engine's fp32 products with and without the weights' fp32 copies kept between forwards (issue 49 item 1;
``FAIRCAST_VLLM_CPU_GEMM_CACHE``, faircast_ds/vllm/cpu_gemm.py).

Both forms call ``faircast_ds.vllm.cpu_gemm.linear`` itself over SmolLM2-135M's linear layers as vLLM holds them
(fused qkv and gate/up, 30 layers) and its tied LM head, at a decode batch (``--rows 16``) or a prefill
(``--rows 608 --no-head``): "convert" converts every weight to fp32 at every call, as a forward does without the
copies; "copies" passes an armed ``WeightCopies`` filled once beforehand, as a worker's forwards do between two
weight updates. The forms run alternately (``--repeats``); prints the medians, their ratio, and whether every bf16
output is the same to the bit.

    python3 benchmarks/engine_gemm_cache.py [--threads 2] [--rows 16] [--repeats 7]
    python3 benchmarks/engine_gemm_cache.py --rows 608 --no-head
"""
from __future__ import annotations

import statistics

import torch

from engine_gemm_blocks import smollm2_products
from faircast_ds.vllm.cpu_gemm import WeightCopies, linear
from timing import alternately


def main() -> None:
    args, weights, inputs = smollm2_products(__doc__)
    copies = WeightCopies()
    copies.armed = True
    for w in weights:  # filled once, as by the first forward after a weight update
        linear(inputs[w.shape[1]], w, copies=copies)
    runs = alternately({"convert": lambda: [linear(inputs[w.shape[1]], w) for w in weights],
                        "copies": lambda: [linear(inputs[w.shape[1]], w, copies=copies) for w in weights]},
                       args.repeats)
    ma, mb = (statistics.median(t for t, _ in runs[form]) for form in ("convert", "copies"))
    same = all(torch.equal(u.view(torch.int16), v.view(torch.int16))
               for (_, oa), (_, ob) in zip(runs["convert"], runs["copies"]) for u, v in zip(oa, ob))
    print(f"{args.threads} thread(s), {args.rows} rows through SmolLM2-135M's linear layers"
          f"{' and head' if args.head else ''}: convert {ma * 1e3:.0f} ms, copies {mb * 1e3:.0f} ms (medians of "
          f"{args.repeats}), ratio {mb / ma:.2f}; copies kept {copies.nbytes / 2**20:.0f} MiB; every output the same "
          f"to the bit: {same}")


if __name__ == "__main__":
    main()
