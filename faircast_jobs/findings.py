"""What a GRPO run's steps.csv says about RN's delay: every figure the README's headline quotes.

``python3 -m faircast_jobs.findings docs/grpo/paper`` prints, from the CSV alone:

- RN's lag along the drift (mean over seeds, per step): its peak and when, its value at the last step,
  its mean over all steps and over the last 20%; the steps whose mean lies in 50–150;
- RN's changed fraction per step, and the steps whose mean over seeds lies in 0.4–0.5%;
- the delay fit: fp32's late slope (least squares on the mean-over-seeds reward, last 20% of steps)
  times RN's late lag, against the measured fp32 − RN final-window gap;
- steps to 0.30 (``endpoints.steps_to``) per mode;
- the master − served reward on the evaluation batch at every evaluation step, per mode;
- the climb: the mean step-1 reward and fp32's final-window reward; on how many seeds fp32's step-1
  reward differs from the bf16 modes' (fp32 compute, not only unrounded weights);
- the KL per step of every mode and its ratio to fp32's;
- the first seed alone (the default one-seed run): each mode minus RN in final-window reward, AUC
  and steps to 0.30.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Sequence

from faircast_jobs.config import CONTROL, REFERENCE
from faircast_jobs.endpoints import auc, curves, final_window, steps_to
from faircast_jobs.steps_csv import read_csv

TAIL = 0.2


def per_step(rows: Sequence[dict], mode: str, key: str) -> dict[int, list[float]]:
    """Per step, the values of ``key`` over the seeds of ``mode`` (NaN left out)."""
    out: dict[int, list[float]] = {}
    for r in rows:
        if r["mode"] == mode and not math.isnan(float(r[key])):
            out.setdefault(int(r["step"]), []).append(float(r[key]))
    return dict(sorted(out.items()))


def mean_curve(rows: Sequence[dict], mode: str, key: str) -> dict[int, float]:
    return {t: sum(v) / len(v) for t, v in per_step(rows, mode, key).items()}


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _steps(ts: Sequence[int]) -> str:
    return f"{ts[0]}–{ts[-1]} ({len(ts)} steps)" if ts else "none"


def findings(rows: Sequence[dict]) -> list[str]:
    table = curves(rows)
    modes = list(dict.fromkeys(m for m, _ in table))
    seeds = sorted({s for _, s in table})
    T = max(len(c) for c in table.values())
    late = T - max(1, round(TAIL * T)) + 1  # first step of the last 20%
    out = [f"run: {len(seeds)} seeds ({seeds[0]}–{seeds[-1]}), {T} steps, modes {', '.join(modes)}"]

    lag = mean_curve(rows, CONTROL, "lag_drift_steps")
    peak = max(lag, key=lambda t: lag[t])
    all_lags = [v for vs in per_step(rows, CONTROL, "lag_drift_steps").values() for v in vs]
    late_lag = sum(v for t, v in lag.items() if t >= late) / sum(1 for t in lag if t >= late)
    out += [f"RN lag along drift (mean over seeds): peak {lag[peak]:.1f} steps at step {peak}; "
            f"{lag[T]:.1f} at step {T}; mean over all steps {sum(all_lags) / len(all_lags):.1f}; "
            f"mean over steps {late}–{T} {late_lag:.1f}",
            f"RN lag in 50–150 steps: {sum(50 <= v <= 150 for v in lag.values())} of {len(lag)} steps"]
    changed = mean_curve(rows, CONTROL, "changed_fraction")
    band = [t for t, v in changed.items() if 0.004 <= v <= 0.005]
    out.append(f"RN changed per step: {100 * sum(changed.values()) / len(changed):.2f}% on average; "
               f"in 0.4–0.5% at steps {_steps(band)}")

    if REFERENCE in modes:
        ref = mean_curve(rows, REFERENCE, "reward")
        ts = [t for t in ref if t >= late]
        s = slope(ts, [ref[t] for t in ts])
        common = [x for x in seeds if (REFERENCE, x) in table and (CONTROL, x) in table]
        gap = sum(final_window(table[(REFERENCE, x)]) - final_window(table[(CONTROL, x)]) for x in common) / len(common)
        out.append(f"delay fit: fp32 slope over steps {late}–{T} {s:.5f}/step x RN lag {late_lag:.1f} steps = "
                   f"{s * late_lag:+.4f}; measured fp32 − RN final-window reward {gap:+.4f}")
    for mode in modes:
        st = [steps_to(table[(mode, x)]) for x in seeds if (mode, x) in table]
        out.append(f"steps to 0.30, {mode}: mean {sum(st) / len(st):.1f} (per seed {st})")
    for mode in modes:
        if mode == REFERENCE:
            continue
        master, served = per_step(rows, mode, "master_eval"), per_step(rows, mode, "served_eval")
        gaps = {t: sum(master[t]) / len(master[t]) - sum(served[t]) / len(served[t]) for t in master}
        out.append(f"master − served reward, {mode}: " + ", ".join(f"step {t} {g:+.4f}" for t, g in gaps.items()))
    first = {m: sum(table[(m, x)][0] for x in seeds if (m, x) in table) / len(seeds) for m in modes}
    out.append("mean step-1 reward: " + ", ".join(f"{m} {v:.3f}" for m, v in first.items()))
    if REFERENCE in modes:
        fin = sum(final_window(table[(REFERENCE, x)]) for x in seeds) / len(seeds)
        differ = sum(table[(REFERENCE, x)][0] != table[(CONTROL, x)][0] for x in seeds)
        out += [f"climb: {first[REFERENCE]:.2f} at step 1 -> {fin:.2f} (fp32, last 20%)",
                f"step-1 reward of fp32 differs from RN's on {differ} of {len(seeds)} seeds"]
    kl = {m: mean_curve(rows, m, "kl_step") for m in modes}
    kl_mean = {m: sum(v.values()) / len(v) for m, v in kl.items() if v}
    ref_kl = kl_mean.get(REFERENCE, math.nan)
    out.append("KL per step (served -> served): " + ", ".join(
        f"{m} {v:.2e} ({v / ref_kl:.0f}x fp32)" for m, v in kl_mean.items()))
    s0 = seeds[0]
    for mode in modes:
        if mode == CONTROL:
            continue
        a, b = table[(mode, s0)], table[(CONTROL, s0)]
        out.append(f"seed {s0} alone, {mode} − RN: final-window {final_window(a) - final_window(b):+.4f}, "
                   f"AUC {auc(a) - auc(b):+.4f}, steps to 0.30 {steps_to(a) - steps_to(b):+d}")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory holding steps.csv (or the CSV itself)")
    args = parser.parse_args(argv)
    path = args.run_dir if args.run_dir.endswith(".csv") else os.path.join(args.run_dir, "steps.csv")
    print("\n".join(findings(read_csv(path))))


if __name__ == "__main__":
    main()
