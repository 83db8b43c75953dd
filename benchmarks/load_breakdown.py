"""Where a DeepSpeed ``load_checkpoint`` spends its time, Fair Cast against plain, stage by stage, in one run.

    python benchmarks/load_breakdown.py [--model qwen3-0.6b] [--layers 1] [--stages 3 2]
                                        [--configs plain dither error_feedback] [--loads 3] [--fresh] [--out DIR]

For each ZeRO stage and configuration, one ``deepspeed --num_gpus 2`` launch on CPU ranks (gloo) builds the
real architecture at ``--layers`` (the shipped DeepSpeed config of ``python3 -m faircast_bench --model``), takes two
optimizer steps, saves a checkpoint and loads it ``--loads`` times. Each load is split into stages by timers
wrapped around the functions that do them (inclusive times; the larger rank's; median over the loads):

- ``total``: ``engine.load_checkpoint`` until every rank is back (the load time ``python3 -m faircast_bench`` reports);
- ``ds files``: DeepSpeed's own reading and restoring (``engine._load_checkpoint`` and
  ``_load_zero_checkpoint``; under Fair Cast this includes the casts DeepSpeed's load sites make);
- ``state read``: Fair Cast's state files and the tag folder's completeness check (``_read_state``);
- ``restore``: Fair Cast's state put back (``restore_state``: the residual and served bits of error feedback)
  and published (``publish_restored``: a recast of every shard, or the restored bits, then the all-gather);
- ``casts``: every ``ShardCaster.cast_flat`` (its observers excluded); ``guard record``: the guard noting
  what the casts wrote (the block digests); ``guard check``: the guard's full comparison after the load;
  ``publish``: the adapter's all-gathers.

``--fresh`` measures a resume instead: one launch trains and saves, a second launch (fresh processes, as a
resumed job) builds the engine and loads the checkpoint ``--loads`` times; the table gives the first load
(the resume a user pays) and the median of the later ones.

The last lines give each Fair Cast configuration's total against plain's and the guard's share of its load
(record + prepare + check). Only ratios are meant to be compared; the machine's load is printed.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

STAGES = ("total", "ds files", "state read", "restore", "restore_state", "publish_restored", "casts",
          "guard prepare", "guard record", "guard check", "publish")


class _Timers:
    """Seconds spent inside wrapped callables, per stage, outermost calls of a stage only."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._depth: dict[str, int] = {}

    def timed(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = self._depth.get(stage, 0)
            self._depth[stage] = depth + 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth[stage] = depth
                if depth == 0:
                    self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0
        return wrapper

    def patch(self, owner: Any, name: str, stage: str) -> None:
        original = getattr(owner, name, None)
        if callable(original):
            setattr(owner, name, self.timed(stage, original))

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


def worker(argv: list[str]) -> None:
    stem, model_name, layers, stage, config, loads, phase = [a for a in argv if not a.startswith("--local_rank")]
    layers, stage, loads = int(layers), int(stage), int(loads)  # phase: all | save | resume
    import deepspeed
    import deepspeed.comm as dist
    import torch

    from faircast_ds import get_fair_cast
    from faircast_ds.shard import guard as core_guard, caster as shard_caster
    from faircast_bench.model_worker import bench_config
    from faircast_ds.deepspeed import checkpoint as save_load
    from faircast_bench.zero_init import real_causal_lm
    from faircast_bench.builders import real_config

    timers = _Timers()
    # the casts without their observers: time cast_flat, and the guard's record inside it separately
    timers.patch(core_guard.Guard, "record", "guard record")
    timers.patch(core_guard.Guard, "on_cast", "observed")  # the guard's record made inside cast_flat
    timers.patch(core_guard.Guard, "prepare", "guard prepare")
    timers.patch(core_guard.Guard, "check", "guard check")
    timers.patch(shard_caster.ShardCaster, "cast_flat", "casts")
    timers.patch(save_load, "_read_state", "state read")
    timers.patch(save_load, "_restore", "restore")
    timers.patch(save_load, "restore_state", "restore_state")
    timers.patch(save_load, "publish_restored", "publish_restored")

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    cfg = bench_config(stage, config)
    model = real_causal_lm(model_name, layers=layers, seed=0, ds_config=cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    fc = get_fair_cast(engine)
    timers.patch(engine, "_load_checkpoint", "ds files")
    timers.patch(engine, "_load_zero_checkpoint", "ds files")
    if fc is not None:
        timers.patch(fc.adapter, "publish", "publish")
    vocab = real_config(model_name).vocab_size
    ckpt = f"{stem}-ckpt"
    if phase != "resume":
        for step in range(2):
            x = torch.randint(0, vocab, (1, 64), generator=torch.Generator().manual_seed(1000 * step + rank))
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        engine.save_checkpoint(ckpt, tag="bench")
    dist.barrier()
    rows = []
    for _ in range(loads if phase != "save" else 0):
        timers.take()
        dist.barrier()
        profile = os.environ.get("LOAD_BREAKDOWN_PROFILE")  # a folder: cProfile each rank's loads there
        if profile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        t = time.perf_counter()
        engine.load_checkpoint(ckpt, tag="bench")
        dist.barrier()
        if profile:
            prof.disable()
            prof.dump_stats(os.path.join(profile, f"{os.path.basename(stem)}.rank{rank}.prof"))
        row = timers.take()
        row["casts"] = row.get("casts", 0.0) - row.pop("observed", 0.0)  # cast_flat without the guard's record
        row["total"] = time.perf_counter() - t
        rows.append(row)
    shard = sum(int(m.numel()) for _, m, _, _ in fc.adapter.flat_groups()) if fc is not None else None
    with open(f"{stem}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "rows": rows, "shard_elements": shard,
                   "params": sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters())}, f)
    dist.barrier()
    if rank == 0 and phase != "save":
        import shutil

        shutil.rmtree(ckpt, ignore_errors=True)
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort a process that finalizes normally


