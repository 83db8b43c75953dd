"""Figures of a GRPO job run: the per-step CSV, the per-mode summary, the markdown table, the end screen.

Definitions used in the table:

- final reward: per (mode, seed), the mean reward over the last 20% of steps; the table shows the
  mean over seeds ± their standard deviation (with one seed: ± the sd of the step rewards in the tail).
- wins/ties/losses against nearest (RN): per seed, the mode's final reward minus RN's with the same
  seed (same init, prompts and sampling noise); |difference| < ``tie`` is a tie.
- changed: mean share of served elements whose bits the step's cast changed (all steps).
- gap, lag: Fair Cast's diagnostics (faircast_ds/diagnostics.py), mean over the last 20% of steps.
- bytes per sync: the payload a delta weight sync (``faircast_ds.export.WeightSender``) would send
  after the step: per changed parameter the smaller of its COO (int32 index + bf16 value, 6 bytes per
  changed element) and bitmap (1 bit per element + 2 bytes per changed element) encodings, computed with
  ``faircast_ds.export.delta`` from the served tensors before and after the step (no channel runs; the
  per-parameter headers are left out). The fp32 reference has no delta sync: a dense fp32 sync,
  4 bytes per element. The percentage is of a dense bf16 sync (2 bytes per element).
- mismatch: ``faircast_ds.align.measure_mismatch`` on the final served weights against the
  SGLang profile, on the last step's rollouts: RMS of the per-token log-prob gap, unaligned and with
  the trainer aligned on every region where SGLang rounds differently from HF.
"""
from __future__ import annotations

import csv
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

CONTROL = "nearest"


