"""One AdamW step over one rank's fp32 master shard, torch's per-tensor loop against its fused CPU kernel, side
by side in one run (the GRPO job's ``--adamw loop`` / ``--adamw fused``; issue 49 item 1's optimizer stage).

    python3 benchmarks/adamw_step.py [--elements 67000000] [--threads 1] [--rounds 3]

The default shard is SmolLM2-135M-Instruct's per rank under ZeRO-3 on 2 ranks (~67M elements); one thread, as
each of the job's two ranks has on this 2-core machine. Each round times one step of each kind, alternated
(after a first, untimed step that builds AdamW's state); prints the minimum and median per kind and
fused / loop. Both take the same update up to the order of their float operations
(tests/jobs/test_job_pretrained.py::test_both_adamws_take_the_adamw_step_written_out_in_float64).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from timing import alternately


def optimizer(elements: int, fused: bool) -> torch.optim.Optimizer:
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(elements, generator=gen))
    p.grad = torch.randn(elements, generator=gen) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-5, weight_decay=0.0, **({"fused": True} if fused else {}))
    opt.step()  # AdamW's state built, not timed
    return opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=67_000_000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    opts = {"loop": optimizer(args.elements, False), "fused": optimizer(args.elements, True)}
    timed = alternately({kind: opt.step for kind, opt in opts.items()}, args.rounds)
    seconds = {kind: [t for t, _ in runs] for kind, runs in timed.items()}
    print(f"AdamW step over {args.elements:,} fp32 elements, {args.threads} thread(s), {args.rounds} rounds alternated")
    print("| kind | min s | median s |\n|---|---|---|")
    for kind, ts in seconds.items():
        print(f"| {kind} | {min(ts):.3f} | {statistics.median(ts):.3f} |")
    ratio = statistics.median(seconds["fused"]) / statistics.median(seconds["loop"])
    print(f"fused / loop (medians): {ratio:.3f}")


if __name__ == "__main__":
    main()
