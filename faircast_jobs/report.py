"""Figures of a GRPO job run: the per-step CSV, the per-mode summary, the markdown table, the end screen.

Definitions used in the table:

- final reward: per (mode, seed), the mean reward over the last 20% of steps; the table shows the
  mean over seeds ± their standard deviation (with one seed: ± the sd of the step rewards in the tail).
- wins/ties/losses against nearest (RN): per seed, the mode's final reward minus RN's with the same
  seed (same init, prompts and sampling noise); |difference| < ``tie`` is a tie.
- changed: mean share of served elements whose bits the step's cast changed (all steps).
- gap: Fair Cast's diagnostics (faircast_ds/shard/diagnostics.py), mean over the last 20% of steps; lag (L2)
  and lag along drift: mean over all steps.
- bytes per sync: the payload a delta weight sync (``faircast_ds.export.WeightSender``) would send
  after the step: per changed parameter the smaller of its COO (int32 index + bf16 value, 6 bytes per
  changed element) and bitmap (1 bit per element + 2 bytes per changed element) encodings, computed with
  ``faircast_ds.export.delta`` from the served tensors before and after the step (no channel runs; the
  per-parameter headers are left out). The fp32 reference has no delta sync: a dense fp32 sync,
  4 bytes per element. The percentage is of a dense bf16 sync (2 bytes per element).
- mismatch: ``faircast_ds.align.measure_mismatch`` on the final served weights against the
  SGLang profile, on the last step's rollouts: RMS of the per-token log-prob gap, unaligned and with
  the trainer aligned on every region where SGLang rounds differently from HF.
- paired statistics (``stats.py``): per seed a mode's final reward minus RN's (or fp32's) on the same
  seed; the mean with a percentile-bootstrap 95% interval and the exact sign test on wins vs losses.
  The final reward's own 95% interval is Student-t over seeds.
- lag along drift, bias: ``lag_drift_steps`` and ``bias_spacings`` of the diagnostics; the table shows
  their mean over all steps and the share of steps whose lag along drift is at least 20.
- checkpoint consistency: the reward of the fp32 master policy minus that of the served policy on one
  fixed evaluation batch, at the last step and averaged over the evaluation points.
- KL per step: mean per-token KL(served before the step || served after it) on the step's rollouts.
"""
from __future__ import annotations

import csv
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

from faircast_jobs import stats
from faircast_jobs.config import CONTROL, GEMM_NOTES, REFERENCE, JobConfig
from faircast_jobs.steps_csv import read_csv

LAG_MIN = 20  # "the served copy lags": lag along drift at least this many steps


