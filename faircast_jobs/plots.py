"""The GRPO job's figure: reward per step (seed bands), served weights changed per step (log), the lags
(along the drift, and the L2 search), and the master policy's reward minus the served policy's."""
from __future__ import annotations

import math
from typing import Sequence

COLORS = {"fp32": "black", "nearest": "tab:red", "stochastic": "tab:blue", "dither": "tab:green",
          "error_feedback": "tab:purple"}


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (shorter at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _by_seed(rows: Sequence[dict], mode: str, key: str) -> tuple[list[int], list[list[float]]]:
    seeds = sorted({int(r["seed"]) for r in rows if r["mode"] == mode})
    curves = []
    for seed in seeds:
        mine = sorted((r for r in rows if r["mode"] == mode and int(r["seed"]) == seed), key=lambda r: r["step"])
        curves.append([float(r[key]) for r in mine])
    n = min(len(c) for c in curves) if curves else 0
    return list(range(1, n + 1)), [c[:n] for c in curves]


def plot_run(rows: Sequence[dict], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    steps_total = max(int(r["step"]) for r in rows)
    window = max(1, steps_total // 20)
    fig, (ax_r, ax_c, ax_l, ax_m) = plt.subplots(1, 4, figsize=(22, 5))
    for mode in modes:
        color = COLORS.get(mode)
        steps, curves = _by_seed(rows, mode, "reward")
        smoothed = [smooth(c, window) for c in curves]
        mean = [sum(col) / len(col) for col in zip(*smoothed)]
        ax_r.plot(steps, mean, color=color, label=f"{mode} ({len(curves)} seed{'s' if len(curves) > 1 else ''})")
        if len(curves) > 1:
            ax_r.fill_between(steps, [min(col) for col in zip(*smoothed)], [max(col) for col in zip(*smoothed)],
                              color=color, alpha=0.15, linewidth=0)
        steps, curves = _by_seed(rows, mode, "changed_fraction")
        mean = [max(sum(col) / len(col), 1e-7) for col in zip(*curves)]
        ax_c.plot(steps, mean, color=color, label=mode, linewidth=1)
        for key, style, suffix in (("lag_drift_steps", "-", " (along drift)"), ("lag_steps", ":", " (L2)")):
            if key not in rows[0]:
                continue
            steps, curves = _by_seed(rows, mode, key)
            points = [(s, sum(col) / len(col)) for s, col in zip(steps, zip(*curves)) if not any(map(math.isnan, col))]
            if points:
                ax_l.plot([p[0] for p in points], smooth([p[1] for p in points], window), color=color, linestyle=style,
                          label=mode + suffix, linewidth=1.5 if style == "-" else 1)
        if "master_eval" in rows[0]:
            mine = [r for r in rows if r["mode"] == mode and not math.isnan(float(r["master_eval"]))]
            evals = sorted({int(r["step"]) for r in mine})
            gaps = []
            for step in evals:
                here = [r for r in mine if int(r["step"]) == step]
                gaps.append(sum(float(r["master_eval"]) - float(r["served_eval"]) for r in here) / len(here))
            if evals:
                ax_m.plot(evals, gaps, color=color, marker="o", label=mode)
    tail_start = steps_total - max(1, round(0.2 * steps_total))
    ax_r.axvspan(tail_start, steps_total, color="grey", alpha=0.08, label="last 20% (scored)")
    ax_r.set(xlabel="step", ylabel=f"reward (moving mean of {window} steps)",
             title="reward per step: mean over seeds, band = min..max")
    ax_c.set(xlabel="step", ylabel="share of served weights changed", yscale="log",
             title="served weights changed per step (mean over seeds)")
    ax_l.set(xlabel="step", ylabel="steps", title="lag of the served copy behind the master (mean over seeds)")
    ax_m.axhline(0, color="grey", linewidth=0.8)
    ax_m.set(xlabel="step", ylabel="reward: fp32 master policy − served policy",
             title="checkpoint consistency (fixed eval batch, mean over seeds)")
    for ax in (ax_r, ax_c, ax_l, ax_m):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})  # no version: rebuilds give the same bytes
    plt.close(fig)
