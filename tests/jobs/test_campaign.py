"""jobs/campaign.py: the pre-registered campaign's analysis, against oracles that share no code with it:
hand-made runs with known endpoints and W/T/L, scipy's Student-t interval over the per-seed differences
computed here, numpy's bootstrap written out here, and a git repository in tmp_path whose history puts the
registration before or after the rows."""
from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from faircast_jobs import campaign

ROOT = Path(__file__).resolve().parents[2]
STEPS = 100
LR = 1e-5
# a committed table (paper_table's columns) and a job's run folder (its steps.csv and job.json)
TABLE = ["run", "lr", "mode", "seed", "step", "reward", "changed", "numel", "changed_fraction", "gap_spacings",
         "lag_steps", "lag_drift_steps", "bias_spacings", "kl_master", "rollout_ms", "train_ms", "extra_ms"]
JOB = TABLE[2:]


def registration(**changes) -> dict:
    reg = {"lr": LR, "steps": STEPS, "pair": ["dither", "nearest"], "seeds": [0, 1, 2, 3], "fp32_seeds": [0, 1],
           "reproduce": {"seeds": [0], "steps": 3, "against": "committed.csv",
                         "columns": ["reward", "changed", "changed_fraction", "kl_master"]},
           "primary": {"endpoint": "mean reward over steps 1-100 of one run", "tie_band": 0.02},
           "secondary": {"endpoint": "mean reward over steps 81-100 of one run", "tie_band": 0.02}}
    reg.update(changes)
    return reg


def rows(run: str, mode: str, seed: int, rewards) -> list[dict]:
    return [{"run": run, "lr": LR, "mode": mode, "seed": seed, "step": t, "reward": r,
             "changed": 1000 * seed + t, "numel": 10**6, "changed_fraction": (1000 * seed + t) / 1e6,
             "kl_master": 0.001 * t, "rollout_ms": 1.0, "train_ms": 1.0, "extra_ms": 1.0}
            for t, r in enumerate(rewards, 1)]


def write_table(path: Path, table_rows) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=TABLE)
        w.writeheader()
        for r in table_rows:
            w.writerow({k: repr(r[k]) if isinstance(r.get(k), float) else r.get(k, "nan") for k in TABLE})