def write_csv(path: str, rows: Sequence[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        # every key of every row, in first-seen order: rows resumed from a CSV written before a column existed
        # lack it and are written with it blank
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in rows for k in row)), restval="")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


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
    changed: float
    gap: float
    lag: float
    sync_bytes: float  # bytes per step of a delta sync (fp32 reference: dense)
    sync_dense: float  # bytes per step of a dense sync
    bf16_dense: float  # a dense bf16 sync of the same model (the yardstick)
    step_ms: float
    mismatch: dict[str, float] = field(default_factory=dict)
    final_ci: tuple[float, float] = (math.nan, math.nan)  # Student-t 95% over seeds
    lag_drift: float = math.nan  # mean over all steps
    lag_drift_share: float = math.nan  # share of steps with lag_drift_steps >= LAG_MIN
    bias: float = math.nan  # mean over all steps
    kl_step: float = math.nan  # mean per step
    consistency_end: dict[int, float] = field(default_factory=dict)  # per seed: master - served at the last eval
    consistency_mean: float = math.nan  # master - served, mean over eval points and seeds
    times: dict[str, float] = field(default_factory=dict)  # ms per step by phase
    vs_control: stats.Paired | None = None
    vs_reference: stats.Paired | None = None

    @property
    def wins(self) -> int:  # W/T/L against RN, paired by seed (stats.paired): 0 for RN itself
        return self.vs_control.wins if self.vs_control is not None else 0

    @property
    def ties(self) -> int:
        return self.vs_control.ties if self.vs_control is not None else 0

    @property
    def losses(self) -> int:
        return self.vs_control.losses if self.vs_control is not None else 0


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
            spread = statistics.stdev(final.values())
        else:
            rewards = [r["reward"] for r in tails[seeds[0]]]
            spread = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
        all_tail = [r for t in tails.values() for r in t]
        mm = [f for f in finals if f["mode"] == mode and "mismatch_rms" in f]
        lags = [r["lag_drift_steps"] for r in mine if not math.isnan(r.get("lag_drift_steps", math.nan))]
        evals = [r for r in mine if not math.isnan(r.get("master_eval", math.nan))]
        end = {s: max((r for r in evals if int(r["seed"]) == s), key=lambda r: r["step"]) for s in seeds
               if any(int(r["seed"]) == s for r in evals)}
        out.append(ModeSummary(
            mode=mode, final_by_seed=final, final_mean=_mean(list(final.values())), final_spread=spread,
            changed=_mean([r["changed_fraction"] for r in mine]),
            gap=_mean([r["gap_spacings"] for r in all_tail]), lag=_mean([r["lag_steps"] for r in mine]),
            sync_bytes=_mean([r["sync_bytes"] for r in mine]),
            sync_dense=_mean([r["sync_bytes_dense"] for r in mine]),
            bf16_dense=_mean([2 * r["numel"] for r in mine]),
            step_ms=_mean([r["rollout_ms"] + r["train_ms"] for r in mine]),
            mismatch={k: _mean([f[k] for f in mm]) for k in (mm[0] if mm else {}) if k.startswith("mismatch")},
            final_ci=stats.mean_ci(list(final.values()))[1:] if len(seeds) > 1 else (math.nan, math.nan),
            lag_drift=_mean(lags), lag_drift_share=(sum(v >= LAG_MIN for v in lags) / len(lags)) if lags else math.nan,
            bias=_mean([r.get("bias_spacings", math.nan) for r in mine]),
            kl_step=_mean([r.get("kl_step", math.nan) for r in mine]),
            consistency_end={s: r["master_eval"] - r["served_eval"] for s, r in end.items()},
            consistency_mean=_mean([r["master_eval"] - r["served_eval"] for r in evals]),
            times={k: _mean([r.get(k, math.nan) for r in mine])
                   for k in ("rollout_ms", "fwd_bwd_ms", "opt_ms", "cast_ms", "extra_ms")},
        ))
    control = next((s for s in out if s.mode == CONTROL), None)
    reference = next((s for s in out if s.mode == REFERENCE), None)
    for s in out:
        for other, attr in ((control, "vs_control"), (reference, "vs_reference")):
            if other is not None and other is not s and set(s.final_by_seed) & set(other.final_by_seed):
                setattr(s, attr, stats.paired(s.final_by_seed, other.final_by_seed, tie, (s.mode, other.mode)))
    return out


def _seeds_text(cfg: Any) -> str:
    listed = tuple(getattr(cfg, "seed_list", ()))
    if not listed:
        return f"{cfg.seeds} seed(s)"
    if listed == tuple(range(listed[0], listed[0] + len(listed))):
        return f"{len(listed)} seed(s) ({listed[0]}-{listed[-1]})"
    return f"{len(listed)} seed(s) ({','.join(map(str, listed))})"


