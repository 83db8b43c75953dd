"""Seconds per stage of one weight update, on both ends (issue 32 item 1).

A :class:`Stages` accumulates wall seconds under stage names; every route fills one per update and
hands it back in its report (:attr:`faircast_ds.export.source.ServedReport.stages`, a plain dict).
Names are ``side.stage``: ``trainer.walk`` (reading the served weights: ZeRO-3 gathers, or each rank's
slices), ``trainer.encode`` (delta encodings), ``trainer.mac`` / ``engine.mac`` (HMAC over frames),
``trainer.send`` / ``engine.receive`` (socket time, MAC excluded), ``engine.stage`` (writing into the
staging copy), ``engine.load`` (inside vLLM's ``reload_weights``), ``trainer.checksums`` (expected
digests), ``trainer.collectives``, ``http.<route>`` (one entry per HTTP call, its whole round trip),
``shm.write`` / ``shm.commit`` (the shared-memory plane). Stages may overlap (an HTTP call that waits
while the trainer streams): they are not meant to sum to the push.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Mapping


class Stages:
    """Wall seconds and call counts per stage name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def add(self, name: str, seconds: float, calls: int = 1) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + float(seconds)
        self.calls[name] = self.calls.get(name, 0) + int(calls)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - began)

    def merge(self, other: Mapping[str, float] | "Stages" | None, prefix: str = "") -> None:
        if other is None:
            return
        items = other.seconds.items() if isinstance(other, Stages) else other.items()
        for k, v in items:
            if isinstance(v, (int, float)):
                self.add(prefix + k, v, other.calls.get(k, 1) if isinstance(other, Stages) else 1)

    def as_dict(self) -> dict[str, float]:
        return dict(self.seconds)

    def http_calls(self) -> int:
        return sum(n for k, n in self.calls.items() if k.startswith("http."))


def format_stages(stages: Mapping[str, float], total: float | None = None, width: int = 22) -> str:
    """One line per stage, slowest first, with its share of ``total``."""
    lines = []
    for name, s in sorted(stages.items(), key=lambda kv: -kv[1]):
        share = f"  {s / total:6.1%}" if total else ""
        lines.append(f"  {name:<{width}} {s * 1e3:9.1f} ms{share}")
    return "\n".join(lines)
