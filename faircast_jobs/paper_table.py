"""The paper's table on a real checkpoint (docs/pretrained.md): round-to-nearest's changed fraction per
step and its lag from the pretrained bf16 start, beside dither, the fp32 reference and ``faircast-ds predict``.

    python3 -m faircast_jobs.paper_table RUN_DIR_OR_CSV... [--predict LABEL=FILE.json ...] [--out DIR]

Each RUN_DIR is one job's output (``steps.csv`` and ``job.json``, as ``launch/smollm2_runs.sh`` writes them);
runs of any learning rate mix. A ``.csv`` file instead is a table this command wrote (``DIR/steps.csv``), so the
committed table rebuilds from the committed rows. With ``--out`` it writes ``DIR/steps.csv`` (every run's rows, one per learning
rate, mode, seed and step, with the run's name and learning rate in front), ``DIR/table.md`` (what it prints)
and ``DIR/curves.png``. ``--predict`` takes ``faircast-ds predict --json`` outputs to set beside the measured
figures. Runs still going are read as far as they got: the table says how many steps each row has.

The reward comparison is paired: a dither step and a nearest step of the same seed and step number drew the
same prompts and sampling seeds. Consecutive steps are correlated (one policy), so the interval is a
moving-block bootstrap over steps (blocks of ``BLOCK`` steps) of the mean paired difference; an interval
holding 0 is a tie.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from typing import Any, Sequence

import numpy as np

from faircast_jobs.config import JOB_MODES, REFERENCE

PAPER = "0.4–0.5% of served weights change per step; the served policy trails the fp32 master by 50–150 steps"
BLOCK = 10
KEEP = ("run", "lr", "mode", "seed", "step", "reward", "changed", "numel", "changed_fraction", "gap_spacings",
        "lag_steps", "lag_drift_steps", "bias_spacings", "kl_master", "rollout_ms", "train_ms", "extra_ms")


class TableError(ValueError):
    """A run directory the table cannot read."""


def read_run(run_dir: str) -> list[dict[str, Any]]:
    """One run directory's rows, with its name and learning rate (from job.json) in front."""
    try:
        with open(os.path.join(run_dir, "job.json")) as f:
            job = json.load(f)
        with open(os.path.join(run_dir, "steps.csv"), newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, json.JSONDecodeError) as exc:
        raise TableError(f"{run_dir}: not a job's run directory ({exc})") from exc
    if "lr" not in job:
        raise TableError(f"{run_dir}/job.json has no lr")
    name = os.path.basename(os.path.normpath(run_dir))
    out = []
    for r in rows:
        row: dict[str, Any] = {"run": name, "lr": float(job["lr"]), "mode": r["mode"], "seed": int(r["seed"]),
                               "step": int(r["step"])}
        for key in KEEP[5:]:
            value = r.get(key, "")
            row[key] = float(value) if value not in ("", None) else math.nan
        out.append(row)
    return out


def read_merged(path: str) -> list[dict[str, Any]]:
    """The rows of a ``steps.csv`` this module wrote (every run's, with its name and learning rate)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise TableError(f"{path}: {exc}") from exc
    if not rows or set(KEEP) - set(rows[0]):
        raise TableError(f"{path}: not a table of paper_table (columns {', '.join(KEEP)})")
    return [{k: (r[k] if k in ("run", "mode") else int(r[k]) if k in ("seed", "step") else float(r[k])) for k in KEEP}
            for r in rows]


def read_input(path: str) -> list[dict[str, Any]]:
    return read_merged(path) if os.path.isfile(path) and path.endswith(".csv") else read_run(path)


def block_bootstrap(values: Sequence[float], block: int = BLOCK, resamples: int = 10_000,
                    level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``values`` (a series in step order) and a moving-block bootstrap interval of it."""
    x = np.asarray([v for v in values if math.isfinite(v)], dtype=np.float64)
    if x.size == 0:
        return math.nan, math.nan, math.nan
    if x.size < 2:
        return float(x.mean()), math.nan, math.nan
    b = max(1, min(block, x.size))
    starts = np.arange(x.size - b + 1)
    blocks = math.ceil(x.size / b)
    rng = np.random.default_rng(seed)
    picks = rng.choice(starts, size=(resamples, blocks))
    idx = (picks[:, :, None] + np.arange(b)[None, None, :]).reshape(resamples, -1)[:, :x.size]
    means = x[idx].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(x.mean()), float(lo), float(hi)


def _pct(fraction: float) -> str:
    return "–" if not math.isfinite(fraction) else f"{100 * fraction:.2f}%"


