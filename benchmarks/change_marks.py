"""What change marks cost and save on one rank's shard (issue 32 item 4), side by side in one run:

- the cast with and without marking (the fused C++ kernel, dither, a step at an RL learning rate);
- finding what changed for a delta: counting the marks against comparing with a kept copy of the
  acknowledged bits (one count per slice, as a push does);
- acknowledging: clearing the marks against copying the bits;
- memory kept between pushes: the bitmap against the copy.

    python benchmarks/change_marks.py [--numel 50000000] [--slices 200]

Prints the ratios; on this machine's 2 cores take it with nothing else running.
"""
from __future__ import annotations

import argparse

import torch

from faircast_ds.casting.marks import MarkSet
from faircast_ds.config.section import FairCastConfig
from faircast_ds.export.source import BaselineTracker, MarksTracker
from faircast_ds.shard.caster import ShardCaster, ShardSlice
from timing import best as _best


def best(fn) -> float:
    return _best(fn, 5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--slices", type=int, default=200)
    args = ap.parse_args()
    n, k = args.numel, args.slices
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=gen) * 0.02
    served = master.to(torch.bfloat16)
    size = n // k
    slices = [ShardSlice(f"p{i}", 0, size if i < k - 1 else n - size * (k - 1), i * size) for i in range(k)]
    plain = ShardCaster(FairCastConfig(mode="dither", seed=1))
    marked = ShardCaster(FairCastConfig(mode="dither", seed=1))
    marks = marked.track_changes()
    step = torch.randn(n, generator=gen) * 1e-6  # an AdamW step at lr ~1e-6 on weights of ~0.02

    def cast(caster: ShardCaster) -> None:
        master.add_(step)
        caster.begin_step()
        caster.cast_flat("flat", master, served, slices)

    cast(marked)  # registers the marks, builds the kernel
    cast(plain)
    t_plain = best(lambda: cast(plain))
    t_marked = best(lambda: cast(marked))
    changed = plain.last.changed
    views = [served.narrow(0, s.offset, s.numel) for s in slices]
    copy = BaselineTracker()
    copy.acknowledge(views)
    tracker = MarksTracker(MarkSet([marks]))
    marks.clear()
    cast(marked)
    count_copy = best(lambda: copy.counts(views))
    count_marks = best(lambda: tracker.counts(views))
    assert sum(copy.counts(views)) == sum(tracker.counts(views)) == marked.last.changed
    ack_copy = best(lambda: copy.acknowledge(views))
    ack_marks = best(lambda: tracker.acknowledge(views))
    print(f"shard of {n:,} elements in {k} slices, dither, {changed / n:.2%} of the elements changed per step "
          f"(torch threads {torch.get_num_threads()})")
    print("| | kept copy (2 B/element) | change marks (1 bit/element) | marks / copy |")
    print("|---|---|---|---|")
    print(f"| cast (the kernel; marks: it also marks) | {t_plain * 1e3:.1f} ms | {t_marked * 1e3:.1f} ms | "
          f"{t_marked / t_plain:.3f} |")
    print(f"| what changed, per slice (a delta's diff) | {count_copy * 1e3:.1f} ms | {count_marks * 1e3:.1f} ms | "
          f"{count_marks / count_copy:.3f} |")
    print(f"| acknowledge (copy the bits / clear the marks) | {ack_copy * 1e3:.1f} ms | {ack_marks * 1e3:.1f} ms | "
          f"{ack_marks / ack_copy:.3f} |")
    print(f"| kept between pushes | {copy.nbytes / 2**20:.1f} MiB | {tracker.nbytes / 2**20:.2f} MiB | "
          f"{tracker.nbytes / copy.nbytes:.4f} |")


if __name__ == "__main__":
    main()
