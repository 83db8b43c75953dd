"""A lead for the SmolLM2 step (issue 49 item 1): the trainer's attention products in bf16 against fp32.

``--gemm fp32`` sends the trainer's linear layers through fp32 products (faircast_ds/models/gemm.py), but HF's
eager attention still multiplies its bf16 query, key and value with ``torch.matmul`` in bf16, which on a CPU
without AVX-512 is PyTorch's generic loop (a profile of a training rank: ``bf16_dot_with_fp32_arith`` and
``cpublas_gemm_impl`` under the attention's forward and backward). This times SmolLM2-135M's attention
products for one rank's batch (8 sequences of 54 tokens, 9 heads of 64, 30 layers), forward and backward, with
the tensors in bf16 and in fp32 (softmax in fp32 in both, as HF's eager attention does), alternately, and prints
the medians and their ratio. fp32 products would change the order of the trainer's sums, so the trajectory is
not the same: the campaign cannot take it midway (docs/pretrained.md).

    python3 benchmarks/trainer_attention.py [--threads 1] [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics

import torch
from timing import alternately

BATCH, HEADS, TOKENS, HEAD_DIM, LAYERS = 8, 9, 54, 64, 30


def inputs(dtype: torch.dtype, gen: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor]:
    qkv = [torch.randn(BATCH, HEADS, TOKENS, HEAD_DIM, generator=gen).to(dtype).requires_grad_() for _ in range(3)]
    return qkv, torch.full((TOKENS, TOKENS), float("-inf")).triu(1).to(dtype)


def attention_pass(qkv: list[torch.Tensor], mask: torch.Tensor) -> None:
    for t in qkv:
        t.grad = None  # each pass from fresh gradients, as a training step's backward
    q, k, v = qkv
    for _ in range(LAYERS):
        scores = torch.matmul(q, k.transpose(2, 3)) * HEAD_DIM ** -0.5 + mask
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        torch.matmul(weights, v).sum().backward()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="one training rank's threads (2 ranks on 2 cores)")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    bf16, fp32 = inputs(torch.bfloat16, gen), inputs(torch.float32, gen)
    runs = alternately({"bf16": lambda: attention_pass(*bf16), "fp32": lambda: attention_pass(*fp32)}, args.repeats)
    b, f = (statistics.median(t for t, _ in runs[dtype]) for dtype in ("bf16", "fp32"))
    print(f"{args.threads} thread(s), SmolLM2-135M's attention products for {BATCH} sequences of {TOKENS} tokens, "
          f"{LAYERS} layers, forward and backward: bf16 {b * 1e3:.0f} ms, fp32 {f * 1e3:.0f} ms (medians of "
          f"{args.repeats}), fp32 / bf16 {f / b:.2f}")


if __name__ == "__main__":
    main()
