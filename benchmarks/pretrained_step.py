"""One step of the SmolLM2 job by stage, two settings side by side in one run (issue 49 item 1).

    python benchmarks/pretrained_step.py [--steps 11] [--mode dither] [--seed 0] \
        [--base '--engine-threads 1 --kl-master-every 1 --engine-gemm native --engine-requests 8'] [--fast '']

Runs `bash launch/main.sh --model smollm2-135m-instruct --task addition` for ``--steps`` steps of one mode and
seed, once with each setting (base first, then fast, then base and fast again with ``--rounds 2``), each into a
scratch folder, and reads their steps.csv. Per stage, the median over steps 2 to the last but one (the mean for
the periodic stages: the checkpoint and the diagnostics; the last step is left out since it pays the run's end,
a KL(master || served) and a checkpoint whatever their cadence; at 11 steps KL and the checkpoint each come at 2
of the 9 steps counted, at the job's cadence of 1 in 5) of: rollouts (the engine's
generation and the broadcast), forward+backward, the optimizer step (the cast included), the push into
`vllm serve` (``engine_sync_ms``), the diagnostics (the rest of the step after the push: KL(master || served),
Fair Cast's lag, the change counts) and the checkpoint (``save_ms``, one save every 5 steps); the step is their
sum. Prints fast / base per stage, and whether the two settings trained the same trajectory: every step's
reward, loss, changed count and served changed fraction equal (exact, as the CSV writes them). Start-up
(DeepSpeed, the model, `vllm serve`) is left out of the step and printed apart.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("rollout", "fwd_bwd", "opt", "push", "diagnostics", "save")
SAME = ("reward", "loss", "changed", "changed_fraction")
PERIODIC = ("diagnostics", "save")


def stage_ms(row: dict) -> dict[str, float]:
    push = float(row["engine_sync_ms"])
    return {"rollout": float(row["rollout_ms"]), "fwd_bwd": float(row["fwd_bwd_ms"]), "opt": float(row["opt_ms"]),
            "push": push, "diagnostics": float(row["extra_ms"]) - push, "save": float(row.get("save_ms") or 0.0)}


def run_job(flags: str, steps: int, mode: str, seed: int, out: Path, name: str, port: int) -> tuple[list[dict], float]:
    cmd = ["bash", "launch/main.sh", "--model", "smollm2-135m-instruct", "--task", "addition", "--modes", mode,
           "--seed-list", str(seed), "--steps", str(steps), "--out", str(out), "--name", name, *shlex.split(flags)]
    began = time.perf_counter()
    log = out / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "MASTER_PORT": str(port)})
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}; its log: {log}\n{log.read_text()[-3000:]}")
    with open(out / name / "steps.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["mode"] == mode]
    return sorted(rows, key=lambda r: int(r["step"])), wall


def summarize(rows: list[dict]) -> dict[str, float]:
    # steps 2 .. the last but one: the first step warms up, and the last one carries the run's end (KL(master ||
    # served) and a checkpoint whatever the cadence), which a 100-step run pays once, not every few steps
    last = max(int(r["step"]) for r in rows)
    per = [stage_ms(r) for r in rows if 2 <= int(r["step"]) < last]
    # medians (robust to a busy machine), but means where a stage's work comes every few steps (a save every
    # 5 steps; KL(master || served) every --kl-master-every): their cost amortized over the steps
    out = {s: (statistics.fmean if s in PERIODIC else statistics.median)(p[s] for p in per) for s in STAGES}
    out["step"] = sum(out[s] for s in STAGES)
    return out


def first_difference(a: list[dict], b: list[dict]) -> str | None:
    if [r["step"] for r in a] != [r["step"] for r in b]:
        return "the two runs have different steps"
    for x, y in zip(a, b):
        for key in SAME:
            if x[key] != y[key]:
                return f"step {x['step']}: {key} {x[key]} (base) != {y[key]} (fast)"
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=11)
    p.add_argument("--mode", default="dither")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base", default="--engine-threads 1 --kl-master-every 1 --engine-gemm native --engine-requests 8",
                   help="the job as the committed SmolLM2 runs ran it (the engine on 1 thread with vLLM's own GEMM, 8 "
                        "requests in flight, KL every step) but for their tcp push, which no longer exists, and for code "
                        "changes that keep the bits and have no flag (docs/pretrained.md)")
    p.add_argument("--fast", default="", help="the job's defaults now")
    p.add_argument("--rounds", type=int, default=1, help="base, fast, base, fast, ... (alternated)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="pretrained-step-"))
    results: dict[str, list[dict]] = {"base": [], "fast": []}
    walls: dict[str, list[float]] = {"base": [], "fast": []}
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for i, label in enumerate(("base", "fast")):
            rows, wall = run_job(getattr(args, label), args.steps, args.mode, args.seed, out, f"{label}{r}",
                                 29700 + 2 * r + i)
            runs[label] = rows
            results[label].append(summarize(rows))
            walls[label].append(wall)
            print(f"{label} round {r}: {wall:.0f} s wall for {args.steps} steps", flush=True)
    med = {label: {k: statistics.median(s[k] for s in results[label]) for k in (*STAGES, "step")}
           for label in results}
    print(f"\nSmolLM2-135M-Instruct, {args.mode} seed {args.seed}, {args.steps} steps per run, {args.rounds} round(s); "
          f"median over steps 2..{args.steps - 1}, the checkpoint and diagnostics their mean (ms)")
    print(f"base: {args.base}\nfast: {args.fast}\n")
    print("| stage | base ms | fast ms | fast / base |\n|---|---|---|---|")
    for k in (*STAGES, "step"):
        b, f = med["base"][k], med["fast"][k]
        print(f"| {k} | {b:,.0f} | {f:,.0f} | {f / b:.2f} |" if b > 0 else f"| {k} | {b:,.0f} | {f:,.0f} | – |")
    whole = {label: statistics.median(walls[label]) for label in walls}
    print(f"\nwhole runs (start-up included): base {whole['base']:.0f} s, fast {whole['fast']:.0f} s "
          f"({whole['fast'] / whole['base']:.2f})")
    diff = first_difference(runs["base"], runs["fast"])
    print("same trajectory (reward, loss, changed, changed fraction at every step): "
          + ("yes" if diff is None else f"NO: {diff}"))
    if args.json:
        args.json.write_text(json.dumps({"base": args.base, "fast": args.fast, "steps": args.steps, "median_ms": med,
                                         "wall_s": walls, "same_trajectory": diff is None, "difference": diff},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