def _launch(stem: str, args: argparse.Namespace, stage: int, config: str) -> dict[str, Any] | None:
    if not args.fresh:
        return _launch_phase(stem, args, stage, config, "all")
    if _launch_phase(stem, args, stage, config, "save") is None:
        return None
    result = _launch_phase(stem, args, stage, config, "resume")
    if result is not None:  # the first load is the resume; the median is over the later ones
        first, later = result["loads"][0], result["loads"][1:] or result["loads"]
        result["median"] = dict(first)
        result["later"] = {k: statistics.median(r[k] for r in later) for k in STAGES}
    return result


def _launch_phase(stem: str, args: argparse.Namespace, stage: int, config: str, phase: str) -> dict[str, Any] | None:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    runner = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [runner if os.path.exists(runner) else "deepspeed", "--num_gpus", "2", "--master_port", str(port),
           os.path.abspath(__file__), "--worker", stem, args.model, str(args.layers), str(stage), config,
           str(args.loads), phase]
    log = f"{stem}.{phase}.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=root)
    for n in os.listdir("/dev/shm"):  # DeepSpeed's CPU all-reduce leaves its buffers behind
        if n.startswith("deepspeed_allreduce_buffer_") and f"_{port}_" in n:
            os.unlink(os.path.join("/dev/shm", n))
    if phase == "save":
        if proc.returncode != 0 and not os.path.isdir(f"{stem}-ckpt"):
            print(f"  ZeRO-{stage} {config}: the saving launch exited {proc.returncode}; log {log}", flush=True)
            return None
        return {}
    results = []
    for r in (0, 1):
        path = f"{stem}.rank{r}.json"
        if not os.path.exists(path):  # reported in the table; the other launches still run
            print(f"  ZeRO-{stage} {config}: launch exited {proc.returncode}"
                  f"{' (SIGKILL: most likely out of memory)' if proc.returncode in (-9, 137, 247) else ''}, "
                  f"no {path}; log {log}", flush=True)
            return None
        with open(path) as f:
            results.append(json.load(f))
    # per load, each stage: the larger rank's
    rows = [{k: max(a.get(k, 0.0), b.get(k, 0.0)) for k in STAGES}
            for a, b in zip(results[0]["rows"], results[1]["rows"])]
    return {"median": {k: statistics.median(r[k] for r in rows) for k in STAGES}, "loads": rows,
            "shard_elements": results[0]["shard_elements"], "params": results[0]["params"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:  # a rank of a launch (the launcher puts --local_rank=N first)
        worker([a for a in argv if a != "--worker"])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 2])
    ap.add_argument("--configs", nargs="+", default=["plain", "dither", "error_feedback"])
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--fresh", action="store_true", help="time a resume: the first load in fresh processes")
    ap.add_argument("--out", default=None, help="folder for the launches' logs and JSON (default: a temporary one)")
    args = ap.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="load_breakdown-")
    os.makedirs(out, exist_ok=True)
    what = (f"a resume (the first of {args.loads} loads in fresh processes; 'later': the median of the rest)"
            if args.fresh else f"median of {args.loads} loads")
    print(f"{args.model} --layers {args.layers}, 2 CPU ranks, {what}, the larger rank's; "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}; logs in {out}", flush=True)
    for stage in args.stages:
        figures = {}
        for config in args.configs:
            result = _launch(os.path.join(out, f"z{stage}-{config}"), args, stage, config)
            if result is not None:
                figures[config] = result
                print(f"  ZeRO-{stage} {config}: done", flush=True)
        if not figures:
            continue
        shard = next((f["shard_elements"] for f in figures.values() if f["shard_elements"]), None)
        done = [c for c in args.configs if c in figures]
        print(f"\nZeRO-{stage}: {figures[done[0]]['params']:,} parameters, {shard or 0:,} shard elements "
              f"per rank; seconds ({'the first load in fresh processes' if args.fresh else 'median over loads'})")
        print(f"{'stage':<18}" + "".join(f"{c:>16}" for c in done))
        for k in STAGES:
            print(f"{k:<18}" + "".join(f"{figures[c]['median'][k]:>16.3f}" for c in done))
        if args.fresh:
            print(f"{'later loads':<18}" + "".join(f"{figures[c]['later']['total']:>16.3f}" for c in done))
        if "plain" in figures:
            plain = figures["plain"]["median"]["total"]
            for c in done:
                if c == "plain":
                    continue
                m = figures[c]["median"]
                guard = m["guard prepare"] + m["guard record"] + m["guard check"]
                print(f"{c}: {'resume' if args.fresh else 'load'} {m['total'] / plain:.2f}x plain (goal <= 1.2); the guard "
                      f"{guard:.3f} s = {guard / m['total']:.1%} of the load (goal <= 10%)")
    print(f"\nload average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
