"""jobs/rollouts.py's per-step engine columns: ``engine_weights_equal`` says whether the engine holds the
served bits after the step's push. A push that changed nothing (a step with no reward spread has no
gradient) loads and checks nothing; the engine still holds what the last loading push was checked
against, so the column keeps that answer instead of reading as a mismatch. (The SmolLM2 job's step 1 read
False before: its push carried 0 parameters, and ``verified`` is None for a push that checked nothing.)
And what a step's rollouts ask of the engine: every prompt with its own seed, as many in flight as
``--engine-requests`` says (0: all of them)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

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


class _Engine:
    """What ``VllmServer.generate`` is asked: the prompts, the tokens per answer, the seeds and how many in flight."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, max_tokens, seeds, workers=8):
        self.calls.append((prompts.clone(), max_tokens, list(seeds), workers))
        n = prompts.shape[0]
        return torch.arange(n * max_tokens).view(n, max_tokens), torch.full((n, max_tokens), -0.5)


class _OneRank:
    @staticmethod
    def broadcast(tensor, src):
        assert src == 0


def test_a_steps_rollouts_go_to_the_engine_all_at_once_or_as_many_as_asked():
    """--engine-requests: 0 puts every rollout of the step in flight at once (one batch per decode step), a number
    caps it; each rollout keeps its own seed either way (rollout_seed of seed, step, rank, index)."""
    from faircast_jobs.rollouts import rollout_seed

    prompts = torch.arange(6 * 3).view(6, 3)
    for requests, want in ((0, 6), (4, 4)):
        rollouts = object.__new__(VllmRollouts)  # no server, no DeepSpeed: what reaches the engine only
        rollouts.rank, rollouts.world, rollouts.dist, rollouts.engine = 0, 1, _OneRank(), _Engine()
        rollouts.requests = requests
        seqs, logps = rollouts.rollout(None, 7, 3, prompts, torch.zeros(6, 5))
        [(sent, tokens, seeds, workers)] = rollouts.engine.calls
        assert workers == want and tokens == 5 and torch.equal(sent, prompts)
        assert seeds == [rollout_seed(7, 3, 0, i) for i in range(6)]
        assert torch.equal(seqs[:, :3], prompts) and seqs.shape == (6, 8) and float(logps[0, 0]) == -0.5


def test_make_hands_the_requests_in_flight_to_the_vllm_source(monkeypatch):
    from faircast_jobs import rollouts

    made = {}
    monkeypatch.setattr(rollouts, "VllmRollouts", lambda *a, **kw: made.update(kw) or "source")
    assert rollouts.make("vllm", sample=None, ds_engine=None, view=None, fp32=False, seed=0, max_len=8,
                         run_dir="x", requests=5, gemm_cache=True, spin_s=0.0) == "source"
    assert (made["requests"], made["gemm_cache"], made["spin_s"]) == (5, True, 0.0)