def modes_of(rows: Sequence[dict], lr: float) -> list[str]:
    """The modes run at ``lr``, in the job's order (the fp32 reference first)."""
    found = {r["mode"] for r in rows if r["lr"] == lr}
    return sorted(found, key=lambda m: (JOB_MODES.index(m) if m in JOB_MODES else len(JOB_MODES), m))


def _fmt(v: float, spec: str) -> str:
    return "–" if not math.isfinite(v) else format(v, spec)


def _series(rows, lr, mode, seed, key):
    mine = sorted((r for r in rows if r["lr"] == lr and r["mode"] == mode and r["seed"] == seed),
                  key=lambda r: r["step"])
    return [r["step"] for r in mine], [r[key] for r in mine]


def lags_by_step(rows: Sequence[dict]) -> dict[int, list[float]]:
    """The finite lags along the drift of ``rows``, by step (one per seed)."""
    out: dict[int, list[float]] = {}
    for r in rows:
        if math.isfinite(r["lag_drift_steps"]):
            out.setdefault(r["step"], []).append(r["lag_drift_steps"])
    return out


def lag_peak(by_step: dict[int, list[float]]) -> str:
    """The largest mean-over-seeds lag and its step, as the table prints it."""
    if not by_step:
        return "–"
    step = max(by_step, key=lambda s: float(np.mean(by_step[s])))
    return f"{np.mean(by_step[step]):.1f} @ {step}"


def measured_rows(rows: Sequence[dict]) -> list[str]:
    """Per learning rate and mode: the paper's figures measured."""
    lines = ["| lr | mode | seeds × steps | changed per step: median (steps ≥ 2), first 10 | lag along drift: "
             "mean, peak @ step | KL(master‖served) mean | reward mean [95% block CI] | s/step |",
             "|---|---|---|---|---|---|---|---|"]
    for lr in sorted({r["lr"] for r in rows}, reverse=True):
        for mode in modes_of(rows, lr):
            mine = [r for r in rows if r["lr"] == lr and r["mode"] == mode]
            seeds = sorted({r["seed"] for r in mine})
            counts = [sum(1 for r in mine if r["seed"] == s) for s in seeds]
            changed = [r["changed_fraction"] for r in mine if r["step"] >= 2]
            first10 = [r["changed_fraction"] for r in mine if r["step"] <= 10]
            lag_by_step = lags_by_step(mine)
            lag_mean = float(np.mean([v for vs in lag_by_step.values() for v in vs])) if lag_by_step else math.nan
            peak = lag_peak(lag_by_step)
            kl = [r["kl_master"] for r in mine if math.isfinite(r["kl_master"])]
            rewards = [v for s in seeds for v in _series(rows, lr, mode, s, "reward")[1]]
            m, lo, hi = block_bootstrap(rewards)
            secs = [(r["rollout_ms"] + r["train_ms"] + r["extra_ms"]) / 1e3 for r in mine]
            changed_text = (f"{100 * float(np.median(changed)):.2f}%, {100 * float(np.mean(first10)):.2f}%"
                            if changed and mode != REFERENCE else "–")
            lines.append(f"| {lr:g} | {mode} | {len(seeds)} × {'/'.join(map(str, counts))} | {changed_text} | "
                         f"{_fmt(lag_mean, '.1f')}, {peak} | {_fmt(float(np.mean(kl)) if kl else math.nan, '.2e')} | "
                         f"{m:.3f} [{_fmt(lo, '.3f')}, {_fmt(hi, '.3f')}] | {float(np.nanmean(secs)):.1f} |")
    return lines


def paired_rows(rows: Sequence[dict], a: str = "dither", b: str = "nearest") -> list[str]:
    """Per learning rate: mean reward of ``a`` minus ``b`` over paired (seed, step), with its interval."""
    lines = [f"| lr | pairs (seed, step) | {a} − {b} reward [95% block CI] | reading |", "|---|---|---|---|"]
    for lr in sorted({r["lr"] for r in rows}, reverse=True):
        diffs = []
        for seed in sorted({r["seed"] for r in rows if r["lr"] == lr}):
            sa = dict(zip(*_series(rows, lr, a, seed, "reward")))
            sb = dict(zip(*_series(rows, lr, b, seed, "reward")))
            diffs += [sa[s] - sb[s] for s in sorted(set(sa) & set(sb))]
        if not diffs:
            continue
        m, lo, hi = block_bootstrap(diffs)
        reading = ("too few pairs" if not math.isfinite(lo) else
                   "tie (the interval holds 0)" if lo <= 0 <= hi else f"{a} ahead" if lo > 0 else f"{b} ahead")
        lines.append(f"| {lr:g} | {len(diffs)} | {m:+.3f} [{_fmt(lo, '+.3f')}, {_fmt(hi, '+.3f')}] | {reading} |")
    return lines