def write_run(folder: Path, run_rows) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.json").write_text(json.dumps({"lr": LR, "steps": STEPS}))
    with open(folder / "steps.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=JOB)
        w.writeheader()
        for r in run_rows:
            w.writerow({k: r.get(k, "nan") for k in JOB})


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout


def commit(repo: Path, *paths: str, message: str = "c") -> str:
    git(repo, "add", *paths)
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").strip()


class Campaign:
    """A repository in tmp_path: the registration and seed 0's committed rows in one commit, the other
    seeds' runs as run folders under runs/ (not committed), seed 0's reproduction runs beside them."""

    def __init__(self, root: Path, series: dict[tuple[str, int], list[float]], reg: dict | None = None,
                 repro: bool = True, register: bool = True):
        self.root = root
        root.mkdir(exist_ok=True)
        git(root, "init", "-q")
        self.reg = reg or registration()
        (root / "prereg.json").write_text(json.dumps(self.reg))
        seed0 = [r for (mode, seed), rw in sorted(series.items()) if seed == 0 for r in rows(f"old-{mode}", mode, 0, rw)]
        write_table(root / "committed.csv", seed0)
        commit(root, *(["prereg.json"] if register else []), "committed.csv", message="registration")
        for (mode, seed), rw in series.items():
            if seed != 0:
                write_run(root / "runs" / f"seed{seed}-{mode}", rows("x", mode, seed, rw))
        if repro:
            for mode in ("nearest", "dither"):
                write_run(root / "runs" / f"repro-seed0-{mode}", rows("x", mode, 0, series[mode, 0][:3]))

    def run_folders(self) -> list[str]:
        return sorted(str(p) for p in (self.root / "runs").iterdir())

    def main(self, *extra: str, rows_from=None) -> int:
        given = self.run_folders() if rows_from is None else rows_from
        return campaign.main(["--prereg", str(self.root / "prereg.json"), *given, *extra])


def base(seed: int) -> list[float]:
    """A nearest curve no other seed shares: 0.3 + 0.01 * seed, ±0.05 on alternate steps (mean exact)."""
    return [0.3 + 0.01 * seed + (0.05 if t % 2 else -0.05) for t in range(STEPS)]


def shifted(seed: int, diff: float, within: float = 0.0) -> list[float]:
    """Dither = nearest + diff on every step; ``within`` adds ±within in step pairs, leaving the mean."""
    return [r + diff + (within if (t // 2) % 2 else -within) for t, r in enumerate(base(seed))]


def four_seeds(diffs, within=0.0) -> dict[tuple[str, int], list[float]]:
    series = {}
    for seed, d in enumerate(diffs):
        series["nearest", seed] = base(seed)
        series["dither", seed] = shifted(seed, d, within if seed % 2 else -within)
        if seed in (0, 1):
            series["fp32", seed] = [r + 0.07 * (seed + 1) for r in base(seed)]
    return series


def line(text: str, start: str) -> str:
    return next(ln for ln in text.splitlines() if ln.startswith(start))


def numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"[+-]?\d+\.\d+", text)]


def close3(printed: list[float], expected) -> bool:
    """Printed to 3 decimals: each within half a unit of the third decimal of the value."""
    return len(printed) >= len(expected) and all(abs(p - e) <= 5e-4 + 1e-12 for p, e in zip(printed, expected))


def t_interval(diffs) -> tuple[float, float, float]:
    d = np.asarray(diffs, dtype=np.float64)
    half = scipy_stats.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size)
    return d.mean(), d.mean() - half, d.mean() + half


def bootstrap(diffs) -> tuple[float, float]:
    d = np.asarray(diffs, dtype=np.float64)
    picks = np.random.default_rng(0).integers(0, d.size, size=(10_000, d.size))
    means = d[picks].mean(axis=1)
    return np.percentile(means, 2.5), np.percentile(means, 97.5)


# ---- per seed: endpoints and W/T/L ---------------------------------------------------------------------

def boundary_series() -> dict[tuple[str, int], list[float]]:
    """Rewards in sixteenths, so every sum is exact. Nearest 0.125 on seed 0, 0.5 on the others (step 1:
    0, 2/16, 1/16, 3/16, so no two seeds share a curve); dither adds or takes 0.5 on chosen steps. Primary
    (steps 1-100) and secondary (81-100) differences: seed 0 +0.0200 (W: the band itself is not a tie) and
    +0.025 (W); seed 1 +0.015 (T) and 0 (T); seed 2 -0.0200 (L) and -0.025 (L); seed 3 +0.1025 (W) and
    +0.0125 (T). Seeds 0 and 2 are chosen so that means taken in floats land inside the band (0.01999...,
    -0.01999...): the exact difference is the band's edge, not a tie."""
    out = {}
    plus = {0: ([11, 12, 13, 81], []), 1: ([11, 12, 13], []), 2: ([], [11, 12, 13, 90]),
            3: (list(range(11, 31)) + [95], [])}
    first = {0: 0.0, 1: 2 / 16, 2: 1 / 16, 3: 3 / 16}
    for seed, (up, down) in plus.items():
        near = [0.125 if seed == 0 else 0.5] * STEPS
        near[0] = first[seed]
        dith = list(near)
        for t in up:
            dith[t - 1] += 0.5 if t != 95 else 0.25
        for t in down:
            dith[t - 1] -= 0.5
        out["nearest", seed], out["dither", seed] = near, dith
    return out


def test_per_seed_endpoints_and_wtl_under_the_band(tmp_path, capsys):
    c = Campaign(tmp_path / "repo", boundary_series(), registration(fp32_seeds=[]))
    assert c.main() == 0
    out = capsys.readouterr().out
    assert "4 of 4 seeds complete (both modes, 100 steps): 0, 1, 2, 3." in out
    assert "- seed 0 counts: dither: steps 1-3 equal" in out
    rows_ = {s: line(out, f"| {s} |") for s in range(4)}
    assert rows_[0].endswith("| +0.0200 | W | 0.1250 | 0.1500 | +0.0250 | W |")
    assert rows_[1].endswith("| +0.0150 | T | 0.5000 | 0.5000 | +0.0000 | T |")
    assert rows_[2].endswith("| -0.0200 | L | 0.5000 | 0.4750 | -0.0250 | L |")
    assert rows_[3].endswith("| +0.1025 | W | 0.5000 | 0.5125 | +0.0125 | T |")
    assert line(out, "| dither − nearest | primary").endswith("| 2/1/1 |")
    assert line(out, "| dither − nearest | secondary").endswith("| 1/2/1 |")
    assert "Within-run noise" not in out  # only when asked


# ---- across seeds: over the seeds, never over the steps ------------------------------------------------

DIFFS = [0.25, 0.1, 0.4, -0.05]


def across_rows(an, endpoint="primary"):
    return {(c.a, c.b): c for c in an.across if c.endpoint.name == endpoint}


def analysed(c: Campaign, *extra):
    plan = campaign.load_plan(str(c.root / "prereg.json"))
    runs, where = campaign.read_runs([str(c.root / "committed.csv"), *c.run_folders()], plan.lr)
    return campaign.analyse(plan, runs, where, *extra)


def test_the_across_seed_interval_is_students_t_and_the_bootstrap_over_the_seeds(tmp_path, capsys):
    c = Campaign(tmp_path / "repo", four_seeds(DIFFS))
    assert c.main() == 0
    out = capsys.readouterr().out
    mean, lo, hi = t_interval(DIFFS)
    blo, bhi = bootstrap(DIFFS)
    row = line(out, "| dither − nearest | primary")
    assert "| 4 (0, 1, 2, 3) |" in row and "(3) |" in row  # n seeds and df = n - 1
    assert close3(numbers(row), [mean, lo, hi, blo, bhi])
    got = across_rows(analysed(c))["dither", "nearest"]
    assert got.seeds == [0, 1, 2, 3] and got.mean == pytest.approx(mean, abs=1e-12)
    assert got.t == pytest.approx((lo, hi), abs=1e-9) and got.boot == pytest.approx((blo, bhi), abs=1e-12)


def test_noise_inside_a_seed_that_keeps_its_mean_leaves_the_across_seed_interval_alone(tmp_path):
    """Within each seed the per-step differences swing by ±0.3 around the same per-seed mean: an interval
    over seeds is unchanged, one over the 400 pooled steps would not be (nor would it match scipy's over 4)."""
    flat = across_rows(analysed(Campaign(tmp_path / "flat", four_seeds(DIFFS))))["dither", "nearest"]
    noisy = across_rows(analysed(Campaign(tmp_path / "noisy", four_seeds(DIFFS, within=0.3))))["dither", "nearest"]
    _, lo, hi = t_interval(DIFFS)
    for got in (flat, noisy):
        assert got.t == pytest.approx((lo, hi), abs=1e-9)
    assert noisy.boot == pytest.approx(flat.boot, abs=1e-12)


def test_fp32_on_the_seeds_that_have_it(tmp_path, capsys):
    c = Campaign(tmp_path / "repo", four_seeds(DIFFS))
    assert c.main() == 0
    out = capsys.readouterr().out
    assert "The fp32 reference, on the seeds that have it (0, 1):" in out
    dither_fp32 = [DIFFS[0] - 0.07, DIFFS[1] - 0.14]  # fp32 = nearest + 0.07 (seed 0), + 0.14 (seed 1)
    mean, lo, hi = t_interval(dither_fp32)
    row = line(out, "| dither − fp32 | primary")
    assert "| 2 (0, 1) |" in row and close3(numbers(row), [mean, lo, hi])
    assert line(out, "| nearest − fp32 | primary").startswith("| nearest − fp32 | primary (steps 1-100) | 2 (0, 1) | -0.105 |")


def test_a_few_seeds_intervals_carry_their_caveat(tmp_path, capsys):
    """Four seeds (and the fp32 rows' two): the table says how little so few seeds' intervals say."""
    c = Campaign(tmp_path / "repo", four_seeds(DIFFS))
    assert c.main() == 0
    out = capsys.readouterr().out
    assert "With 2 seeds these intervals say little: the t interval has 1 degree(s) of freedom" in out
    assert "zero width, which is equal differences, not certainty" in out


def test_the_pooled_steps_bootstrap_only_when_asked_and_labelled_as_within_run_noise(tmp_path, capsys):
    c = Campaign(tmp_path / "repo", four_seeds(DIFFS))
    assert c.main("--pooled-steps") == 0
    out = capsys.readouterr().out
    section = out[out.index("## Within-run noise, seeds pooled (not an across-seed interval)"):]
    assert "says nothing about how much the result varies from seed to seed" in section
    assert line(section, "| primary").startswith("| primary (steps 1-100) | 4 × 100 | +0.175 |")


# ---- the reproduction check -----------------------------------------------------------------------------

@pytest.mark.parametrize("column", ["reward", "changed", "changed_fraction", "kl_master"])
def test_a_reproduction_that_differs_in_any_column_leaves_its_seed_out(tmp_path, capsys, column):
    c = Campaign(tmp_path / "repo", four_seeds(DIFFS))
    folder = c.root / "runs" / "repro-seed0-dither"
    with open(folder / "steps.csv", newline="") as f:
        got = list(csv.DictReader(f))
    got[1][column] = repr(float(got[1][column]) + 1e-3)
    write_run(folder, got)
    assert c.main() == 0
    out = capsys.readouterr().out
    assert f"- seed 0 does not count: dither: differs at step 2, {column}:" in out
    assert "3 of 4 seeds complete" in out and "- seed 0 incomplete, left out: its committed rows do not count" in out
    assert "| dither − nearest | primary (steps 1-100) | 3 (1, 2, 3) |" in out


def test_a_seed_run_again_in_full_under_its_committed_name_counts_with_its_new_rows(tmp_path, capsys):
    """Seed 0's reproduction fails (another CPU rounds differently), so the campaign runs it again in full
    in folders named as the committed runs: those rows are another run, not the committed one read twice."""
    c = Campaign(tmp_path / "repo", four_seeds(DIFFS))
    folder = c.root / "runs" / "repro-seed0-dither"
    with open(folder / "steps.csv", newline="") as f:
        got = list(csv.DictReader(f))
    got[0]["reward"] = repr(float(got[0]["reward"]) + 1e-3)
    write_run(folder, got)
    again = 0.5  # the re-run's difference, not the committed 0.25
    for mode, rewards in (("nearest", shifted(0, 0.003)), ("dither", shifted(0, 0.003 + again))):
        write_run(c.root / "runs" / f"old-{mode}", rows("old-" + mode, mode, 0, rewards))
    assert c.main() == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "- seed 0 does not count: dither: differs at step 1, reward:" in out
    assert "4 of 4 seeds complete" in out
    mean, lo, hi = t_interval([again, *DIFFS[1:]])
    assert close3(numbers(line(out, "| dither − nearest | primary")), [mean, lo, hi])


def test_an_unchecked_seed_counts_only_when_told_and_says_so(tmp_path, capsys):
    c = Campaign(tmp_path / "repo", four_seeds(DIFFS), repro=False)
    assert c.main() == 0
    assert "- seed 0 does not count: dither: not checked yet (repro-seed0-dither has 0 of 3 steps)" in \
        capsys.readouterr().out
    assert c.main("--count-unchecked") == 0
    out = capsys.readouterr().out
    assert "- seed 0 counts WITHOUT a passed check (--count-unchecked)" in out and "4 of 4 seeds complete" in out


# ---- refusals ----------------------------------------------------------------------------------------------

def test_rows_pasted_from_one_seed_into_another_are_refused(tmp_path, capsys):
    series = four_seeds(DIFFS)
    series["dither", 3] = series["dither", 2]  # seed 2's rewards under seed 3's name
    assert Campaign(tmp_path / "repo", series).main() == 2
    err = capsys.readouterr().err
    assert "dither seed 2" in err and "dither seed 3" in err and "pasted" in err


def test_a_run_missing_steps_is_refused_and_a_run_still_going_is_incomplete(tmp_path, capsys):
    series = four_seeds(DIFFS)
    c = Campaign(tmp_path / "repo", series)
    write_run(c.root / "runs" / "seed3-dither", rows("x", "dither", 3, series["dither", 3][:60]))
    assert c.main() == 0
    out = capsys.readouterr().out
    assert "3 of 4 seeds complete" in out and "- seed 3 incomplete, left out: dither 60/100 steps, nearest 100/100" in out
    mean, lo, hi = t_interval(DIFFS[:3])
    assert close3(numbers(line(out, "| dither − nearest | primary")), [mean, lo, hi])
    gap = [r for r in rows("x", "nearest", 2, series["nearest", 2]) if r["step"] != 50]
    write_run(c.root / "runs" / "seed2-nearest", gap)
    assert c.main() == 2
    assert "seed 2 is missing step(s) 50" in capsys.readouterr().err


def test_two_runs_for_one_mode_and_seed_are_refused(tmp_path, capsys):
    c = Campaign(tmp_path / "repo", four_seeds(DIFFS))
    write_run(c.root / "runs" / "again", rows("again", "dither", 2, shifted(2, 0.3)))
    assert c.main() == 2
    assert "dither seed 2: two runs" in capsys.readouterr().err


def _ran_on(folder: Path, *sessions: str, vendor: str | None = None) -> None:
    """A run.json as the job writes it: the last session's provenance and every session's record (a vendor only
    where given: runs before 2026-12-08 recorded none)."""
    records = [{"started_utc": f"2026-12-0{k + 1}T00:00:00Z", "cpu_capability": cap,
                **({"cpu_vendor": vendor} if vendor else {})} for k, cap in enumerate(sessions)]
    (folder / "run.json").write_text(json.dumps({"provenance": records[-1], "sessions": records}))


def test_the_table_names_the_one_cpu_and_runs_on_two_kinds_are_refused(tmp_path, capsys):
    c = Campaign(tmp_path / "repo", four_seeds(DIFFS))
    for folder in (c.root / "runs").iterdir():
        if not folder.name.startswith("repro-"):  # the 5-step reproduction runs are kept without run.json
            _ran_on(folder, "AVX2")
    assert c.main() == 0
    assert "ran on one with AVX2 (run.json's cpu_capability" in capsys.readouterr().out
    _ran_on(c.root / "runs" / "seed3-dither", "AVX2", "AVX512")  # resumed on another kind in a later session
    assert c.main() == 2
    err = capsys.readouterr().err
    assert "more than one kind" in err and "AVX512: seed3-dither" in err and "AVX2: seed1-dither" in err, err


def test_a_campaign_run_is_refused_on_another_kind_of_cpu(tmp_path, capsys):
    import torch

    mine = torch.backends.cpu.get_cpu_capability()
    other = "AVX2" if mine != "AVX2" else "AVX512"
    kept = tmp_path / "kept"
    write_run(kept / "lr1e-5-seed0-nearest", rows("x", "nearest", 0, base(0)))
    assert campaign.main(["--this-cpu", str(kept)]) == 0  # no run records a CPU yet
    _ran_on(kept / "lr1e-5-seed0-nearest", mine)
    assert campaign.main(["--this-cpu", str(kept)]) == 0
    out = capsys.readouterr().out
    assert f"this CPU has {mine}" in out and "as the runs in" in out, out
    _ran_on(kept / "lr1e-5-seed0-nearest", other)
    assert campaign.main(["--this-cpu", str(kept)]) == 2
    err = capsys.readouterr().err
    assert f"this CPU has {mine}; the campaign's runs in {kept} ran on {other}" in err, err
    # the same capability from another vendor (fp32 sums differ between Intel and AMD), where the runs record one
    from faircast_jobs.provenance import cpu_vendor

    vendor = cpu_vendor()
    elsewhere = "AuthenticAMD" if vendor != "AuthenticAMD" else "GenuineIntel"
    _ran_on(kept / "lr1e-5-seed0-nearest", mine, vendor=vendor)
    assert campaign.main(["--this-cpu", str(kept)]) == 0
    _ran_on(kept / "lr1e-5-seed0-nearest", mine, vendor=elsewhere)
    assert campaign.main(["--this-cpu", str(kept)]) == 2
    assert f"this CPU has {vendor}; the campaign's runs in {kept} ran on {elsewhere}" in capsys.readouterr().err


def test_a_registration_changed_after_the_rows_commit_is_refused(tmp_path, capsys):
    c = Campaign(tmp_path / "repo", four_seeds(DIFFS))
    table = c.root / "campaign.csv"
    write_table(table, [r for (m, s), rw in four_seeds(DIFFS).items() if s for r in rows(f"s{s}", m, s, rw)])
    rows_commit = commit(c.root, "campaign.csv", message="campaign rows")
    repro = [str(c.root / "runs" / f"repro-seed0-{m}") for m in ("nearest", "dither")]
    assert c.main(rows_from=[str(table), *repro]) == 0  # registration, then rows: fine
    capsys.readouterr()
    (c.root / "prereg.json").write_text(json.dumps(registration(primary={
        "endpoint": "mean reward over steps 1-100 of one run", "tie_band": 0.05})))
    assert c.main(rows_from=[str(table)]) == 2  # changed, not committed
    assert "prereg.json has uncommitted changes" in capsys.readouterr().err
    late = commit(c.root, "prereg.json", message="a wider band")
    assert c.main(rows_from=[str(table)]) == 2
    err = capsys.readouterr().err
    assert f"prereg.json changed in commit {late[:10]}, not before {rows_commit[:10]}" in err and "campaign.csv" in err


def test_a_registration_committed_with_the_rows_or_not_at_all_is_refused(tmp_path, capsys):
    c = Campaign(tmp_path / "repo", four_seeds(DIFFS), register=False)
    assert c.main() == 2  # the run folders are not committed: the registration must be
    assert "prereg.json is not committed" in capsys.readouterr().err
    table = c.root / "campaign.csv"
    write_table(table, rows("s2", "dither", 2, shifted(2, 0.1)))
    both = commit(c.root, "prereg.json", "campaign.csv", message="registration and rows at once")
    assert c.main(rows_from=[str(table)]) == 2
    assert f"changed in commit {both[:10]}, not before {both[:10]}" in capsys.readouterr().err


def test_committed_rows_changed_after_the_registration_are_refused(tmp_path, capsys):
    c = Campaign(tmp_path / "repo", four_seeds(DIFFS))
    with open(c.root / "committed.csv", "a") as f:
        f.write("\n")
    assert c.main() == 2
    assert "committed.csv (the committed rows of the reproduction check) has uncommitted changes" in capsys.readouterr().err
    after = commit(c.root, "committed.csv")
    assert c.main() == 2
    assert f"changed in commit {after[:10]}, after the registration" in capsys.readouterr().err


# ---- the committed rows: the figures docs/pretrained.md prints ----------------------------------------

COMMITTED = [str(ROOT / "docs/pretrained/tied-head-fixed/steps.csv"), "--prereg",
             str(ROOT / "docs/pretrained/campaign/preregistered.json")]


def committed_means(lr: float, steps: range) -> dict[tuple[str, int], float]:
    with open(ROOT / "docs/pretrained/tied-head-fixed/steps.csv", newline="") as f:
        got = [r for r in csv.DictReader(f) if float(r["lr"]) == lr and int(r["step"]) in steps]
    out = {}
    for key in {(r["mode"], int(r["seed"])) for r in got}:
        values = [float(r["reward"]) for r in got if (r["mode"], int(r["seed"])) == key]
        assert len(values) == len(steps)
        out[key] = sum(values) / len(values)
    return out


def test_the_two_committed_seeds_per_seed_and_over_seeds(tmp_path, capsys):
    """The command docs/pretrained.md names, on the committed rows (seeds 0 and 1 counted without the
    reproduction check, as it says), against the means computed here and scipy's interval."""
    assert campaign.main([*COMMITTED, "--count-unchecked", "--pooled-steps", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    m = committed_means(1e-5, range(1, 101))
    per_seed = [m["dither", s] - m["nearest", s] for s in (0, 1)]
    assert [round(d, 3) for d in per_seed] == [0.249, 0.251]
    for s, d in zip((0, 1), per_seed):
        row = line(out, f"| {s} |")
        assert abs(numbers(row)[2] - d) <= 5e-5 + 1e-12 and row.split(" | ")[4] == "W"  # printed to 4 decimals
    mean, lo, hi = t_interval(per_seed)
    assert close3(numbers(line(out, "| dither − nearest | primary")), [mean, lo, hi])
    ref = [m["dither", s] - m["fp32", s] for s in (0, 1)]
    mean, lo, hi = t_interval(ref)
    assert lo < 0 < hi and close3(numbers(line(out, "| dither − fp32 | primary")), [mean, lo, hi])
    assert line(out, "| primary (steps 1-100) | 2 × 100 |") == "| primary (steps 1-100) | 2 × 100 | +0.250 | [+0.182, +0.342] |"
    assert (tmp_path / "out" / "table.md").read_text() == out
    assert (tmp_path / "out" / "campaign.png").stat().st_size > 10_000
    assert campaign.main(COMMITTED) == 0  # as registered: the reproduction check first
    assert "0 of 8 seeds complete" in capsys.readouterr().out


def test_the_two_committed_seeds_at_lr_1e_6(capsys):
    assert campaign.main([*COMMITTED, "--count-unchecked", "--pooled-steps", "--lr", "1e-6", "--steps", "50"]) == 0
    out = capsys.readouterr().out
    assert "**Not the registered analysis:**" in out
    m = committed_means(1e-6, range(1, 51))
    per_seed = [m["dither", s] - m["nearest", s] for s in (0, 1)]
    assert [round(d, 3) for d in per_seed] == [0.083, 0.05]
    mean, lo, hi = t_interval(per_seed)
    assert close3(numbers(line(out, "| dither − nearest | primary")), [mean, lo, hi])
    assert line(out, "| primary (steps 1-50) |") == "| primary (steps 1-50) | 2 × 50 | +0.066 | [+0.048, +0.094] |"
