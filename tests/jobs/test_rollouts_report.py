"""jobs/rollouts.py's per-step engine columns: ``engine_weights_equal`` says whether the engine holds the
served bits after the step's push. A push that changed nothing (a step with no reward spread has no
gradient) loads and checks nothing; the engine still holds what the last loading push was checked
against, so the column keeps that answer instead of reading as a mismatch. (The SmolLM2 job's step 1 read
False before: its push carried 0 parameters, and ``verified`` is None for a push that checked nothing.)"""
from __future__ import annotations

from types import SimpleNamespace

from faircast_jobs.rollouts import VllmRollouts


class _Pushes:
    """The reports a run of pushes returned, in order (what ``ServedPush.push`` reports per step)."""

    def __init__(self, *reports):
        self.reports = list(reports)

    def push(self):
        return self.reports.pop(0)


def report(params: int, verified):
    return SimpleNamespace(params=params, verified=verified, seconds=0.01, bytes=params * 10, load_seconds=0.0,
                           verify_seconds=0.0)


def test_a_push_that_changed_nothing_keeps_the_last_checks_answer():
    rollouts = object.__new__(VllmRollouts)  # the bookkeeping only: no engine, no DeepSpeed
    rollouts.measure_ms, rollouts.engine_equal = 0.0, True  # after the first (verified) dense push
    rollouts.push = _Pushes(report(0, None), report(12, True), report(0, None), report(3, None), report(0, None))
    seen = [rollouts.after_step()["engine_weights_equal"] for _ in range(5)]
    # nothing changed: still the verified bits; a verified delta; nothing again; an unchecked delta: not known
    # equal, and a push after it that changed nothing does not make it so
    assert seen == [True, True, True, False, False]
