"""Resuming a GRPO job from its own checkpoints (``--save-every N``), so that a long run spans sessions.

Every ``N`` steps (and at its last step) each (mode, seed) engine saves a DeepSpeed checkpoint — module,
ZeRO optimizer state with AdamW's moments and fp32 masters, Fair Cast's state — under
``<out>/<name>/resume/<mode>-seed<seed>/global_step<S>``, keeping only the newest. The per-step CSV is
written after every step, before the checkpoint. Running the same command again (same ``--out`` and
``--name``) skips the finished runs (``done`` markers), loads the newest checkpoint of the unfinished one,
drops its CSV rows after that step and continues; the settings must be the ones the run started with
(``job.json``). Rollout prompts and sampling seeds are functions of (seed, step, rank), so a resumed step
draws what an uninterrupted one would. Not carried over: Fair Cast's diagnostics history (the lag restarts
its window) and the vLLM engine (a new one gets the loaded weights in a verified push).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from typing import Any

# settings a resumed job may change, every other one must match: where it writes, when it stops, and five that
# train and serve the same bits: engine_threads and push_plane (config.py), persist_threshold (ZeRO-3 keeps
# gathered what the forward would gather anyway; tests/jobs/test_job_pretrained.py resumes at 1e9 elements a
# run that an uninterrupted one at 1e5 equals in every column), engine_gemm_cache (the same fp32 products) and
# engine_spin_s (how the engine's processes wait, nothing they compute)
FREE = ("out", "name", "session_steps", "engine_threads", "push_plane", "persist_threshold", "engine_gemm_cache",
        "engine_spin_s")
# settings a resumed job may change when the job's other settings (as it was started) hold these values:
# engine_requests with the engine's fp32 products, whose rows do not depend on the rows beside them (config.py)
FREE_WHEN = {"engine_requests": ("engine_gemm", "fp32")}
# settings added after jobs were started, with the value a job.json written before them ran with
ADDED = {"gemm": "native", "zero_stage": 3, "engine_gemm": "native", "adamw": "loop", "engine_requests": 8,
         "engine_gemm_cache": 0, "engine_spin_s": 1.0}  # settings added since: what a job.json without them ran with
INTEGER_COLUMNS = ("seed", "step", "changed", "numel", "sync_bytes", "sync_bytes_dense", "engine_sync_params",
                   "engine_sync_bytes")
BOOL_COLUMNS = ("engine_weights_equal",)  # written as True/False, read back by steps_csv as 1.0/0.0


def run_key(mode: str, seed: int) -> str:
    return f"{mode}-seed{seed}"


def checkpoint_dir(run_dir: str, mode: str, seed: int) -> str:
    return os.path.join(run_dir, "resume", run_key(mode, seed))


def latest_step(directory: str) -> int:
    """The step of the newest whole checkpoint in ``directory`` (DeepSpeed's ``latest`` file), 0 if none."""
    try:
        with open(os.path.join(directory, "latest")) as f:
            tag = f.read().strip()
    except OSError:
        return 0
    m = re.fullmatch(r"global_step(\d+)", tag)
    if m is None or not os.path.isdir(os.path.join(directory, tag)):
        return 0
    return int(m.group(1))


def save(engine: Any, directory: str, step: int, rank: int) -> None:
    """Save the engine at ``step`` (a collective) and, on rank 0, remove the older checkpoints."""
    import torch.distributed as dist

    tag = f"global_step{step}"
    engine.save_checkpoint(directory, tag=tag)
    dist.barrier()
    if rank == 0:
        for entry in os.listdir(directory):
            if entry.startswith("global_step") and entry != tag:
                shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
    dist.barrier()


def done_path(run_dir: str, mode: str, seed: int) -> str:
    return os.path.join(run_dir, "resume", run_key(mode, seed) + ".done")


def is_done(run_dir: str, mode: str, seed: int) -> bool:
    return os.path.exists(done_path(run_dir, mode, seed))


def mark_done(run_dir: str, mode: str, seed: int, final: dict[str, Any]) -> None:
    """Record a finished run (its end figures) and drop its checkpoint (a run resumes only while unfinished)."""
    path = done_path(run_dir, mode, seed)
    with open(path + ".tmp", "w") as f:
        json.dump(final, f)
    os.replace(path + ".tmp", path)
    shutil.rmtree(checkpoint_dir(run_dir, mode, seed), ignore_errors=True)


def read_done(run_dir: str, mode: str, seed: int) -> dict[str, Any]:
    with open(done_path(run_dir, mode, seed)) as f:
        return json.load(f)


def check_settings(run_dir: str, config: dict[str, Any]) -> None:
    """Write ``job.json`` at a job's first start; on a later start refuse settings that differ from it."""
    path = os.path.join(run_dir, "job.json")
    if not os.path.exists(path):
        with open(path + ".tmp", "w") as f:
            json.dump(config, f, indent=1)
        os.replace(path + ".tmp", path)
        return
    with open(path) as f:
        before = json.load(f)
    before = {**ADDED, **before}
    free = set(FREE) | {k for k, (other, value) in FREE_WHEN.items()
                        if before.get(other) == value and config.get(other) == value}
    differ = sorted(k for k in set(before) | set(config) if k not in free
                    and _norm(before.get(k)) != _norm(config.get(k)))
    if differ:
        raise SystemExit(f"{run_dir} was started with other settings; resuming needs the same ones. Differing: "
                         + ", ".join(f"{k} (was {before.get(k)!r}, now {config.get(k)!r})" for k in differ))


def check_cpu(run_dir: str, capability: str, vendor: str | None = None) -> None:
    """Refuse to resume a run on a CPU of another vector capability, or another vendor where the run recorded one,
    than its first session's (sessions.jsonl, faircast_jobs/provenance.py): matrix kernels round differently on
    AVX2 and AVX-512, fp32 sums on Intel and AMD, so the resumed steps would not be the steps the run would have
    taken. A run with no recorded session has nothing to compare."""
    from faircast_jobs.provenance import SESSIONS, sessions

    first = next(iter(sessions(run_dir)), {})
    for key, mine in (("cpu_capability", capability), ("cpu_vendor", vendor)):
        started = first.get(key)
        if started and mine and started != mine:
            raise SystemExit(f"{run_dir} was started on a CPU with {started} ({os.path.join(run_dir, SESSIONS)}); "
                             f"this one has {mine}, whose "
                             f"kernels round differently, so its steps would not continue the run's. Resume it "
                             f"on a CPU with {started}, or start a new run (another --name)")


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def tidy(rows: list[dict]) -> list[dict]:
    """Rows read back from steps.csv with their integer columns as integers and their True/False columns as
    booleans again, so a resumed run rewrites them as the run that never stopped wrote them."""
    for row in rows:
        for key in INTEGER_COLUMNS:
            value = row.get(key)
            if isinstance(value, float) and not math.isnan(value):
                row[key] = int(value)
        for key in BOOL_COLUMNS:
            value = row.get(key)
            if isinstance(value, float) and value in (0.0, 1.0):
                row[key] = value == 1.0
    return rows