def headline(cfg: Any, world: int) -> str:
    if getattr(cfg, "model", ""):
        return (f"GRPO, {cfg.model} ({cfg.task}: one-digit operands up to {cfg.operand_max}, through the chat "
                f"template), ZeRO-3 on {world} ranks, AdamW lr {cfg.lr:g}, {cfg.rollouts // cfg.group} prompts x "
                f"{cfg.group} completions x {cfg.gen_len} tokens/step at temperature 1 from "
                f"{'vllm serve' if cfg.rollout_engine == 'vllm' else 'the trainer'}, {cfg.steps} steps, {_seeds_text(cfg)}"
                + _gemm_text(cfg))
    return (f"GRPO, tiny Qwen3 (hidden {cfg.hidden}, {cfg.layers} layers, init std {cfg.init_std}), ZeRO-3 on "
            f"{world} ranks, AdamW lr {cfg.lr:g}, {cfg.rollouts} rollouts x {cfg.gen_len} tokens/step, "
            f"{cfg.steps} steps, {_seeds_text(cfg)}"
            + (f", regime {cfg.regime}" if getattr(cfg, "regime", "") else "")
            + (" (one fixed prompt)" if getattr(cfg, "prompt_vocab", 0) == 1 else "")
            + (", masters started off the bf16 grid (--off-grid)" if getattr(cfg, "off_grid", False) else "")
            + _gemm_text(cfg))


def _gemm_text(cfg: Any) -> str:
    return GEMM_NOTES[getattr(cfg, "gemm", "native")]


def _fmt_bytes(n: float) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1024**2 else f"{n / 1024**2:.2f} MiB"


def _fmt(x: float, spec: str, empty: str = "—") -> str:
    return empty if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _interval(lo: float, hi: float, spec: str = "+.3f") -> str:
    return "—" if math.isnan(lo) else f"[{lo:{spec}}, {hi:{spec}}]"


def _paired_cell(p: stats.Paired | None) -> str:
    if p is None:
        return "—"
    return f"{p.mean:+.4f} {_interval(*p.ci_boot, '+.4f')}, {p.wins}/{p.ties}/{p.losses}, +{p.positive}/−{p.negative} p={p.p_sign:.2g}"


