"""The GRPO job's committed outputs: they rebuild from their CSVs byte for byte, and the README's
headline numbers are what docs/grpo/paper/steps.csv says.

The headline check recomputes every number with code of its own (csv, numpy, scipy, the standard
library), not with faircast_jobs: the final-window and AUC endpoints, Student-t intervals, the
percentile bootstrap (10,000 resamples from ``random.Random(0)``, as documented), W/T/L, the exact sign
test, the lag transient, the delay fit, the evaluation-batch gap, the KL per step and seed 0 alone.
"""
from __future__ import annotations

import csv
import json
import math
import random

import numpy as np
import pytest
from conftest import ROOT
from scipy import stats as sps

MODES = ("fp32", "nearest", "stochastic", "dither", "error_feedback")
PAPER = ROOT / "docs" / "grpo" / "paper" / "steps.csv"


def test_committed_runs_rebuild_byte_for_byte(tmp_path, monkeypatch):
    from faircast_jobs import report

    monkeypatch.chdir(ROOT)  # the summaries name their run directory as given: relative, as committed
    dirs = report.run_dirs("docs/grpo")
    assert "docs/grpo/paper" in dirs and len(dirs) >= 4
    for run_dir in dirs:
        out = tmp_path / run_dir.replace("/", "_")
        report.rebuild(run_dir, str(out))
        for name in report.REBUILT:
            committed = (ROOT / run_dir / name).read_bytes()
            assert (out / name).read_bytes() == committed, f"{run_dir}/{name} does not rebuild byte for byte"


# ------------------------------------------------------------------------------ the README's numbers


@pytest.fixture(scope="module")
def paper():
    """Per mode: seeds x steps arrays of every column the headline uses."""
    with open(PAPER, newline="") as f:
        rows = list(csv.DictReader(f))
    keys = ("reward", "changed_fraction", "lag_drift_steps", "kl_step", "master_eval", "served_eval",
            "sync_bytes", "numel")
    out = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        seeds = sorted({int(r["seed"]) for r in mine})
        steps = max(int(r["step"]) for r in mine)
        arrays = {k: np.full((len(seeds), steps), np.nan) for k in keys}
        for r in mine:
            for k in keys:
                arrays[k][seeds.index(int(r["seed"])), int(r["step"]) - 1] = float(r[k]) if r[k] not in ("", "nan") \
                    else np.nan
        out[mode] = arrays
    assert all(not np.isnan(out[m]["reward"]).any() for m in MODES)  # every seed ran every step
    return out


@pytest.fixture(scope="module")
def headline() -> str:
    """The README's headline (its table) and its reading in full in docs/grpo.md."""
    text = (ROOT / "README.md").read_text()
    grpo = (ROOT / "docs" / "grpo.md").read_text()
    start = grpo.index("## The headline, read in full")
    return (text[text.index("## The headline result"):text.index("## Docs")] + "\n" +
            grpo[start:grpo.index("\n## ", start + 1)])


def final_window(r: np.ndarray) -> np.ndarray:
    return r[:, -round(0.2 * r.shape[1]):].mean(axis=1)


def steps_to(r: np.ndarray, threshold: float = 0.30, window: int = 25) -> np.ndarray:
    c = np.cumsum(r, axis=1)
    shifted = np.concatenate([np.zeros((r.shape[0], window)), c[:, :-window]], axis=1)
    trailing = (c - shifted) / np.minimum(np.arange(1, r.shape[1] + 1), window)
    hit = trailing >= threshold
    return np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, r.shape[1] + 1)


def t_interval(x: np.ndarray) -> tuple[float, float]:
    half = sps.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    return x.mean() - half, x.mean() + half


def bootstrap(d: np.ndarray) -> tuple[float, float]:
    rng, xs = random.Random(0), [float(v) for v in d]
    means = sorted(sum(rng.choices(xs, k=len(xs))) / len(xs) for _ in range(10_000))
    return means[250], means[9749]  # the 2.5% and 97.5% order statistics of 10,000


