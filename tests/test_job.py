"""The GRPO job end to end under the `deepspeed` runner: 2 CPU ranks, every mode, a few steps."""
from __future__ import annotations

import csv
import math
import re

import pytest

from conftest import ROOT, cpu_env, deepspeed_runner, free_port, run_logged

MODES = ("fp32", "nearest", "stochastic", "dither", "error_feedback")
STEPS = 3


@pytest.fixture(scope="module")
def job_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    cmd = [deepspeed_runner(), "--num_gpus", "2", "--master_port", str(free_port()),
           "--module", "faircast_ds.jobs.grpo", "--steps", str(STEPS), "--seeds", "1", "--hidden", "64",
           "--rollouts", "16", "--horizon", "8", "--out", str(out), "--name", "t"]
    run_logged(cmd, out / "launch.log", env=cpu_env(), timeout=300, cwd=ROOT)
    return out / "t", (out / "launch.log").read_text()


def test_outputs_exist_and_are_well_formed(job_run):
    run_dir, log = job_run
    png = (run_dir / "reward.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    table = (run_dir / "results.md").read_text()
    lines = [line for line in table.splitlines() if line.startswith("|")]
    assert len(lines) == 2 + len(MODES)
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert [line.split("|")[1].strip() for line in lines[2:]] == list(MODES)
    # W/T/L against RN, recomputed from steps.csv: per seed, the mean reward over the last 20% of steps
    # (at least one) minus RN's, |difference| < the tie threshold the legend states is a tie
    tie = float(re.search(r"\|difference\| < ([0-9.eE+-]+) is a tie", table).group(1))
    with open(run_dir / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    n_tail = max(1, round(0.2 * STEPS))
    final = {m: {} for m in MODES}
    for r in rows:
        if int(r["step"]) > STEPS - n_tail:
            final[r["mode"]].setdefault(int(r["seed"]), []).append(float(r["reward"]))
    cells = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in lines[2:]}
    assert cells["nearest"] == "—"
    for mode in MODES:
        if mode == "nearest":
            continue
        diffs = [sum(v) / len(v) - sum(final["nearest"][seed]) / len(final["nearest"][seed])
                 for seed, v in final[mode].items()]
        want = (sum(d >= tie for d in diffs), sum(abs(d) < tie for d in diffs), sum(d <= -tie for d in diffs))
        assert tuple(int(k) for k in cells[mode].split("/")) == want, (mode, cells[mode], diffs)
        assert sum(want) == 1  # one seed
    assert "final reward" in (run_dir / "summary.txt").read_text()
    assert "final reward" in log  # the end-of-run screen
    # rank 0 announces Fair Cast once per engine that has it: the four casts, not the fp32 reference
    active = [line.split("mode=")[1].split()[0] for line in log.splitlines() if "[fair_cast] active:" in line]
    assert active == list(MODES[1:])


def test_steps_csv(job_run):
    run_dir, _ = job_run
    with open(run_dir / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(MODES) * STEPS
    by_mode = {m: [r for r in rows if r["mode"] == m] for m in MODES}
    for mode, mine in by_mode.items():
        assert [int(r["step"]) for r in mine] == list(range(1, STEPS + 1)), mode
        for r in mine:
            assert 0.0 <= float(r["reward"]) <= 1.0
            assert 0.0 <= float(r["changed_fraction"]) <= 1.0
            assert int(r["numel"]) == int(by_mode["fp32"][0]["numel"])  # every mode serves the same model
    # same seed, same bf16 init, same prompts and sampling noise: the bf16 modes' first rollouts are identical
    assert len({by_mode[m][0]["reward"] for m in MODES[1:]}) == 1
    # the fp32 reference has no Fair Cast: no diagnostics, no cast time, fp32 served (4 bytes an element)
    ref = by_mode["fp32"]
    assert all(math.isnan(float(r["lag_steps"])) and math.isnan(float(r["cast_ms"])) for r in ref)
    assert all(int(r["sync_bytes"]) == int(r["sync_bytes_dense"]) == 4 * int(r["numel"]) for r in ref)
    for mode in MODES[1:]:
        assert all(not math.isnan(float(r["gap_spacings"])) and float(r["cast_ms"]) >= 0 for r in by_mode[mode])
        assert all(int(r["sync_bytes_dense"]) == 2 * int(r["numel"]) for r in by_mode[mode])
        for r in by_mode[mode]:  # a delta: at least the changed values, at most their COO encoding
            assert 2 * int(r["changed"]) <= int(r["sync_bytes"]) <= 6 * int(r["changed"])


def test_changed_fractions_follow_the_modes(job_run):
    run_dir, _ = job_run
    with open(run_dir / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    mean = {m: sum(float(r["changed_fraction"]) for r in rows if r["mode"] == m) / STEPS for m in MODES}
    assert mean["fp32"] > 0.9  # an fp32 update moves nearly every element
    # fresh noise every step flips far more served weights than round-to-nearest
    assert mean["stochastic"] > 1.5 * mean["nearest"]
    assert mean["error_feedback"] > mean["nearest"]
    # dither's thresholds are fixed: from the second step on it changes far fewer than stochastic
    later = {m: sum(float(r["changed_fraction"]) for r in rows if r["mode"] == m and int(r["step"]) > 1)
             for m in ("dither", "stochastic")}
    assert later["dither"] < later["stochastic"]
    assert all(mean[m] < 0.9 for m in MODES[1:])
