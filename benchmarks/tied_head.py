"""What keeping a tied LM head honest costs a push on a CPU where vLLM packs it (oneDNN builds a bf16
matmul): the refresh after a load that carried the embedding (one repack of the head, what
``kernels.refresh_tied_heads`` makes vLLM do) and a sampled check's read of the head (64 sampled columns
plus up to 64 a delta touched: 128 identity rows through the packed kernel), at Qwen3-0.6B's head
(151,936 × 1,024 bf16), beside a copy of the same bytes. Best of 3; prints why it cannot measure where
oneDNN builds no bf16 matmul (the head then reads the embedding live and nothing is repacked).

    python benchmarks/tied_head.py [--threads 2]
"""
from __future__ import annotations

import argparse

import torch

from timing import best

VOCAB, HIDDEN, ROWS = 151_936, 1_024, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import vllm._custom_ops as ops

    torch.manual_seed(0)
    weight = (torch.randn(VOCAB, HIDDEN) * 0.02).to(torch.bfloat16)
    try:
        packed = ops.create_onednn_mm(weight.t(), 32)
    except (RuntimeError, AttributeError) as exc:
        print(f"oneDNN builds no bf16 matmul on this CPU ({str(exc).splitlines()[0][:120]}): a tied head reads "
              "the embedding live and a load repacks nothing")
        return
    probe = torch.zeros(ROWS, HIDDEN, dtype=torch.bfloat16)
    probe[torch.arange(ROWS), torch.arange(0, HIDDEN, HIDDEN // ROWS)] = 1
    repack = best(lambda: ops.create_onednn_mm(weight.t(), 32))
    read = best(lambda: ops.onednn_mm(packed, probe, None))
    copy = best(lambda: weight.clone())
    print(f"a tied head of {VOCAB:,} x {HIDDEN:,} bf16 ({VOCAB * HIDDEN * 2 / 2**20:,.0f} MiB), {args.threads} thread(s)")
    print(f"refresh (one oneDNN repack)           {repack * 1e3:8.1f} ms  {repack / copy:5.2f} x a copy")
    print(f"sampled check's read ({ROWS} columns)    {read * 1e3:8.1f} ms  {read / copy:5.2f} x a copy")
    print(f"copy of the same bytes                {copy * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