def sign_p(d: np.ndarray) -> float:
    pos, neg = int((d > 0).sum()), int((d < 0).sum())
    n, k = pos + neg, min(pos, neg)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def wtl(d: np.ndarray, tie: float) -> str:
    return f"{int((d >= tie).sum())}/{int((np.abs(d) < tie).sum())}/{int((d <= -tie).sum())}"


def ci(lo: float, hi: float, spec: str) -> str:
    return f"[{lo:{spec}}, {hi:{spec}}]"


def test_readme_table_is_the_csv(paper, headline):
    fin = {m: final_window(paper[m]["reward"]) for m in MODES}
    rn = fin["nearest"]
    for m in MODES:
        a = paper[m]
        lo, hi = t_interval(fin[m])
        cells = [f"| {m} ", f"| {fin[m].mean():.3f} {ci(lo, hi, '.3f')} "]
        if m != "nearest":
            d = fin[m] - rn
            cells.append(f"| {d.mean():+.4f} {ci(*bootstrap(d), '+.4f')}, {wtl(d, 0.01)} ")
        cells += [f"| {a['reward'].mean(axis=1).mean():.4f} ", f"| {steps_to(a['reward']).mean():.1f} ",
                  f"| {100 * a['changed_fraction'].mean():.2f}% "]
        if m != "fp32":
            cells.append(f"| {np.nanmean(a['lag_drift_steps']):.1f} ")
        cells.append(f"| {np.nanmean(a['kl_step']):.2e} ")
        if m != "fp32":
            cells.append(f"| {100 * a['sync_bytes'].mean() / (2 * a['numel'].mean()):.1f}% |")
        row = next(line for line in headline.splitlines() if line.startswith(f"| {m} "))
        pos = 0
        for cell in cells:  # in order, each where the row has it
            found = row.find(cell, pos)
            assert found >= 0, (m, cell, row)
            pos = found + 1