def markdown(summaries: Sequence[ModeSummary], cfg: Any, world: int, wall: float) -> str:
    many = len(summaries[0].final_by_seed) > 1 if summaries else False
    lines = [
        f"{headline(cfg, world)}; wall {wall / 60:.1f} min.",
        "",
        "| mode | final reward (last 20%) | vs RN W/T/L | − RN: mean [95% CI], W/T/L, signs, sign p | − fp32: mean [95% CI], "
        "W/T/L, signs, sign p | served changed/step | lag along drift (steps; share ≥ 20) | bias (spacings) | lag L2 (steps) "
        "| gap (spacings) | bytes per sync (of dense bf16) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        ref = s.mode == REFERENCE
        wtl = "—" if s.mode == CONTROL else f"{s.wins}/{s.ties}/{s.losses}"
        final = (f"{s.final_mean:.3f} {_interval(*s.final_ci, '.3f')}" if many
                 else f"{s.final_mean:.3f} ± {s.final_spread:.3f}")
        served_is_master = "0 (served = master)"
        lag_drift = served_is_master if ref else f"{_fmt(s.lag_drift, '.1f')} ({_fmt(100 * s.lag_drift_share, '.0f')}%)"
        sync = f"{_fmt_bytes(s.sync_bytes)} ({100 * s.sync_bytes / s.bf16_dense:.1f}%)"
        lines.append(
            f"| {s.mode} | {final} | {wtl} | {_paired_cell(s.vs_control)} | {_paired_cell(s.vs_reference)} "
            f"| {100 * s.changed:.2f}% | {lag_drift} | {served_is_master if ref else _fmt(s.bias, '+.3f')} "
            f"| {served_is_master if ref else _fmt(s.lag, '.1f')} | {served_is_master if ref else _fmt(s.gap, '.3f')} "
            f"| {sync} |")
    lines += [
        "",
        "| mode | master − served reward, last step: mean [95% CI] | same, mean over evaluation points | KL per step "
        "(served → served) | sd of final reward over seeds | mismatch RMS vs SGLang: unaligned | aligned "
        "| ms/step: rollout | fwd+bwd | optimizer step (cast) | extras |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        ref = s.mode == REFERENCE
        end = list(s.consistency_end.values())
        if not end:
            cons = "—"
        elif len(end) > 1:
            m, lo, hi = stats.mean_ci(end)
            cons = f"{m:+.4f} {_interval(lo, hi, '+.4f')}"
        else:
            cons = f"{end[0]:+.4f}"
        t = s.times
        lines.append(
            f"| {s.mode} | {'0 (served = master)' if ref else cons} "
            f"| {'0' if ref else _fmt(s.consistency_mean, '+.4f')} | {_fmt(s.kl_step, '.2e')} "
            f"| {_fmt(s.final_spread, '.3f') if many else '—'} "
            f"| {_fmt(s.mismatch.get('mismatch_rms', math.nan), '.2e', 'n/a (fp32 served)' if ref else '—')} "
            f"| {_fmt(s.mismatch.get('mismatch_rms_aligned', math.nan), '.2e', 'n/a' if ref else '—')} "
            f"| {_fmt(t.get('rollout_ms', math.nan), '.1f')} | {_fmt(t.get('fwd_bwd_ms', math.nan), '.1f')} "
            f"| {_fmt(t.get('opt_ms', math.nan), '.1f')} ({_fmt(t.get('cast_ms', math.nan), '.1f')}) "
            f"| {_fmt(t.get('extra_ms', math.nan), '.1f')} |")
    spread_note = (f"then the mean over seeds with a 95% Student-t interval over {len(summaries[0].final_by_seed)} seeds"
                   if many else "± the sd of the step rewards in that window (one seed)")
    lines += [
        "",
        f"Final reward: mean over the last 20% of steps per seed, {spread_note}. "
        f"W/T/L: per seed against nearest (RN) with the same seed; |difference| < {cfg.tie} is a tie. "
        "− RN, − fp32: per seed the mode's final reward minus that mode's on the same seed; mean over seeds, "
        "percentile-bootstrap 95% interval (10,000 resamples), W/T/L (same tie band), the signs (+ seeds above, "
        "− below) and the exact two-sided sign test on those signs. "
        "Changed: share of served elements whose bits changed, mean over all steps. Lag along drift: the served "
        "copy's distance behind the master along the master's drift over the recorded history (up to "
        f"{cfg.horizon - 1} steps), in steps of that drift, mean over all steps (share of steps with at least "
        f"{LAG_MIN}); bias: the served copy's |drift|-weighted signed error along the drift, in bf16 spacings "
        "(negative: behind), mean over all steps; lag L2: the past step whose master is closest to the served "
        "copy, mean over all steps; gap: mean |master − served| in spacings, last 20% of steps. Bytes per sync: "
        "the payload of a delta sync after each step with faircast_ds.export's encodings (per changed parameter "
        "the smaller of COO, 6 bytes per changed element, and bitmap, 1 bit per element + 2 bytes per changed "
        "one; headers left out), computed from the served tensors (no channel ran); fp32 reference: a dense "
        "fp32 sync (4 bytes per element); the percentage is of a dense bf16 sync. "
        f"Master − served: the fp32 master policy's reward minus the served policy's on one fixed evaluation "
        f"batch (same prompts and sampling noise), every {cfg.eval_every} steps and at the last. KL per step: "
        "mean per-token KL(served before the step || after it) on the step's rollouts, mean over steps. "
        "Mismatch: measure_mismatch (engine 'sglang') on the final served weights and the last step's rollouts, "
        "mean over seeds; aligned = trainer rounding aligned on every region SGLang rounds differently. ms/step: "
        "per rank; optimizer step = engine.step (Fair Cast's cast, the all-gather, the diagnostics); extras = "
        "the KL forward, the evaluations and the sync-bytes count.",
        "",
    ]
    return "\n".join(lines)


def verdicts(summaries: Sequence[ModeSummary]) -> list[str]:
    """One line per paired comparison: separates (bootstrap interval excludes 0 and sign p < 0.05) or not."""
    out = []
    for s in summaries:
        for p in (s.vs_control, s.vs_reference):
            if p is None or p.n < 2 or (s.mode == CONTROL and p.b == REFERENCE):  # fp32 − RN says it
                continue
            word = "separates" if p.separates else "does not separate"
            out.append(f"{p.a} − {p.b}: {p.mean:+.4f} {_interval(*p.ci_boot, '+.4f')}, W/T/L {p.wins}/{p.ties}/"
                       f"{p.losses}, signs +{p.positive}/−{p.negative}, sign p={p.p_sign:.2g}: {word}")
    return out


def summary_text(summaries: Sequence[ModeSummary], cfg: Any, world: int, wall: float, run_dir: str,
                 rows: Sequence[dict] | None = None) -> str:
    """The job's end screen (summary.txt). With ``rows`` (the run's steps) it states the pre-registered
    primary endpoint (``endpoints.primary_text``); a one-seed run is labelled as one."""
    from faircast_jobs import endpoints

    seeds = sorted({s for m in summaries for s in m.final_by_seed})
    lines = [headline(cfg, world), f"wall {wall:.0f} s", "",
             f"{'mode':<15} {'final reward [95% CI]':>24} {'W/T/L vs RN':>12} {'changed':>9} {'lag drift':>10} "
             f"{'bias':>7} {'lag L2':>7} {'master-served':>14} {'KL/step':>9} {'sync/step':>11}"]
    for s in summaries:
        wtl = "—" if s.mode == CONTROL else f"{s.wins}/{s.ties}/{s.losses}"
        ci = "" if math.isnan(s.final_ci[0]) else f" [{s.final_ci[0]:.3f}, {s.final_ci[1]:.3f}]"
        end = list(s.consistency_end.values())
        cons = _fmt(sum(end) / len(end), "+14.4f", "             —") if end else "             —"
        lines.append(
            f"{s.mode:<15} {s.final_mean:>8.3f}{ci:>16} {wtl:>12} {100 * s.changed:8.2f}% "
            f"{_fmt(s.lag_drift, '10.1f', '         —')} {_fmt(s.bias, '+7.3f', '      —')} "
            f"{_fmt(s.lag, '7.1f', '      —')} {cons} {_fmt(s.kl_step, '9.2e', '        —')} "
            f"{_fmt_bytes(s.sync_bytes):>11}")
    if len(seeds) == 1:
        lines += ["", f"One seed ({seeds[0]}): every figure above is that seed's; no interval, no test (W/T/L vs RN "
                  f"counts this one seed)."]
    lines += [""] + verdicts(summaries)
    if rows:
        lines += [endpoints.primary_text(rows)]
    lines += ["", f"tie threshold {cfg.tie}; final reward = mean of the last 20% of steps per seed; "
              "paired differences: bootstrap 95% CI, sign test",
              f"table: {os.path.join(run_dir, 'results.md')}   plot: {os.path.join(run_dir, 'reward.png')}   "
              f"steps: {os.path.join(run_dir, 'steps.csv')}"]
    return "\n".join(lines)


def engine_table(rows: Sequence[dict], modes: Sequence[str]) -> str:
    """With ``--engine vllm``: per mode, the real engine's side of the run (empty string otherwise).

    Push: what :class:`faircast_ds.vllm.WeightPush` handed the engine after each step (whole changed
    groups: a changed element ships its parameter and the parameters fused with it) and its wall time,
    read-back check included. Mismatch: over every step's own rollouts, the RMS and K3 KL of
    ``logp_trainer − logp_vllm`` per generated token, for the trainer as it trains (HF eager) and for
    the same served weights aligned to the ``vllm-cpu`` profile; "bit-equal" is the share of tokens
    whose two log-probs are the same float.
    """
    mine = [r for r in rows if "engine_weights_equal" in r]
    if not mine:
        return ""
    lines = [
        "",
        "Rollouts from vLLM (`--engine vllm`): the engine receives the served weights after every step.",
        "",
        "| mode | final reward (last 20%) | served changed/step | delta sync bytes/step | engine push/step: params, "
        "bytes | push ms/step (load + read-back) | engine_weights_equal | mismatch RMS vs vLLM: unaligned "
        "| aligned (`vllm-cpu`) | K3 KL: unaligned | aligned | bit-equal tokens: unaligned | aligned |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        rs = [r for r in mine if r["mode"] == mode]
        if not rs:
            continue
        seeds = sorted({int(r["seed"]) for r in rs})
        final = _mean([_mean([r["reward"] for r in tail([r for r in rs if int(r["seed"]) == s])]) for s in seeds])
        equal = sum(1 for r in rs if r["engine_weights_equal"] in (True, 1.0))
        params = _mean([r["engine_sync_params"] for r in rs])
        lines.append(
            f"| {mode} | {final:.3f} | {100 * _mean([r['changed_fraction'] for r in rs]):.2f}% "
            f"| {_fmt_bytes(_mean([r['sync_bytes'] for r in rs]))} | {params:.1f}, {_fmt_bytes(_mean([r['engine_sync_bytes'] for r in rs]))} "
            f"| {_mean([r['engine_sync_ms'] for r in rs]):.1f} ({_mean([r['engine_load_ms'] for r in rs]):.1f} + "
            f"{_mean([r['engine_verify_ms'] for r in rs]):.1f}) | {equal}/{len(rs)} steps "
            f"| {_fmt(_mean([r['engine_mismatch_rms'] for r in rs]), '.2e')} "
            f"| {_fmt(_mean([r['engine_mismatch_rms_aligned'] for r in rs]), '.2e', 'n/a (fp32)')} "
            f"| {_fmt(_mean([r['engine_mismatch_k3'] for r in rs]), '.2e')} "
            f"| {_fmt(_mean([r['engine_mismatch_k3_aligned'] for r in rs]), '.2e', 'n/a (fp32)')} "
            f"| {100 * _mean([r['engine_equal_tokens'] for r in rs]):.1f}% "
            f"| {_fmt(100 * _mean([r['engine_equal_tokens_aligned'] for r in rs]), '.1f', 'n/a')}{'' if mode == 'fp32' else '%'} |")
    lines += ["", "Delta sync bytes: what the weight sync to a separate engine process sends per step (changed "
              "elements only; as in the table above). Push: parameters and bytes handed to the engine per step (a changed element ships its whole "
              "parameter and those fused with it in vLLM), wall time with the engine's read-back of every "
              "parameter. engine_weights_equal: steps after whose push the engine's kernels computed with exactly "
              "the served bits (-0.0 and subnormals count as +0). Mismatch: per generated token of every step's "
              "rollouts, logp_trainer − logp_vLLM; unaligned = the loss's own forward (HF eager), aligned = the same "
              "served weights with the trainer aligned to the vllm-cpu profile; means over steps.", ""]
    return "\n".join(lines)


REBUILT = ("results.md", "summary.txt", "reward.png", "endpoints.md")  # what rebuild() writes


def rebuild(run_dir: str, out_dir: str | None = None) -> str:
    """Rewrite a finished run's results.md, summary.txt, reward.png and endpoints.md from its steps.csv
    and run.json alone (into ``out_dir``, default the run directory); returns the summary text. The same
    inputs give the same bytes (the PNG carries no version or date)."""
    import json

    from faircast_jobs import endpoints, plots

    out_dir = out_dir or run_dir
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(run_dir, "run.json")) as f:
        meta = json.load(f)
    cfg = JobConfig.from_json(meta["config"])
    rows = read_csv(os.path.join(run_dir, "steps.csv"))
    summaries = summarize(rows, meta.get("finals", []), cfg.modes, tie=cfg.tie)
    plots.plot_run(rows, os.path.join(out_dir, "reward.png"), title=headline(cfg, meta["world_size"]))
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(summaries, cfg, meta["world_size"], meta["wall_s"]) + engine_table(rows, cfg.modes))
    text = summary_text(summaries, cfg, meta["world_size"], meta["wall_s"], run_dir, rows)
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, "endpoints.md"), "w") as f:
        f.write(endpoints.markdown(rows))
    return text


