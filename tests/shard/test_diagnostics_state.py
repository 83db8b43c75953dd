"""The diagnostics' sampled master history survives a checkpoint (shard/diagnostics.py
``checkpoint_state``/``restore_checkpoint_state``, saved by shard/state.py): a restored observer, also under
another sharding of the same parameters, reads the same lag at the next report as the one that never stopped.
The oracle is the uninterrupted observer's own figures; no launch (the observer is local until ``compute``)."""
from __future__ import annotations

import math

import pytest
import torch

from faircast_ds.config.section import DiagnosticsConfig
from faircast_ds.shard.caster import CastStats, ShardSlice, with_padding
from faircast_ds.shard.diagnostics import Diagnostics

PARAMS = {"a.w": 3000, "b.w": 1200, "c.b": 50}
CFG = DiagnosticsConfig(every=1, sample=2000, horizon=16)


def masters(step: int) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master at ``step``: a drift of one bf16-invisible nudge a step plus noise."""
    out = {}
    for i, (name, n) in enumerate(PARAMS.items()):
        gen = torch.Generator().manual_seed(100 * i + step)
        base = torch.linspace(0.5, 1.5, n)
        out[name] = base + step * 3e-4 + torch.randn(n, generator=gen) * 1e-5
    return out


def layout(cuts: list[list[tuple[str, int, int]]]):
    """Flat groups from (name, start, numel) pieces, each group padded by 5 elements at its end."""
    groups = []
    for key, pieces in enumerate(cuts):
        slices, at = [], 0
        for name, start, numel in pieces:
            slices.append(ShardSlice(name, start, numel, at))
            at += numel
        groups.append((key, with_padding(slices, at + 5)))
    return groups


ONE = layout([[("a.w", 0, 3000), ("b.w", 0, 1200)], [("c.b", 0, 50)]])
OTHER = layout([[("c.b", 0, 50), ("a.w", 1700, 1300)], [("b.w", 0, 1200), ("a.w", 0, 1700)]])


def flat(groups, step: int, served_bits_of=None):
    """(key, master, served, slices) of ``groups`` at ``step``; served is the step-1 master in bf16 (a stale copy)."""
    m_now, m_old = masters(step), masters(1)
    out = []
    for key, slices in groups:
        total = slices[-1].offset + slices[-1].numel
        master, served = torch.zeros(total), torch.zeros(total, dtype=torch.bfloat16)
        for s in slices:
            if not s.is_padding:
                master[s.offset:s.offset + s.numel] = m_now[s.name][s.start:s.start + s.numel]
                served[s.offset:s.offset + s.numel] = m_old[s.name][s.start:s.start + s.numel].to(torch.bfloat16)
        out.append((key, master, served, slices))
    return out


def run(diag: Diagnostics, groups, steps) -> None:
    for step in steps:
        for key, master, served, slices in flat(groups, step):
            diag.on_cast(key, master, served, slices, step)


def figures(diag: Diagnostics, groups, step: int) -> dict[str, float]:
    numel = sum(s.numel for _, slices in groups for s in slices if not s.is_padding)
    return diag.compute(flat(groups, step), CastStats(step=step, numel=numel, changed=0), step)


@pytest.mark.parametrize("saved_under", ["one", "other"])
def test_a_restored_history_reads_the_uninterrupted_lag_under_any_sharding(saved_under):
    straight = Diagnostics(CFG, sum(PARAMS.values()))
    run(straight, ONE, range(1, 9))
    want = figures(straight, ONE, 8)
    assert want["lag_drift_steps"] > 3 and want["lag_steps"] > 3  # the stale copy trails: a lag to lose

    saved = Diagnostics(CFG, sum(PARAMS.values()))
    run(saved, {"one": ONE, "other": OTHER}[saved_under], range(1, 6))  # OTHER saves a.w's tail first
    state = saved.checkpoint_state()
    assert state["history"].shape == (16, int(state["index"].numel())) and state["first"] == 1
    for groups in (ONE, OTHER):
        resumed = Diagnostics(CFG, sum(PARAMS.values()))
        assert resumed.restore_checkpoint_state([state], flat(groups, 5)) is None
        run(resumed, groups, range(5, 9))  # the restore's recast at step 5, then steps 6..8
        got = figures(resumed, groups, 8)
        for k, v in want.items():
            assert math.isclose(got[k], v, rel_tol=1e-9, abs_tol=1e-12), (k, got[k], v)
        assert resumed.sample_size() == straight.sample_size()

    fresh = Diagnostics(CFG, sum(PARAMS.values()))  # what a resume without the history reads
    run(fresh, ONE, range(5, 9))
    assert figures(fresh, ONE, 8)["lag_steps"] < want["lag_steps"]


def test_a_history_split_over_two_rank_files_restores_whole():
    groups = layout([[("a.w", 0, 3000)], [("b.w", 0, 1200), ("c.b", 0, 50)]])
    rank0, rank1 = Diagnostics(CFG, sum(PARAMS.values())), Diagnostics(CFG, sum(PARAMS.values()))
    run(rank0, groups[:1], range(1, 4))
    run(rank1, groups[1:], range(1, 4))
    whole = Diagnostics(CFG, sum(PARAMS.values()))
    assert whole.restore_checkpoint_state([rank0.checkpoint_state(), rank1.checkpoint_state()], flat(ONE, 3)) is None
    straight = Diagnostics(CFG, sum(PARAMS.values()))
    run(straight, ONE, range(1, 4))
    for key in straight._history:
        assert torch.equal(whole._history[key].isnan(), straight._history[key].isnan())
        assert torch.equal(whole._history[key].nan_to_num(), straight._history[key].nan_to_num())


def test_what_cannot_be_restored_is_named():
    diag = Diagnostics(CFG, sum(PARAMS.values()))
    assert "no diagnostics history" in diag.restore_checkpoint_state([None], flat(ONE, 2))
    other = Diagnostics(DiagnosticsConfig(every=1, sample=2000, horizon=8), sum(PARAMS.values()))
    run(other, ONE, range(1, 3))
    assert "horizon differs" in diag.restore_checkpoint_state([other.checkpoint_state()], flat(ONE, 2))
    part = Diagnostics(CFG, sum(PARAMS.values()))
    run(part, layout([[("a.w", 0, 3000)]]), range(1, 3))
    assert "lacks b.w" in diag.restore_checkpoint_state([part.checkpoint_state()], flat(ONE, 2))


def test_a_reload_in_the_same_process_keeps_the_sample_without_rehashing(monkeypatch):
    """An observer that already tracks a flat group keeps its sample when a load restores the history
    (the sample depends only on the slices): no element is hashed again, and the figures are those of an
    observer restored fresh. A group whose slices changed is sampled again."""
    from faircast_ds.shard import diagnostics

    live = Diagnostics(CFG, sum(PARAMS.values()))
    run(live, ONE, range(1, 6))
    state = live.checkpoint_state()
    hashed = []
    original = diagnostics.sampled_indices
    monkeypatch.setattr(diagnostics, "sampled_indices", lambda part, *a, **k: hashed.append(part.name) or original(part, *a, **k))
    assert live.restore_checkpoint_state([state], flat(ONE, 5)) is None
    assert hashed == []  # the same slices: the sample kept
    fresh = Diagnostics(CFG, sum(PARAMS.values()))
    older = {k: v for k, v in state.items() if k not in ("threshold", "covered")}  # a checkpoint before those fields
    assert fresh.restore_checkpoint_state([older], flat(ONE, 5)) is None
    assert sorted(hashed) == sorted(s.name for _, slices in ONE for s in slices if not s.is_padding)
    for d in (live, fresh):
        run(d, ONE, range(5, 9))
    want, got = figures(fresh, ONE, 8), figures(live, ONE, 8)
    for k, v in want.items():
        assert math.isclose(got[k], v, rel_tol=1e-9, abs_tol=1e-12), (k, got[k], v)
    hashed.clear()
    assert live.restore_checkpoint_state([older], flat(OTHER, 5)) is None  # another layout: sampled again
    assert hashed


@pytest.mark.parametrize("saved_under", ["one", "other"])
def test_a_fresh_process_reads_its_sample_from_the_checkpoint_without_hashing(monkeypatch, saved_under):
    """A resumed process (a fresh observer) takes the sample's elements from the checkpoint when every
    rank file drew them with its own threshold and together covered its slices: no element hashed, and
    the sample, the history and the figures are those of an observer that hashed. The oracle hashes with
    ``sampled_indices`` itself. Another sample size, or rank files that miss a slice, hash again."""
    from faircast_ds.shard import diagnostics

    groups = {"one": ONE, "other": OTHER}[saved_under]
    half = [layout([[("a.w", 0, 1700)], [("c.b", 0, 50)]]), layout([[("a.w", 1700, 1300), ("b.w", 0, 1200)]])]
    ranks = [Diagnostics(CFG, sum(PARAMS.values())) for _ in half]
    for d, g in zip(ranks, half):
        run(d, g, range(1, 6))
    states = [d.checkpoint_state() for d in ranks]
    hashing = Diagnostics(CFG, sum(PARAMS.values()))
    assert hashing.restore_checkpoint_state([{k: v for k, v in st.items() if k != "threshold"} for st in states],
                                            flat(groups, 5)) is None
    hashed = []
    original = diagnostics.sampled_indices
    monkeypatch.setattr(diagnostics, "sampled_indices", lambda part, *a, **k: hashed.append(part.name) or original(part, *a, **k))
    fresh = Diagnostics(CFG, sum(PARAMS.values()))
    assert fresh.restore_checkpoint_state(states, flat(groups, 5)) is None
    assert hashed == []
    for key, slices in groups:
        want = torch.cat([s.offset + original(s, hashing._threshold) for s in slices if not s.is_padding])
        assert torch.equal(fresh._positions[key], want) and want.numel() > 0
        assert torch.equal(fresh._history[key].nan_to_num(), hashing._history[key].nan_to_num())
    for d in (fresh, hashing):
        run(d, groups, range(5, 9))
    want, got = figures(hashing, groups, 8), figures(fresh, groups, 8)
    for k, v in want.items():
        assert math.isclose(got[k], v, rel_tol=1e-9, abs_tol=1e-12), (k, got[k], v)

    other_size = Diagnostics(DiagnosticsConfig(every=1, sample=1000, horizon=16), sum(PARAMS.values()))
    assert other_size.restore_checkpoint_state(states, flat(groups, 5)) is not None or hashed  # drawn again
    assert hashed
    hashed.clear()
    lacking = Diagnostics(CFG, sum(PARAMS.values()))
    assert "lacks" in lacking.restore_checkpoint_state(states[1:], flat(groups, 5))  # a.w's head missing: hashed
    assert hashed
