"""How long a vLLM process's message-queue readers spin before they sleep (``FAIRCAST_VLLM_SPIN_S``).

vLLM's engine core and its workers talk through shared-memory queues (``shm_broadcast.MessageQueue``). A reader
whose queue is empty keeps calling ``sched_yield`` for ``busy_loop_s`` seconds after its last read (1 s in vLLM),
and only then sleeps until the writer's notification. On a GPU host that spin costs a spare core and saves
microseconds per step. On a CPU engine it competes with the compute: while a worker runs a decode step (~0.1 s
for SmolLM2-135M on this project's 2-core machine) the engine core spins through all of it, and sampling from
`vllm serve` had its engine core in ``sched_yield`` for 28% of a core's time (py-spy at 50 Hz during the
campaign; a third to a half of a core busy by /proc sampling, docs/pretrained.md). At 0
a batch of the GRPO job's 16 rollouts took 4.38 s against 6.28 s, the same tokens (benchmarks/engine_spin.py).

With ``FAIRCAST_VLLM_SPIN_S=<seconds>`` in a vLLM process's environment (``VllmServer(spin_s=...)``, the GRPO job's
``--engine-spin-s``) every reader created afterwards spins that long instead; 0 goes straight to sleeping on the
notification, the path vLLM itself takes after a second without reads. Unset: vLLM's own. A value that is not a
non-negative finite number stops the process at start, naming the variable; each process that took a value says
so in its log (``[fair_cast] FAIRCAST_VLLM_SPIN_S=...``). Nothing computed changes: only how a process waits
for the next message.
"""
from __future__ import annotations

import math
import os
import sys

ENV = "FAIRCAST_VLLM_SPIN_S"


def valid(seconds: object) -> bool:
    """Whether ``seconds`` is a spin: a finite number >= 0 (not a bool). The environment, VllmServer and the
    job's --engine-spin-s all check with this."""
    return (not isinstance(seconds, bool) and isinstance(seconds, (int, float)) and math.isfinite(seconds)
            and seconds >= 0)


def chosen(environ=os.environ) -> float | None:
    """The environment's spin in seconds, or None (unset or empty: vLLM's own)."""
    value = environ.get(ENV, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not valid(seconds):
        raise ValueError(f"{ENV}={value!r}: a number of seconds >= 0 (0: readers sleep at once)")
    return seconds


def install(environ=os.environ) -> float | None:
    """Make vLLM's queue readers spin for the environment's seconds (idempotent); returns them, or None."""
    seconds = chosen(environ)
    if seconds is None:
        return None
    from vllm.distributed.device_communicators import shm_broadcast

    condition = shm_broadcast.SpinCondition
    original = getattr(condition.__init__, "faircast_original", condition.__init__)

    def __init__(self, is_reader, context, notify_address, busy_loop_s=seconds):
        original(self, is_reader, context, notify_address, busy_loop_s=busy_loop_s)

    __init__.faircast_original = original
    condition.__init__ = __init__
    print(f"[fair_cast] {ENV}={seconds:g}: this vLLM process's queue readers spin {seconds:g} s before they sleep "
          f"(pid {os.getpid()})", file=sys.stderr, flush=True)
    return seconds