def run_dirs(path: str) -> list[str]:
    """``path`` itself if it holds a run (steps.csv and run.json), else every run directory below it, sorted."""
    def is_run(d: str) -> bool:
        return all(os.path.isfile(os.path.join(d, f)) for f in ("steps.csv", "run.json"))

    if is_run(path):
        return [path]
    found = sorted(root for root, _, _ in os.walk(path) if is_run(root))
    if not found:
        raise FileNotFoundError(f"{path}: no run directory (steps.csv + run.json) here or below")
    return found


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="faircast_jobs.report",
        description="Rebuild a GRPO run's tables and plot from its steps.csv and run.json: "
                    "python3 -m faircast_jobs.report --rebuild docs/grpo (every committed run below it)")
    parser.add_argument("run_dir", nargs="*", help="run directories (or folders holding them)")
    parser.add_argument("--rebuild", nargs="+", default=[], metavar="DIR", help="same as the positional directories")
    args = parser.parse_args(argv)
    targets = list(args.run_dir) + list(args.rebuild)
    if not targets:
        parser.error("name at least one run directory, e.g. --rebuild docs/grpo")
    for target in targets:
        for run_dir in run_dirs(target):
            text = rebuild(run_dir)
            print(text if len(targets) == 1 and run_dir == target else f"rebuilt {run_dir}: {', '.join(REBUILT)}")


