"""The benchmarks' shared timer: the best of a few runs of a call (the least disturbed by other work)."""
from __future__ import annotations

import time
from typing import Any, Callable


def best(fn: Callable[[], Any], repeat: int = 3) -> float:
    """The shortest of ``repeat`` runs of ``fn()``, in seconds."""
    out = float("inf")
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - began)
    return out
