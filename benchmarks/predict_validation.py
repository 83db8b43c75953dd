"""`faircast-ds predict` against the GRPO job's measured runs (docs/predict.md, "Validation").

    python3 benchmarks/predict_validation.py collect RUN_DIR... [--paper docs/grpo/paper] --out docs/predict/delay.csv
    python3 benchmarks/predict_validation.py plot docs/predict/delay.csv docs/predict/delay.png
    python3 benchmarks/predict_validation.py summary docs/predict/delay.csv

``collect`` reads each run's ``run.json`` and ``steps.csv`` (the job's outputs) and, for each (run, seed),
predicts from three checkpoints of that run: ``init`` (the job's initial bf16 weights, rebuilt from its
seed and settings and written as safetensors: the lr-only model, what a user has before the run), and
the run's own DeepSpeed checkpoints (``--save-at``; AdamW moments): the first saved step and the last.
The measured figures are RN's (mode ``nearest``): the lag along drift (``lag_drift_steps``: its peak,
as the maximum of a 9-step centred mean, the step of that peak, its mean over the run and over the
last 5% of steps) and the changed fraction (mean over the run and over the last 20%). ``plot`` draws
predicted against measured from the CSV alone.
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import statistics
import sys
import tempfile
from typing import Any

FIELDS = ["run", "seed", "lr", "steps", "init_std", "source", "model",
          "pred_delay_steps", "pred_delay_peak_step", "pred_mean_lag_steps", "pred_end_lag_steps",
          "pred_changed_fraction", "pred_changed_fraction_run",
          "meas_delay_steps", "meas_delay_peak_step", "meas_mean_lag_steps", "meas_end_lag_steps",
          "meas_changed_fraction_run", "meas_changed_fraction_last20",
          "fp32_reward_cross_step", "meas_reward_delay_steps", "pred_lag_at_fp32_cross_steps"]
REWARD_THRESHOLD = 0.30  # the reward both the fp32 reference and RN reach in every run here


def crossing(rows: list[dict[str, str]], threshold: float = REWARD_THRESHOLD, window: int = 25) -> int | None:
    """The first step at which the reward's centred ``window``-step mean reaches ``threshold``."""
    reward = [float(r["reward"]) for r in rows]
    half = window // 2
    for i in range(len(reward)):
        if statistics.fmean(reward[max(0, i - half):i + half + 1]) >= threshold:
            return i + 1
    return None