def write_csv(path: str, rows: Sequence[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def read_csv(path: str) -> list[dict]:
    """The rows of a steps.csv with numbers parsed (for re-plotting or re-tabulating a run)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key, value in row.items():
            if key != "mode":
                row[key] = float(value) if value not in ("", "nan") else math.nan
    return rows


def tail(rows: Sequence[dict], fraction: float = 0.2) -> list[dict]:
    """The last ``fraction`` of one run's steps (at least one)."""
    last = max(r["step"] for r in rows)
    first = last - max(1, round(fraction * last))
    return [r for r in rows if r["step"] > first]


def _mean(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


@dataclass
class ModeSummary:
    mode: str
    final_by_seed: dict[int, float]
    final_mean: float
    final_spread: float
    spread_kind: str  # "seeds" or "steps"
    changed: float
    gap: float
    lag: float
    sync_bytes: float  # bytes per step of a delta sync (fp32 reference: dense)
    sync_dense: float  # bytes per step of a dense sync
    bf16_dense: float  # a dense bf16 sync of the same model (the yardstick)
    cast_ms: float
    step_ms: float
    wins: int = 0
    ties: int = 0
    losses: int = 0
    mismatch: dict[str, float] = field(default_factory=dict)


def summarize(rows: Sequence[dict], finals: Sequence[dict], modes: Sequence[str], tie: float) -> list[ModeSummary]:
    out = []
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        seeds = sorted({int(r["seed"]) for r in mine})
        by_seed = {s: [r for r in mine if int(r["seed"]) == s] for s in seeds}
        tails = {s: tail(rs) for s, rs in by_seed.items()}
        final = {s: _mean([r["reward"] for r in t]) for s, t in tails.items()}
        if len(seeds) > 1:
            spread, kind = statistics.stdev(final.values()), "seeds"
        else:
            rewards = [r["reward"] for r in tails[seeds[0]]]
            spread, kind = (statistics.stdev(rewards) if len(rewards) > 1 else 0.0), "steps"
        all_tail = [r for t in tails.values() for r in t]
        mm = [f for f in finals if f["mode"] == mode and "mismatch_rms" in f]
        out.append(ModeSummary(
            mode=mode, final_by_seed=final, final_mean=_mean(list(final.values())), final_spread=spread,
            spread_kind=kind, changed=_mean([r["changed_fraction"] for r in mine]),
            gap=_mean([r["gap_spacings"] for r in all_tail]), lag=_mean([r["lag_steps"] for r in all_tail]),
            sync_bytes=_mean([r["sync_bytes"] for r in mine]),
            sync_dense=_mean([r["sync_bytes_dense"] for r in mine]),
            bf16_dense=_mean([2 * r["numel"] for r in mine]),
            cast_ms=_mean([r["cast_ms"] for r in mine]),
            step_ms=_mean([r["rollout_ms"] + r["train_ms"] for r in mine]),
            mismatch={k: _mean([f[k] for f in mm]) for k in (mm[0] if mm else {}) if k.startswith("mismatch")},
        ))
    control = next((s for s in out if s.mode == CONTROL), None)
    if control is not None:
        for s in out:
            if s is control:
                continue
            for seed, value in s.final_by_seed.items():
                if seed not in control.final_by_seed:
                    continue
                diff = value - control.final_by_seed[seed]
                if abs(diff) < tie:
                    s.ties += 1
                elif diff > 0:
                    s.wins += 1
                else:
                    s.losses += 1
    return out


def headline(cfg: Any, world: int) -> str:
    return (f"GRPO, tiny Qwen3 (hidden {cfg.hidden}, {cfg.layers} layers, init std {cfg.init_std}), ZeRO-3 on "
            f"{world} ranks, AdamW lr {cfg.lr:g}, {cfg.rollouts} rollouts x {cfg.gen_len} tokens/step, "
            f"{cfg.steps} steps, {cfg.seeds} seed(s)")


def _fmt_bytes(n: float) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1024**2 else f"{n / 1024**2:.2f} MiB"


def _fmt(x: float, spec: str, empty: str = "—") -> str:
    return empty if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(summaries: Sequence[ModeSummary], cfg: Any, world: int, wall: float) -> str:
    lines = [
        f"{headline(cfg, world)}; wall {wall / 60:.1f} min.",
        "",
        "| mode | final reward (last 20%) | vs RN W/T/L | served changed/step | gap (spacings) | lag (steps) "
        "| bytes per sync (of dense bf16) | mismatch RMS vs SGLang: unaligned | aligned | cast ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        ref = s.mode == "fp32"
        wtl = "—" if s.mode == CONTROL else f"{s.wins}/{s.ties}/{s.losses}"
        gap = "0 (served = master)" if ref else _fmt(s.gap, ".3f")
        lag = "0 (served = master)" if ref else _fmt(s.lag, ".1f")
        sync = f"{_fmt_bytes(s.sync_bytes)} ({100 * s.sync_bytes / s.bf16_dense:.1f}%)"
        mm_plain = _fmt(s.mismatch.get("mismatch_rms", math.nan), ".2e", "n/a (fp32 served)" if ref else "—")
        mm_aligned = _fmt(s.mismatch.get("mismatch_rms_aligned", math.nan), ".2e", "n/a" if ref else "—")
        lines.append(
            f"| {s.mode} | {s.final_mean:.3f} ± {s.final_spread:.3f} | {wtl} | {100 * s.changed:.2f}% | {gap} | {lag} "
            f"| {sync} | {mm_plain} | {mm_aligned} | {_fmt(s.cast_ms, '.1f')} |")
    spread = summaries[0].spread_kind if summaries else "seeds"
    spread_note = (f"the sd across {cfg.seeds} seeds" if spread == "seeds"
                   else "the sd of the step rewards in that window (one seed)")
    lines += [
        "",
        f"Final reward: mean over the last 20% of steps per seed; ± is {spread_note}. "
        f"W/T/L: per seed against nearest (RN) with the same seed; |difference| < {cfg.tie} is a tie. "
        "Changed: share of served elements whose bits changed, mean over all steps. Gap, lag: Fair Cast "
        "diagnostics, mean over the last 20% of steps. Bytes per sync: the payload of a delta sync after each step "
        "with faircast_ds.export's encodings (per changed parameter the smaller of COO, 6 bytes per changed "
        "element, and bitmap, 1 bit per element + 2 bytes per changed one; headers left out), computed from "
        "the served tensors (no channel ran); fp32 reference: a dense fp32 sync (4 bytes per element); the "
        "percentage is of a dense bf16 sync. Mismatch: measure_mismatch (engine 'sglang') on the final served "
        "weights and the last step's rollouts, mean over seeds; aligned = trainer rounding aligned on every "
        "region SGLang rounds differently. Cast ms: Fair Cast's cast per step and rank.",
        "",
    ]
    return "\n".join(lines)


def summary_text(summaries: Sequence[ModeSummary], cfg: Any, world: int, wall: float, run_dir: str) -> str:
    lines = [headline(cfg, world), f"wall {wall:.0f} s", "",
             f"{'mode':<15} {'final reward':>15} {'W/T/L vs RN':>12} {'changed':>9} {'lag':>6} "
             f"{'sync/step':>11} {'mismatch rms':>13} {'aligned':>8}"]
    for s in summaries:
        wtl = "—" if s.mode == CONTROL else f"{s.wins}/{s.ties}/{s.losses}"
        lines.append(
            f"{s.mode:<15} {s.final_mean:7.3f} ± {s.final_spread:.3f} {wtl:>12} {100 * s.changed:8.2f}% "
            f"{_fmt(s.lag, '6.1f', '     —')} {_fmt_bytes(s.sync_bytes):>11} "
            f"{_fmt(s.mismatch.get('mismatch_rms', math.nan), '13.2e', '            —')} "
            f"{_fmt(s.mismatch.get('mismatch_rms_aligned', math.nan), '8.1e', '       —')}")
    lines += ["", f"tie threshold {cfg.tie}; final reward = mean of the last 20% of steps, ± sd over seeds",
              f"table: {os.path.join(run_dir, 'results.md')}   plot: {os.path.join(run_dir, 'reward.png')}   "
              f"steps: {os.path.join(run_dir, 'steps.csv')}"]
    return "\n".join(lines)
