"""The benchmarks' shared timers: the best of a few runs of a call (the least disturbed by other work), and
forms of one computation run alternately, round after round."""
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


def alternately(forms: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[tuple[float, Any]]]:
    """``rounds`` rounds of every form once, in the order given, so that a machine's drift hits all alike: per
    form, each round's (seconds, result)."""
    out: dict[str, list[tuple[float, Any]]] = {name: [] for name in forms}
    for _ in range(rounds):
        for name, fn in forms.items():
            began = time.perf_counter()
            result = fn()
            out[name].append((time.perf_counter() - began, result))
    return out
