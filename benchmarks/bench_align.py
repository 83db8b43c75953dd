"""Cost of rounding-location alignment: aligned vs HF eager forward+backward, side by side.

    python benchmarks/bench_align.py [--engine sglang] [--attn sdpa] [--repeats 15] [--threads 1]

Builds a small-but-not-tiny Qwen3 in bf16 on CPU (hidden 256, 4 layers, seq 256, batch 4),
alternates eager and aligned training steps (forward + backward of the next-token loss) so both
see the same machine state, and prints min-of-repeats times, their ratio, and the median of the
ratios of adjacent (eager, aligned) pairs, which holds up better on a shared machine. Times are
only compared with each other, never with a fixed number.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from faircast_ds.align import ENGINES, REGIONS, align_model
from faircast_bench.builders import tiny_causal_lm


def build(attn: str) -> torch.nn.Module:
    return tiny_causal_lm("qwen3", seed=0, init_std=0.02, as_from_pretrained=False, attn=attn, vocab_size=4096,
                          hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=32).train()


def step_seconds(model: torch.nn.Module, input_ids: torch.Tensor) -> float:
    """Wall time of one forward + backward of the next-token loss."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    logits = model(input_ids=input_ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())
    loss.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="sglang", choices=ENGINES)
    parser.add_argument("--regions", nargs="+", default=list(REGIONS), choices=REGIONS)
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = build(args.attn)
    shape, generator = (args.batch, args.seq), torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, model.config.vocab_size, shape, generator=generator)
    handle = align_model(model, args.engine, args.regions)
    handle.remove()

    times: dict[str, list[float]] = {"eager": [], "aligned": []}
    for i in range(args.warmup + args.repeats):
        for kind in ("eager", "aligned"):  # interleaved: drift in machine state hits both
            if kind == "aligned":
                handle = align_model(model, args.engine, args.regions)
            seconds = step_seconds(model, input_ids)
            if kind == "aligned":
                handle.remove()
            if i >= args.warmup:
                times[kind].append(seconds)

    eager, aligned = min(times["eager"]), min(times["aligned"])
    paired = sorted(a / e for a, e in zip(times["aligned"], times["eager"], strict=True))
    print(
        f"Qwen3 h=256 L=4 seq={args.seq} batch={args.batch} bf16 CPU threads={torch.get_num_threads()} "
        f"attn={args.attn} engine={args.engine} regions={','.join(handle.regions)}"
    )
    print(f"eager   fwd+bwd min of {args.repeats}: {eager * 1e3:8.1f} ms")
    print(f"aligned fwd+bwd min of {args.repeats}: {aligned * 1e3:8.1f} ms")
    print(f"ratio aligned/eager (min/min): {aligned / eager:.3f}")
    print(f"ratio aligned/eager (median of adjacent pairs): {paired[len(paired) // 2]:.3f}")


if __name__ == "__main__":
    main()
