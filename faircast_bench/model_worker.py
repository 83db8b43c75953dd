"""One configuration of ``python3 -m faircast_bench --model`` on the ranks of a ``deepspeed`` launch (started by
:mod:`faircast_bench.model`, not by hand): build the real architecture, train warm-up and timed
steps, save and load a checkpoint, and write this rank's figures as JSON.

Arguments (after the script): STEM MODEL LAYERS STAGE CONFIG WARMUP STEPS, where CONFIG is
``plain`` (no fair_cast section: DeepSpeed's own round-to-nearest) or a Fair Cast mode; each rank
writes STEM.rank<r>.json.
"""
from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import sys
import time
from typing import Any, Callable

SEQUENCE = 64  # tokens per micro-batch (batch 1): the step's cost is the optimizer's and the gathers'
# DeepSpeed's buffer knobs, the same for plain and every mode. Its defaults (5e8-element reduce and
# all-gather buckets, one optimizer sub-group of up to 1e9 elements, so torch AdamW's temporaries span
# the whole shard) put plain ZeRO-3 at 11.4 GB per rank for Qwen3-0.6B, and two ranks with error
# feedback's 1.2 GB residual each would not fit this 24 GiB machine. 5e7 elements is what memory-bound
# users set; it changes plain DeepSpeed's footprint, not what Fair Cast adds to it.
BUCKET = 50_000_000


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _usage() -> tuple[float, int, int]:
    """This process's CPU seconds (user + system, every thread), minor and major page faults so far."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime, u.ru_minflt, u.ru_majflt


class _Clock:
    """Seconds spent inside wrapped methods, outermost calls only (a wrapped method calling another
    is counted once)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0

    def wrap(self, obj: Any, names: tuple[str, ...]) -> None:
        for name in names:
            method = getattr(obj, name, None)
            if callable(method):
                setattr(obj, name, self._timed(method))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - t0
        return timed

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


def bench_config(stage: int, config: str) -> dict[str, Any]:
    """The DeepSpeed config of one benchmark launch: ``config`` is ``plain`` (no fair_cast section) or a
    Fair Cast mode with the shipped defaults; the buffer knobs of :data:`BUCKET`."""
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                           "bf16": {"enabled": True}, "steps_per_print": 10**9,
                           "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET,
                                                 "allgather_bucket_size": BUCKET}}
    if stage == 3:
        cfg["zero_optimization"].update(sub_group_size=BUCKET, stage3_prefetch_bucket_size=BUCKET)
    if config != "plain":
        cfg["fair_cast"] = {"enabled": True, "mode": config, "seed": 1}  # the shipped defaults otherwise
    return cfg


def write_json(path: str, data: dict[str, Any]) -> None:
    """``data`` at ``path``, whole or not at all (the bench reads a result only once it is complete)."""
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def finish() -> None:
    """Every rank: wait for the others, then leave without Python's finalization."""
    import deepspeed.comm as dist
    import torch

    dist.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort a process that finalizes normally after destroy_process_group


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv: list[str]) -> None:
    # the deepspeed launcher appends --local_rank=N
    stem, model_name, layers, stage, config, warmup, steps = [a for a in argv if not a.startswith("--local_rank")]
    layers, stage, warmup, steps = int(layers), int(stage), int(warmup), int(steps)
    import deepspeed
    import deepspeed.comm as dist
    import torch

    from faircast_ds import get_fair_cast
    from faircast_bench.zero_init import real_causal_lm
    from faircast_bench.builders import real_config

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    cfg = bench_config(stage, config)
    t0 = time.perf_counter()
    model = real_causal_lm(model_name, layers=layers, seed=0, ds_config=cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    build_s = time.perf_counter() - t0
    build_peak = _peak_mib()
    fc = get_fair_cast(engine)
    guard_clock, diag_clock = _Clock(), _Clock()
    if fc is not None:
        guard = fc.extras.get("guard")
        if guard is not None:
            guard_clock.wrap(guard, ("prepare", "check", "on_cast", "record", "record_all_served"))
        if fc.diagnostics is not None:
            diag_clock.wrap(fc.diagnostics, ("on_cast", "compute"))
    vocab = real_config(model_name).vocab_size
    rows = []
    profile_dir = os.environ.get("FAIRCAST_BENCH_PROFILE")  # a folder: cProfile each rank's timed steps there
    prof = None
    for step in range(warmup + steps):
        if profile_dir and step == warmup:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        x = torch.randint(0, vocab, (1, SEQUENCE), generator=torch.Generator().manual_seed(1000 * step + rank))
        dist.barrier()
        usage = _usage()
        t = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        seconds = time.perf_counter() - t
        cpu, minor, major = (b - a for a, b in zip(usage, _usage()))
        rows.append({"step": step + 1, "seconds": seconds, "cpu_s": cpu, "minor_faults": minor, "major_faults": major,
                     "cast_s": fc.caster.last.seconds if fc is not None else 0.0,
                     "guard_s": guard_clock.take(), "diagnostics_s": diag_clock.take(), "peak_mib": _peak_mib()})
        if rank == 0:
            print(f"[bench] {config} ZeRO-{stage} step {step + 1}/{warmup + steps}: {seconds:.2f} s", flush=True)
    if prof is not None:
        prof.disable()
        prof.dump_stats(os.path.join(profile_dir, f"{os.path.basename(stem)}.rank{rank}.prof"))
    train_peak = _peak_mib()
    ckpt = f"{stem}-ckpt"
    dist.barrier()
    t = time.perf_counter()
    engine.save_checkpoint(ckpt, tag="bench")
    dist.barrier()
    save_s = time.perf_counter() - t
    save_peak = _peak_mib()  # the peak so far: training, then the save
    size = _dir_bytes(ckpt) if rank == 0 else 0
    t = time.perf_counter()
    engine.load_checkpoint(ckpt, tag="bench")
    dist.barrier()
    load_s = time.perf_counter() - t
    load_guard_s = guard_clock.take()
    if rank == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
    if fc is not None:
        shard = sum(int(master.numel()) for _, master, _, _ in fc.adapter.flat_groups())
    else:  # plain ZeRO-3: this rank's partitions (ZeRO-2 keeps no per-parameter record of them)
        shard = sum(int(p.ds_tensor.numel()) for p in engine.module.parameters() if hasattr(p, "ds_tensor")) or None
    result = {"rank": rank, "config": config, "stage": stage, "model": model_name, "layers": layers,
              "params": sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters()),
              "shard_elements": shard, "build_s": build_s, "build_peak_mib": build_peak, "warmup": warmup, "steps": rows,
              "train_peak_mib": train_peak, "save_peak_mib": save_peak, "peak_mib": _peak_mib(), "save_s": save_s, "load_s": load_s,
              "load_guard_s": load_guard_s, "checkpoint_bytes": size, "threads": torch.get_num_threads()}
    write_json(f"{stem}.rank{rank}.json", result)
    finish()


if __name__ == "__main__":
    main(sys.argv[1:])