if __name__ == "__main__":
    main()


def pretrained_table(rows: Sequence[dict], modes: Sequence[str]) -> str:
    """Per mode and seed: mean reward (all steps and the last 20%), served changed fraction per step (first
    step, mean), lag along drift (mean, peak), KL(master || served) on the fixed batch (mean, last), seconds
    per step (rollout + train + measurement, mean)."""
    lines = ["", "| mode | seed | steps | reward (all) | reward (last 20%) | changed/step: step 1, mean | lag along drift: "
             "mean, peak (steps) | KL(master‖served): mean, last | s/step |", "|---|---|---|---|---|---|---|---|---|"]
    for mode in modes:
        for seed in sorted({int(r["seed"]) for r in rows if r["mode"] == mode}):
            mine = sorted((r for r in rows if r["mode"] == mode and int(r["seed"]) == seed), key=lambda r: r["step"])
            lags = [r["lag_drift_steps"] for r in mine if not math.isnan(r.get("lag_drift_steps", math.nan))]
            kls = [r.get("kl_master", math.nan) for r in mine]
            kls = [k for k in kls if not math.isnan(k)]
            secs = _mean([(r["rollout_ms"] + r["train_ms"] + r["extra_ms"]) / 1e3 for r in mine])
            lines.append(
                f"| {mode} | {seed} | {len(mine)} | {_mean([r['reward'] for r in mine]):.3f} | "
                f"{_mean([r['reward'] for r in tail(mine)]):.3f} | {100 * mine[0]['changed_fraction']:.2f}%, "
                f"{100 * _mean([r['changed_fraction'] for r in mine]):.2f}% | "
                f"{_fmt(_mean(lags), '.1f')}, {_fmt(max(lags) if lags else math.nan, '.0f')} | "
                f"{_fmt(_mean(kls), '.2e')}, {_fmt(kls[-1] if kls else math.nan, '.2e')} | {secs:.1f} |")
    return "\n".join(lines) + "\n"
