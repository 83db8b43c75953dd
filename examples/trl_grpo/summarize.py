"""The TRL runs of launch/trl_seeds.sh as a table, a plot and their rows in one folder:

    python3 examples/trl_grpo/summarize.py runs/trl docs/trl_runs

Reads ``<runs>/<mode>-seed<seed>/steps.jsonl`` (the recipe's per-step rows of TRL's own log) for every run there,
copies each to ``<docs>/<mode>-seed<seed>.jsonl``, and writes ``<docs>/runs.json`` (each run's steps and whether it
finished: its ``done.json``) and ``<docs>/table.md`` (per run: steps done, mean reward
over all steps and over the last 20, Fair Cast's changed fraction and lag, the range of TRL's importance-sampling
ratio and the mean of its per-step means, the steps in which TRL's correction masked a sequence, seconds per step;
then dither minus nearest per seed, for the seeds with both modes at the same number of steps) and
``<docs>/rewards.png``. Unfinished runs are tabled as far as they got, marked as such.

The rows already in ``<docs>`` (committed by an earlier summary, with ``runs.json``) are read too, for every run
``<runs>`` does not hold: ``runs/`` is ignored by git and does not outlive its checkout, so the four runs of
launch/trl_seeds.sh, run in different sessions, meet in the committed folder. A run in ``<runs>`` replaces its
committed rows.

TRL logs the ratio after its correction: under ``sequence_mask`` (the default) a masked sequence's ratio is set to 0,
so a step whose logged minimum is 0 masked at least one sequence, and a step whose minimum is above 0 masked none.
The share of sequences masked is not in TRL's log; when no step masked one, it is 0 at every step.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

RUN = re.compile(r"(?P<mode>[a-z_0-9]+)-seed(?P<seed>\d+)")
LAST = 20


def read_rows(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    if steps != list(range(1, len(rows) + 1)):
        raise SystemExit(f"{path}: steps {steps[:5]}... are not 1, 2, 3, ... (a mixed-up rows file)")
    return rows


def read_runs(runs: Path) -> dict[tuple[str, int], list[dict]]:
    found = {}
    for folder in sorted(runs.iterdir()) if runs.is_dir() else []:
        m = RUN.fullmatch(folder.name)
        if folder.is_dir() and m and (folder / "steps.jsonl").exists():
            found[m["mode"], int(m["seed"])] = read_rows(folder / "steps.jsonl")
    return found


def read_committed(docs: Path) -> tuple[dict[tuple[str, int], list[dict]], dict[tuple[str, int], bool]]:
    """The rows an earlier summary left in ``docs`` and whether each run had finished (its ``runs.json``)."""
    record = json.loads((docs / "runs.json").read_text()) if (docs / "runs.json").exists() else {}
    found, done = {}, {}
    for path in sorted(docs.glob("*.jsonl")) if docs.is_dir() else []:
        m = RUN.fullmatch(path.stem)
        if not m:
            continue
        if path.stem not in record:
            raise SystemExit(f"{path}: no entry in {docs / 'runs.json'} says whether this run finished")
        key = m["mode"], int(m["seed"])
        found[key], done[key] = read_rows(path), bool(record[path.stem]["finished"])
        if record[path.stem]["steps"] != len(found[key]):
            raise SystemExit(f"{path}: {len(found[key])} steps, but {docs / 'runs.json'} records "
                             f"{record[path.stem]['steps']}")
    return found, done


def mean(values: list[float]) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def summary(rows: list[dict]) -> dict:
    col = lambda key: [r.get(key) for r in rows]  # noqa: E731
    lows, highs = col("sampling/importance_sampling_ratio/min"), col("sampling/importance_sampling_ratio/max")
    masked = sum(1 for v in lows if v is not None and v == 0.0)  # TRL logs a masked sequence's ratio as 0
    return {"masked_steps": masked, "ratio_mean": mean(col("sampling/importance_sampling_ratio/mean")),
            "steps": len(rows), "reward": mean(col("reward")), "reward_last": mean(col("reward")[-LAST:]),
            "changed": mean(col("fair_cast/changed_fraction")), "lag": mean(col("fair_cast/lag_steps")),
            "ratio_min": min((v for v in lows if v is not None), default=float("nan")),
            "ratio_max": max((v for v in highs if v is not None), default=float("nan")),
            "step_time": mean(col("step_time"))}


def table(found: dict, done: dict) -> str:
    lines = ["| mode | seed | steps | reward (all) | reward (last 20) | changed/step | lag (steps) | IS ratio range | "
             "IS ratio mean | steps masking a sequence | s/step |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    sums = {}
    for (mode, seed), rows in sorted(found.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        s = sums[mode, seed] = summary(rows)
        mark = "" if done[mode, seed] else " (unfinished)"
        lines.append(f"| {mode} | {seed} | {s['steps']}{mark} | {s['reward']:.3f} | {s['reward_last']:.3f} | "
                     f"{100 * s['changed']:.2f}% | {s['lag']:.1f} | [{s['ratio_min']:.2f}, {s['ratio_max']:.2f}] | "
                     f"{s['ratio_mean']:.3f} | {s['masked_steps']} | {s['step_time']:.0f} |")
    pairs = [seed for seed in sorted({seed for _, seed in sums})
             if ("nearest", seed) in sums and ("dither", seed) in sums
             and sums["nearest", seed]["steps"] == sums["dither", seed]["steps"]]
    if pairs:
        lines += ["", "dither minus nearest, per seed (each seed is one pair; two seeds are not an interval):", "",
                  "| seed | steps | reward (all) | reward (last 20) |", "|---|---|---|---|"]
        for seed in pairs:
            d, n = sums["dither", seed], sums["nearest", seed]
            lines.append(f"| {seed} | {d['steps']} | {d['reward'] - n['reward']:+.3f} | "
                         f"{d['reward_last'] - n['reward_last']:+.3f} |")
    return "\n".join(lines) + "\n"


def plot(found: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (mode, seed), rows in sorted(found.items()):
        rewards = [r["reward"] for r in rows]
        window = [mean(rewards[max(0, i - 9): i + 1]) for i in range(len(rewards))]  # a trailing 10-step mean
        ax.plot(range(1, len(rows) + 1), window, label=f"{mode} seed {seed}",
                color="tab:blue" if mode == "dither" else "tab:gray", linestyle="-" if seed % 2 == 0 else "--")
    ax.set_xlabel("TRL step")
    ax.set_ylabel("reward (trailing 10-step mean)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit("usage: python examples/trl_grpo/summarize.py RUNS_DIR DOCS_DIR")
    runs, docs = Path(argv[0]), Path(argv[1])
    new = read_runs(runs)
    found, done = read_committed(docs)
    found.update(new)
    done.update({key: (runs / f"{key[0]}-seed{key[1]}" / "done.json").exists() for key in new})
    if not found:
        raise SystemExit(f"no <mode>-seed<seed>/steps.jsonl under {runs}, and no committed rows in {docs}")
    docs.mkdir(parents=True, exist_ok=True)
    for mode, seed in new:
        shutil.copyfile(runs / f"{mode}-seed{seed}" / "steps.jsonl", docs / f"{mode}-seed{seed}.jsonl")
    record = {f"{mode}-seed{seed}": {"steps": len(rows), "finished": done[mode, seed]}
              for (mode, seed), rows in sorted(found.items())}
    (docs / "runs.json").write_text(json.dumps(record, indent=1) + "\n")
    (docs / "table.md").write_text(table(found, done))
    plot(found, docs / "rewards.png")
    print((docs / "table.md").read_text(), end="")


if __name__ == "__main__":
    main(sys.argv[1:])