def test_readme_text_is_the_csv(paper, headline):
    text = " ".join(headline.split())  # line breaks are layout
    r = {m: paper[m]["reward"] for m in MODES}
    fin = {m: final_window(r[m]) for m in MODES}
    auc = {m: r[m].mean(axis=1) for m in MODES}
    st = {m: steps_to(r[m]) for m in MODES}
    lag = np.nanmean(paper["nearest"]["lag_drift_steps"], axis=0)  # mean over seeds per step (step 1: none)
    peak = int(np.nanargmax(lag))
    late = slice(400, 500)
    late_lag = np.nanmean(lag[late])
    fp32_mean = r["fp32"].mean(axis=0)
    slope = np.polyfit(np.arange(401, 501), fp32_mean[late], 1)[0]
    gap = (fin["fp32"] - fin["nearest"]).mean()
    eval_gap = np.nanmean(paper["nearest"]["master_eval"] - paper["nearest"]["served_eval"], axis=0)
    rn_dither_steps = (st["nearest"] - st["dither"]).astype(float)
    d_fin = fin["dither"] - fin["nearest"]
    d_auc = auc["dither"] - auc["nearest"]
    d_ref = fin["dither"] - fin["fp32"]
    kl = {m: np.nanmean(paper[m]["kl_step"]) for m in MODES}
    changed = paper["nearest"]["changed_fraction"].mean(axis=0)
    band = np.flatnonzero((changed >= 0.004) & (changed <= 0.005)) + 1
    in_range = int(((lag >= 50) & (lag <= 150)).sum())
    sync = {m: 100 * paper[m]["sync_bytes"].mean() / (2 * paper[m]["numel"].mean()) for m in MODES}
    u = lambda x, spec: format(x, spec).replace("-", "−")  # noqa: E731  the prose writes minus as U+2212
    expected = [
        f"peaks at {lag[peak]:.1f} steps at step {peak + 1} and is down to {lag[-1]:.1f} at step 500",
        f"({late_lag:.1f} on average over steps 401–500)",
        f"RN reaches 0.30 at step {st['nearest'].mean():.1f} on average against fp32's {st['fp32'].mean():.1f} "
        f"and dither's {st['dither'].mean():.1f}",
        f"(RN − dither {rn_dither_steps.mean():+.1f} steps {ci(*bootstrap(rn_dither_steps), '+.1f')}, all "
        f"{int((rn_dither_steps > 0).sum())} seeds later)",
        f"fp32's late slope, {slope:.5f} reward per step over steps 401–500, times RN's late lag of "
        f"{late_lag:.1f} steps gives {slope * late_lag:+.4f}, the measured fp32 − RN final-window gap ({gap:+.4f})",
        "by " + ", ".join(u(eval_gap[t - 1], "+.4f") for t in (100, 200, 300, 400)) +
        f" and {u(eval_gap[499], '+.4f')} at steps 100, 200, 300, 400 and 500",
        f"from {r['fp32'][:, 0].mean():.2f} (step 1) to {fin['fp32'].mean():.2f} (fp32, last 20%)",
        f"the cost is {gap:.3f} of a {fin['fp32'].mean() - r['fp32'][:, 0].mean():.2f} climb",
        f"differs from RN's on {int((r['fp32'][:, 0] != r['nearest'][:, 0]).sum())} of 8 seeds",
        f"dither − RN: final-window {d_fin.mean():+.4f} {ci(*bootstrap(d_fin), '+.4f')} (W/T/L {wtl(d_fin, 0.01)}, "
        f"signs +{int((d_fin > 0).sum())}/−{int((d_fin < 0).sum())}, sign test p = {sign_p(d_fin):.2g})",
        f"AUC {d_auc.mean():+.4f} {ci(*bootstrap(d_auc), '+.4f')} ({wtl(d_auc, 0.005)} with a 0.005 band)",
        f"dither − fp32 {d_ref.mean():+.4f} {ci(*bootstrap(d_ref), '+.4f')}",
        f"({100 * paper['dither']['changed_fraction'].mean():.2f}% vs {100 * changed.mean():.2f}%; "
        f"{sync['dither']:.1f}% vs {sync['nearest']:.1f}% of a dense bf16 sync",
        f"stochastic {sync['stochastic']:.1f}%, error feedback {sync['error_feedback']:.1f}%",
        f"against fp32's {kl['fp32']:.2e} it is {kl['nearest'] / kl['fp32']:.0f}× for RN, "
        f"{kl['dither'] / kl['fp32']:.0f}× for dither, {kl['stochastic'] / kl['fp32']:.0f}× for stochastic and "
        f"{kl['error_feedback'] / kl['fp32']:.0f}× for error feedback",
        f"(fp32 − RN {fin['fp32'][0] - fin['nearest'][0]:+.4f}, dither − RN {d_fin[0]:+.4f}, inside the 0.01 band)",
        f"AUC dither − RN {d_auc[0]:+.4f}, and RN reaches 0.30 {st['nearest'][0] - st['dither'][0]} steps after "
        f"dither and {st['nearest'][0] - st['fp32'][0]} after fp32",
        f"ours changes {100 * changed.mean():.2f}% per step on average (inside 0.4–0.5% only over steps "
        f"{band[0]}–{band[-1]})",
        f"lags {np.nanmean(paper['nearest']['lag_drift_steps']):.1f} steps on average (the mean over seeds is "
        f"inside 50–150 on {in_range} of {int((~np.isnan(lag)).sum())} steps)",
        f"our reward effect is {100 * gap:+.2f} points (fp32 − RN, final window) over 8 pairs, W/T/L "
        f"{wtl(fin['fp32'] - fin['nearest'], 0.01)} (dither − RN {wtl(d_fin, 0.01)})",
    ]
    wall_min = json.loads((PAPER.parent / "run.json").read_text())["wall_s"] / 60
    expected += [f"(8 seeds; wall {wall_min:.0f} min)",
                 f"GRPO on a tiny Qwen3 ({paper['fp32']['numel'][0, 0] / 1000:.0f}k parameters"]
    for phrase in expected:
        assert phrase in text, phrase
    # seed 0 is the smallest fp32 − RN gap of the eight, and a tie for every mode in the final window
    assert np.argmin(fin["fp32"] - fin["nearest"]) == 0
    assert all(abs(fin[m][0] - fin["nearest"][0]) < 0.01 for m in MODES)
    assert "25× more per step" not in text and "without damping it" not in text