def predicted_rows(rows: Sequence[dict], predictions: dict[str, dict], baseline: str = "nearest") -> list[str]:
    """``faircast-ds predict`` (a prediction for round-to-nearest) beside the measured changed fraction and
    lag of the ``baseline`` runs."""
    lines = ["| prediction | lr | RN changed per step: predicted mean, measured median | RN lag along drift: "
             "predicted peak @ step, measured peak @ step | weights stepping < half a spacing |", "|---|---|---|---|---|"]
    for label, p in predictions.items():
        lr, fig = float(p["lr"]), p
        near = [r for r in rows if r["lr"] == lr and r["mode"] == baseline]
        changed = [r["changed_fraction"] for r in near if r["step"] >= 2]
        lag_by_step = lags_by_step(near)
        measured_peak = lag_peak(lag_by_step) + (f" (of {max(lag_by_step)})" if lag_by_step else "")
        predicted_changed = fig.get("predicted_changed_fraction_over_run", fig["predicted_changed_fraction"])
        lines.append(f"| {label} | {lr:g} | {_pct(predicted_changed)}, "
                     f"{_pct(float(np.median(changed)) if changed else math.nan)} | "
                     f"{fig['predicted_delay_steps']:.1f} @ {fig['predicted_delay_peak_step']}, {measured_peak} | "
                     f"{100 * fig['share_below_half_spacing']:.1f}% |")
    return lines


def table(rows: Sequence[dict], predictions: dict[str, dict]) -> str:
    parts = [f"The paper: {PAPER}.", "", *measured_rows(rows), "", *paired_rows(rows)]
    for mode in ("dither", "nearest"):  # against the fp32 reference, where one ran on the same seeds
        against = paired_rows(rows, mode, "fp32")
        if len(against) > 2:
            parts += ["", *against]
    if predictions:
        parts += ["", *predicted_rows(rows, predictions)]
    return "\n".join(parts) + "\n"


def plot(rows: Sequence[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from faircast_jobs.plots import COLORS

    lrs = sorted({r["lr"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(3, len(lrs), figsize=(5.5 * len(lrs), 9), squeeze=False)
    for col, lr in enumerate(lrs):
        for mode in modes_of(rows, lr):
            for seed in sorted({r["seed"] for r in rows if r["lr"] == lr and r["mode"] == mode}):
                style = dict(color=COLORS.get(mode, "gray"), lw=1, alpha=0.9 if seed == 0 else 0.5,
                             label=f"{mode} seed {seed}")
                steps, changed = _series(rows, lr, mode, seed, "changed_fraction")
                if mode != REFERENCE:  # served = master: nothing changes by rounding
                    axes[0][col].plot(steps, [100 * c for c in changed], **style)
                    axes[1][col].plot(*_series(rows, lr, mode, seed, "lag_drift_steps"), **style)
                steps, reward = _series(rows, lr, mode, seed, "reward")
                window = [float(np.mean(reward[max(0, i - 9):i + 1])) for i in range(len(reward))]
                axes[2][col].plot(steps, window, **style)
        axes[0][col].axhspan(0.4, 0.5, color="gray", alpha=0.2, label="paper: 0.4–0.5%")
        axes[0][col].set(title=f"lr {lr:g}: served weights changed per step (%)", yscale="log")
        axes[1][col].set(title="lag along the drift (steps)")
        axes[2][col].set(title="reward (trailing mean of 10 steps)", xlabel="step")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct, GRPO on one-digit additions (docs/pretrained.md)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_csv(rows: Sequence[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=KEEP, lineterminator="\n")
        w.writeheader()
        for r in sorted(rows, key=lambda r: (-r["lr"], r["run"], r["mode"], r["seed"], r["step"])):
            w.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in r.items()})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m faircast_jobs.paper_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", help="run directories (each with steps.csv and job.json), or a "
                        "steps.csv this command wrote")
    parser.add_argument("--predict", action="append", default=[], metavar="LABEL=FILE",
                        help="a `faircast-ds predict --json` output to set beside the measured figures")
    parser.add_argument("--out", help="write steps.csv, table.md and curves.png here")
    args = parser.parse_args(argv)
    try:
        rows = [r for d in args.run_dirs for r in read_input(d)]
        predictions = {}
        for item in args.predict:
            label, sep, path = item.partition("=")
            if not sep:
                raise TableError(f"--predict wants LABEL=FILE, got {item!r}")
            with open(path) as f:
                predictions[label] = json.load(f)
    except (TableError, OSError, json.JSONDecodeError) as exc:
        print(f"paper_table: {exc}", file=sys.stderr)
        return 2
    text = table(rows, predictions)
    print(text, end="")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_csv(rows, os.path.join(args.out, "steps.csv"))
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(text)
        plot(rows, os.path.join(args.out, "curves.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
