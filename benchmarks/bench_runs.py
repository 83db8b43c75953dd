"""A tensor-parallel shard cast over runs against a contiguous cast of the same elements, in one run.

    python benchmarks/bench_runs.py [--rows 2048] [--cols 2752] [--tp 2] [--repeats 15] [--modes ...]
                                    [--device cpu|cuda]

A row-parallel weight of local shape (rows, cols) (Megatron's ``partition_dim`` 1: each local row is one
run of the full parameter, rank 1 of ``--tp``) is cast by :class:`faircast_ds.shard.caster.ShardCaster`
with the slices :meth:`faircast_ds.megatron.layout.TensorSplit.slices` gives it, and, on the same tensors,
as one contiguous slice of the same number of elements (what a column-parallel or unsplit weight costs).
Also a column-parallel SwiGLU ``linear_fc1`` (stride 2: two runs) and an arbitrary layout of uneven runs
(``--uneven``: run lengths drawn from 1..2*cols). The two are timed alternately, ``--repeats`` pairs, so
that both see the same machine; the table gives each one's minimum, their ratio, and the median of the
pairs' own ratios (steadier on a loaded machine). Only the ratios are meant to be compared (the goal: runs <= 2x
contiguous); absolute times move with the machine and its load (printed).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from faircast_ds.config.section import FairCastConfig
from faircast_ds.megatron.layout import TensorSplit
from faircast_ds.casting.modes import MODES
from faircast_ds.shard.caster import ShardCaster, ShardSlice


def _timed(fn, sync) -> float:
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _uneven_slices(name: str, numel: int, cols: int, gen: torch.Generator) -> list[ShardSlice] | None:
    """Runs of random lengths at random, increasing places of a larger parameter: one slice with runs
    when this version of the caster has a form for arbitrary runs, else None."""
    try:
        from faircast_ds.shard.caster import IndexRuns  # noqa: F401
        from faircast_ds.casting.runs import Runs
    except ImportError:
        return None
    lengths = []
    left = numel
    while left:
        n = min(left, int(torch.randint(1, 2 * cols, (1,), generator=gen)))
        lengths.append(n)
        left -= n
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    gaps = torch.randint(0, 64, (len(lengths),), generator=gen, dtype=torch.int64)
    starts = torch.cumsum(lengths_t + gaps, 0) - lengths_t
    return [ShardSlice(name, int(starts[0]), numel, 0, runs=Runs.of(starts, lengths_t))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=2752)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--uneven", action="store_true", help="also an arbitrary layout of uneven runs")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows, cols = args.rows, args.cols
    n = rows * cols
    gen = torch.Generator().manual_seed(0)
    master = (torch.randn(n, generator=gen) * 0.02).to(device)
    served = master.to(torch.bfloat16)
    layouts = {
        "row-parallel": TensorSplit((rows, cols), 1, 1, args.tp, args.tp - 1).slices("w", 0, n),
        "swiglu fc1 (stride 2)": TensorSplit((rows, cols), 0, 2, args.tp, args.tp - 1).slices("w", 0, n),
    }
    if args.uneven:
        uneven = _uneven_slices("w", n, cols, gen)
        if uneven is not None:
            layouts["uneven runs"] = uneven
    contiguous = [ShardSlice("w", 12345, n, 0)]
    from faircast_ds.casting import kernels

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}, kernel "
          f"{kernels.backend_for(device)}, load {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"local shard {rows} x {cols} = {n:,} elements (rank {args.tp - 1} of TP {args.tp}); "
          f"min over {args.repeats} alternating repeats")
    print(f"{'layout':<22} {'mode':<15} {'slices':>6} {'runs ms':>9} {'contig ms':>9} {'ratio':>8} "
          f"{'median pair':>11}")
    worst = 0.0
    for label, slices in layouts.items():
        for mode in args.modes:
            caster = ShardCaster(FairCastConfig(mode=mode, seed=1))
            caster.begin_step()
            laid = lambda: caster.cast_flat("runs", master, served, slices)  # noqa: E731
            flat = lambda: caster.cast_flat("contig", master, served, contiguous)  # noqa: E731
            laid(), flat()  # warm-up (and the per-shard tables, made once)
            sync()
            pairs = [(_timed(laid, sync), _timed(flat, sync)) for _ in range(args.repeats)]
            best_runs, best_flat = min(p[0] for p in pairs), min(p[1] for p in pairs)
            ratio = best_runs / best_flat
            median = statistics.median(a / b for a, b in pairs)
            worst = max(worst, ratio)
            print(f"{label:<22} {mode:<15} {len(slices):>6} {best_runs * 1e3:>9.3f} {best_flat * 1e3:>9.3f} "
                  f"{ratio:>7.2f}x {median:>10.2f}x")
    print(f"worst ratio {worst:.2f}x (goal <= 2x); load {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
