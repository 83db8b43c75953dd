"""ZeRO-3 training-step time with fair_cast, against DeepSpeed's own round-to-nearest, side by side.

    deepspeed --num_gpus 2 benchmarks/bench_step.py [--hidden 256] [--steps 30] [--repeats 3]

Prints, per configuration, the minimum step time over interleaved repeats and its ratio to the run
without fair_cast (the same model, data and optimizer). Also diagnostics every step vs off.
Ratios from one run on one machine; never compare absolute times across machines.
"""
from __future__ import annotations

import argparse
import os
import time

import deepspeed
import deepspeed.comm as dist
import torch

from faircast_jobs.staleness import build_model

CONFIGS = {
    "deepspeed (no fair_cast)": None,
    "nearest": {"mode": "nearest", "diagnostics": {"every": 0}},
    "stochastic": {"mode": "stochastic", "diagnostics": {"every": 0}},
    "dither": {"mode": "dither", "diagnostics": {"every": 0}},
    "error_feedback": {"mode": "error_feedback", "diagnostics": {"every": 0}},
    "stochastic + diagnostics every step": {"mode": "stochastic", "diagnostics": {"every": 1}},
}


def step_time(section: dict | None, args: argparse.Namespace) -> float:
    model = build_model(args.hidden, args.layers, args.vocab, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-6)
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "bf16": {"enabled": True}, "steps_per_print": 10**9,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000}}
    if section is not None:
        cfg["fair_cast"] = {"enabled": True, "seed": 1, **section}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    g = torch.Generator().manual_seed(dist.get_rank())
    times = []
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        dist.barrier()
        start = time.perf_counter()
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo" if os.environ.get("DS_ACCELERATOR") == "cpu" else None)
    best: dict[str, float] = {}
    for _ in range(args.repeats):  # interleaved, so slow phases of a noisy machine hit every config
        for name, section in CONFIGS.items():
            t = step_time(section, args)
            best[name] = min(best.get(name, float("inf")), t)
    if dist.get_rank() == 0:
        base = best["deepspeed (no fair_cast)"]
        print(f"\nZeRO-3 step time, {dist.get_world_size()} ranks, hidden {args.hidden}, {args.layers} layers "
              f"(min over {args.repeats} x {args.steps} steps):")
        print(f"{'configuration':<38} {'step ms':>9} {'ratio':>7}")
        for name, t in best.items():
            print(f"{name:<38} {1000 * t:9.2f} {t / base:7.3f}")
    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