def measured(rows: list[dict[str, str]]) -> dict[str, float]:
    lag = [float(r["lag_drift_steps"]) for r in rows]
    changed = [float(r["changed_fraction"]) for r in rows]
    n = len(lag)

    def mean(xs: list[float]) -> float:
        xs = [x for x in xs if not math.isnan(x)]
        return statistics.fmean(xs) if xs else math.nan

    smooth = [mean(lag[max(0, i - 4):i + 5]) for i in range(n)]
    peak = max(range(n), key=lambda i: -math.inf if math.isnan(smooth[i]) else smooth[i])
    return {"meas_delay_steps": smooth[peak], "meas_delay_peak_step": peak + 1, "meas_mean_lag_steps": mean(lag),
            "meas_end_lag_steps": mean(lag[-max(1, n // 20):]), "meas_changed_fraction_run": mean(changed),
            "meas_changed_fraction_last20": mean(changed[-max(1, n // 5):])}


def initial_checkpoint(config: dict[str, Any], seed: int, directory: str) -> str:
    """The job's initial weights for ``seed`` (its build_model: a bf16 tiny Qwen3) as one safetensors file."""
    from safetensors.torch import save_file

    from faircast_bench.builders import tiny_causal_lm

    hidden = int(config["hidden"])
    model = tiny_causal_lm("qwen3", seed=seed, init_std=float(config["init_std"]), attn="eager",
                           vocab_size=int(config["vocab"]), hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=int(config["layers"]), num_attention_heads=4, num_key_value_heads=2,
                           head_dim=hidden // 4, max_position_embeddings=64, tie_word_embeddings=False)
    path = os.path.join(directory, f"init-seed{seed}.safetensors")
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, path)
    return path


def predicted(path: str, lr: float, steps: int) -> dict[str, Any]:
    from faircast_ds.tools.predict import AdamSettings, predict

    rep = predict(path, AdamSettings(lr=lr), steps=steps)
    return {"model": rep["model"], "pred_delay_steps": rep["predicted_delay_steps"],
            "pred_delay_peak_step": rep["predicted_delay_peak_step"],
            "pred_mean_lag_steps": rep["predicted_mean_lag_steps"],
            "pred_end_lag_steps": rep["predicted_lag_at_end_steps"],
            "pred_changed_fraction": rep["predicted_changed_fraction"],
            "pred_changed_fraction_run": rep["predicted_changed_fraction_over_run"]}


def collect(run_dirs: list[str], out: str) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in run_dirs:
            with open(os.path.join(run, "run.json")) as f:
                config = json.load(f)["config"]
            with open(os.path.join(run, "steps.csv")) as f:
                every = list(csv.DictReader(f))
            steps_rows = [r for r in every if r["mode"] == "nearest"]
            lr, steps = float(config["lr"]), int(config["steps"])
            for seed in sorted({int(r["seed"]) for r in steps_rows}):
                meas = measured([r for r in steps_rows if int(r["seed"]) == seed])
                # the reward delay: steps RN takes after fp32 to reach the threshold (runs with both modes)
                fp32 = [r for r in every if r["mode"] == "fp32" and int(r["seed"]) == seed]
                t_fp32 = crossing(fp32) if fp32 else None
                t_rn = crossing([r for r in steps_rows if int(r["seed"]) == seed])
                meas["fp32_reward_cross_step"] = t_fp32 if t_fp32 is not None else ""
                meas["meas_reward_delay_steps"] = t_rn - t_fp32 if t_fp32 is not None and t_rn is not None else ""
                sources = {"init": initial_checkpoint(config, seed, tmp)}
                tags = sorted(glob.glob(os.path.join(run, "checkpoints", f"nearest-seed{seed}", "global_step*")),
                              key=lambda p: int(p.rsplit("global_step", 1)[1]))
                if tags:
                    sources[f"ds_step{tags[0].rsplit('global_step', 1)[1]}"] = tags[0]
                    if len(tags) > 1:
                        sources[f"ds_step{tags[-1].rsplit('global_step', 1)[1]}"] = tags[-1]
                for source, path in sources.items():
                    row = {"run": os.path.basename(os.path.normpath(run)), "seed": seed, "lr": lr, "steps": steps,
                           "init_std": float(config["init_std"]), "source": source,
                           **predicted(path, lr, steps), **meas, "pred_lag_at_fp32_cross_steps": ""}
                    if t_fp32 is not None:  # the predicted lag at the step fp32 crosses: RN's predicted delay there
                        row["pred_lag_at_fp32_cross_steps"] = predicted(path, lr, t_fp32)["pred_end_lag_steps"]
                    rows.append(row)
                    print(", ".join(f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}"
                                    for k in FIELDS), flush=True)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def plot(csv_path: str, png: str) -> None:
    """Predicted against measured: the peak lag (the delay) and the mean lag over the run, per source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    panels = [("pred_delay_steps", "meas_delay_steps", "delay: peak lag along drift"),
              ("pred_mean_lag_steps", "meas_mean_lag_steps", "mean lag along drift over the run"),
              ("pred_lag_at_fp32_cross_steps", "meas_reward_delay_steps",
               f"reward delay at {REWARD_THRESHOLD:.2f} (RN after fp32)")]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.6))
    markers = {"init": "o", "first": "s", "last": "^"}
    runs = sorted({r["run"] for r in rows})
    colors = {run: plt.cm.tab10(i % 10) for i, run in enumerate(runs)}
    for ax, (pred, meas, title) in zip(axes, panels):
        points = [r for r in rows if r[pred] != "" and r[meas] != ""]
        for r in points:
            kind = "init" if r["source"] == "init" else ("last" if int(r["source"][7:]) == int(r["steps"]) else "first")
            ax.scatter(float(r[meas]), float(r[pred]), marker=markers[kind], color=colors[r["run"]], s=28,
                       alpha=0.85, edgecolor="none")
        hi = max([float(r[pred]) for r in points] + [float(r[meas]) for r in points] + [1.0]) * 1.1
        lo = min([float(r[pred]) for r in points] + [float(r[meas]) for r in points] + [0.0]) * 1.1
        ax.plot([lo, hi], [lo, hi], color="0.6", lw=0.8, ls="--")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel("measured (steps, RN in the GRPO job)")
        ax.set_ylabel("predicted by faircast-ds predict (steps)")
        ax.set_title(title, fontsize=10)
    handles = [plt.Line2D([], [], ls="", marker="o", color=colors[run], label=run) for run in runs]
    handles += [plt.Line2D([], [], ls="", marker=m, color="0.3", label={"init": "from init (lr only)",
                                                                          "first": "from 1st DS ckpt (moments)",
                                                                          "last": "from last DS ckpt (moments)"}[k])
                for k, m in markers.items()]
    axes[0].legend(handles=handles, fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=110, metadata={"Software": None})
    plt.close(fig)


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) on log(x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def summary(csv_path: str) -> str:
    """The law's fit (measured delay against lr and init std, log-log) and predicted-vs-measured errors."""
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    init = [r for r in rows if r["source"] == "init"]
    lines = []
    by_lr = [r for r in init if float(r["init_std"]) == 0.1]
    if len({r["lr"] for r in by_lr}) > 1:
        lines.append(f"measured delay vs lr (init std 0.1, {len(by_lr)} runs x seeds): log-log slope "
                     f"{_slope([float(r['lr']) for r in by_lr], [float(r['meas_delay_steps']) for r in by_lr]):+.3f} "
                     f"(law: -1); delay x lr = " + ", ".join(
                         f"{float(r['meas_delay_steps']) * float(r['lr']):.3g}" for r in by_lr))
    by_std = [r for r in init if float(r["lr"]) == 1.5e-6]
    if len({r["init_std"] for r in by_std}) > 1:
        lines.append(f"measured delay vs init std (lr 1.5e-6, {len(by_std)} runs x seeds): log-log slope "
                     f"{_slope([float(r['init_std']) for r in by_std], [float(r['meas_delay_steps']) for r in by_std]):+.3f}"
                     f" (law: +1)")
    pairs = [("pred_delay_steps", "meas_delay_steps", "delay (peak lag)"),
             ("pred_delay_peak_step", "meas_delay_peak_step", "step of the peak"),
             ("pred_mean_lag_steps", "meas_mean_lag_steps", "mean lag over the run"),
             ("pred_end_lag_steps", "meas_end_lag_steps", "lag at the end (last 5%)"),
             ("pred_changed_fraction_run", "meas_changed_fraction_run", "changed fraction over the run"),
             ("pred_changed_fraction", "meas_changed_fraction_last20", "changed/step (steady) vs last 20%"),
             ("pred_lag_at_fp32_cross_steps", "meas_reward_delay_steps", "reward delay at 0.30")]
    for source in ("init", "first", "last"):
        chosen = [r for r in rows if (r["source"] == "init") == (source == "init") and
                  (source == "init" or (int(r["source"][7:]) == int(r["steps"])) == (source == "last"))]
        if not chosen:
            continue
        lines.append(f"{source} checkpoint ({chosen[0]['model']}), {len(chosen)} rows: predicted / measured, "
                     f"median [min, max]")
        for pred, meas, label in pairs:
            ratios = [float(r[pred]) / float(r[meas]) for r in chosen
                      if r[pred] != "" and r[meas] != "" and float(r[meas]) > 0]
            if ratios:
                lines.append(f"  {label:<36} {statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]"
                             f" (n={len(ratios)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    col = sub.add_parser("collect")
    col.add_argument("runs", nargs="+", help="the job's run directories (run.json, steps.csv, checkpoints/)")
    col.add_argument("--out", required=True)
    pl = sub.add_parser("plot")
    pl.add_argument("csv")
    pl.add_argument("png")
    sm = sub.add_parser("summary", help="the law's fit and the prediction errors, from the CSV")
    sm.add_argument("csv")
    args = parser.parse_args(argv)
    if args.command == "collect":
        collect(args.runs, args.out)
    elif args.command == "plot":
        plot(args.csv, args.png)
    else:
        print(summary(args.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
