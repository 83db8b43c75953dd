"""The push table of ``python3 -m faircast_bench --model`` alone: one push launch per data plane into ``vllm serve``
(ZeRO-3 on 2 CPU ranks, the real architecture), without the step table's launches before it.

    python3 benchmarks/push_planes.py [--model qwen3-0.6b] [--mode dither] [--planes shm net group ...] [--out DIR]

It calls the bench's own functions (``faircast_bench.model``: ``run_push`` and the push, width and
stage tables), so the figures are the bench's. Each launch is the push worker's twelve pushes
(``faircast_bench/push_worker.py``). The library is whichever ``faircast_ds`` comes first on the
path, so one command times two commits side by side, each from its own checkout:

    PYTHONPATH=/path/to/old/checkout python3 benchmarks/push_planes.py --planes tcp shm net --out OLD
    python3 benchmarks/push_planes.py --planes shm net --out NEW --against OLD

``--against OLD`` adds a table of the two runs side by side, plane by plane (and the old run's planes this
run does not have): each kind of push, its seconds in both, and new / old.

The push launches write their JSON into ``--out``; a launch whose results are already there is not repeated.
The tables go to stdout, with the folder of the library that made them.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile

# the push kinds compared by --against: (label, push_figures key)
KINDS = (("dense, no check", "bare_dense_s"), ("dense, sampled check", "dense_sampled_s"),
         ("dense after a step, sampled", "stepped_dense_s"), ("delta after a step, sampled (median)", "delta_s"),
         ("dense, whole check", "dense_s"))


def runs_in(folder: str, mode: str) -> dict[str, dict]:
    """The push launches' JSON in ``folder`` by plane (the file without a plane's name is the TCP push)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(folder, f"push-{mode}*.json"))):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        found[data.get("plane", "tcp")] = data
    if not found:
        raise SystemExit(f"push_planes: no push-{mode}*.json in {folder}")
    return found


def _seconds(value: float | None) -> str:
    return f"{value:.2f}" if value else "-"


def compare(new: dict[str, dict], old: dict[str, dict], figures) -> str:  # type: ignore[no-untyped-def]
    lines = ["| plane | push | before s | after s | after / before |", "|---|---|---|---|---|"]
    for plane in [*new, *(p for p in old if p not in new)]:
        a = figures(new[plane]) if plane in new else None
        b = figures(old[plane]) if plane in old else None
        for label, key in KINDS:
            after = a.get(key) if a else None
            before = b.get(key) if b else None
            ratio = f"{after / before:.2f}" if after and before else "-"
            lines.append(f"| {plane} | {label} | {_seconds(before)} | {_seconds(after)} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import faircast_ds
    from faircast_bench.builders import architecture
    from faircast_bench import model as bench

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=("qwen3-0.6b", "qwen2.5-0.5b"))
    parser.add_argument("--layers", type=int, help="cut the depth to N layers (default: the architecture's)")
    parser.add_argument("--mode", default="dither", help="the Fair Cast mode of the pushes (default dither)")
    parser.add_argument("--planes", nargs="+", default=["shm"],
                        help="data planes, as `python3 -m faircast_bench --push-planes` takes them (default shm)")
    parser.add_argument("--lr", type=float, default=bench.PUSH_LR, help="AdamW lr of the steps between deltas")
    parser.add_argument("--out", help="folder for the launches' logs and JSON (default: a temporary one)")
    parser.add_argument("--against", metavar="OLD", help="another run's --out: print both side by side")
    args = parser.parse_args(argv)
    layers = args.layers or architecture(args.model).layers
    out = args.out or tempfile.mkdtemp(prefix="faircast-push-planes-")
    os.makedirs(out, exist_ok=True)
    failures: list[str] = []
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    pushes = bench.run_push(args.model, layers=layers, modes=(args.mode,), lr=args.lr, out_dir=out, log=log,
                            failures=failures, planes=tuple(args.planes))
    print(f"library: {os.path.dirname(os.path.dirname(os.path.abspath(faircast_ds.__file__)))}; "
          f"planes: {' '.join(args.planes)}; logs and JSON: {out}")
    if pushes:
        print(bench.format_push_table(pushes, model=args.model, layers=layers, lr=args.lr))
        for extra in (bench.format_stage_table(pushes), bench.format_width_table(pushes)):
            if extra:
                print()
                print(extra)
    if args.against and pushes:
        print()
        print(f"before: {args.against}; after: {out}")
        new = {data.get("plane", "tcp"): data for data in pushes}  # run_push's results: no second read
        print(compare(new, runs_in(args.against, args.mode), bench.push_figures))
    if failures:
        print("FAILED:\n" + "\n".join(f"- {f}" for f in failures))
    return 1 if failures or not pushes else 0


if __name__ == "__main__":
    sys.exit(main())
