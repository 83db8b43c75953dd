"""The pre-registered SmolLM2 campaign, analysed as registered (docs/pretrained/campaign/README.md).

    python3 -m faircast_jobs.campaign [ROWS...] [--prereg FILE] [--out DIR] [--pooled-steps]
                                         [--count-unchecked] [--lr LR --steps N]

ROWS are run folders (``steps.csv`` and ``job.json``, as ``launch/smollm2_campaign.sh`` writes them under
runs/campaign) or ``steps.csv`` tables ``faircast_jobs.paper_table`` wrote; the committed rows the
registration's reproduction check names (``reproduce.against``) are always read too. Only rows at the
registered learning rate count. It prints (and with ``--out`` writes ``table.md`` and ``campaign.png``):

- the reproduction check: for each seed of ``reproduce``, the first ``reproduce.steps`` steps of the re-runs
  (runs named ``repro-seed<s>-<mode>``) against the committed rows, column for column, exactly; a seed whose
  check fails or has not run does not count (``--count-unchecked`` counts it anyway and says so);
- per seed: both endpoints of each mode of the registered pair, their difference and W/T/L under the
  registered tie band (a difference of exactly the band is not a tie); the fp32 reference beside them on
  the seeds that have it;
- across seeds: the mean of the per-seed differences, its Student-t 95% interval over the seeds
  (df = seeds - 1) and the percentile bootstrap over seeds (10,000 resamples, numpy ``default_rng(0)``);
- with ``--pooled-steps`` only: the block bootstrap over the steps of all seeds joined into one series
  (``paper_table.block_bootstrap``), labelled as what it is, the within-run noise with the seeds pooled.

Refused, with the problem named: a pre-registration changed in git at or after the first commit that
adds campaign rows (or, with no rows committed yet, one that is not committed and clean), committed rows
changed after it, two runs with the same reward series (rows pasted from one seed into another), a run with
missing or repeated steps, two different runs for one (mode, seed), run folders whose ``run.json`` or
``sessions.jsonl`` name more than one CPU vector capability or vendor (the registration takes every seed on one
kind of CPU; matrix kernels round differently on AVX2 and AVX-512, fp32 sums on Intel and AMD). A seed still
running is reported as incomplete and left out. ``--this-cpu KEPT`` checks, before a campaign run starts, that
this machine's capability, and vendor where recorded, are those of the runs in KEPT (exit 2 naming both where not). ``--lr``/``--steps`` analyse other rows the same way (the endpoints' step ranges
scaled to N steps); the output then says it is not the registered analysis.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Sequence

import numpy as np

from faircast_jobs import stats
from faircast_jobs.paper_table import TableError, block_bootstrap, read_input

PREREG = "docs/pretrained/campaign/preregistered.json"
RESAMPLES = 10_000
FP32 = "fp32"


class CampaignError(ValueError):
    """The rows or the registration cannot be analysed as registered; the message says why."""


# ---- the registration -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Endpoint:
    name: str  # "primary" / "secondary"
    first: int
    last: int
    tie: float


@dataclass(frozen=True)
class Plan:
    """What the analysis takes from the registration (lr and steps possibly overridden)."""

    lr: float
    steps: int
    pair: tuple[str, str]
    seeds: tuple[int, ...]
    fp32_seeds: tuple[int, ...]
    endpoints: tuple[Endpoint, ...]
    repro_seeds: tuple[int, ...]
    repro_steps: int
    repro_columns: tuple[str, ...]
    against: str  # path of the committed rows
    registered: bool  # False under --lr/--steps


def load_plan(path: str, lr: float | None = None, steps: int | None = None) -> Plan:
    with open(path) as f:
        reg = json.load(f)
    n = int(reg["steps"])
    endpoints = []
    for name in ("primary", "secondary"):
        span = re.search(r"steps (\d+)-(\d+)", reg[name]["endpoint"])
        if not span:
            raise CampaignError(f"{path}: the {name} endpoint names no step range ('steps a-b')")
        first, last = int(span.group(1)), int(span.group(2))
        if steps is not None:  # the same share of the run: 1-100 and 81-100 of 100 are 1-50 and 41-50 of 50
            first, last = round((first - 1) * steps / n) + 1, round(last * steps / n)
        endpoints.append(Endpoint(name, first, last, float(reg[name]["tie_band"])))
    rep = reg.get("reproduce", {})
    root = _repo_of(path) or os.path.dirname(os.path.abspath(path))
    return Plan(lr=float(reg["lr"]) if lr is None else lr, steps=n if steps is None else steps,
                pair=tuple(reg["pair"]), seeds=tuple(reg["seeds"]), fp32_seeds=tuple(reg.get("fp32_seeds", ())),
                endpoints=tuple(endpoints), repro_seeds=tuple(rep.get("seeds", ())),
                repro_steps=int(rep.get("steps", 0)), repro_columns=tuple(rep.get("columns", ("reward",))),
                against=os.path.join(root, rep["against"]) if "against" in rep else "",
                registered=lr is None and steps is None)


# ---- git: the registration comes first -------------------------------------------------------------------

def _git(repo: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True)


def _repo_of(path: str) -> str | None:
    done = _git(os.path.dirname(os.path.abspath(path)) or ".", "rev-parse", "--show-toplevel")
    return done.stdout.strip() if done.returncode == 0 else None


def _commits(repo: str, path: str) -> list[str]:
    """The commits that touched ``path``, newest first (none: not committed)."""
    return _git(repo, "log", "--format=%H", "--", os.path.abspath(path)).stdout.split()


def _is_ancestor(repo: str, a: str, b: str) -> bool:
    return _git(repo, "merge-base", "--is-ancestor", a, b).returncode == 0


def _dirty(repo: str, path: str) -> bool:
    return bool(_git(repo, "status", "--porcelain", "--", os.path.abspath(path)).stdout.strip())


def check_dates(prereg: str, row_files: Sequence[str], against: str) -> None:
    """The registration is committed and clean, and older than every commit with campaign rows; the rows
    the reproduction is checked against did not change after it."""
    repo = _repo_of(prereg)
    if repo is None:
        raise CampaignError(f"{prereg} is not in a git repository: when it was fixed cannot be checked")
    registered = _commits(repo, prereg)
    if not registered:
        raise CampaignError(f"{prereg} is not committed: a pre-registration is committed before any run")
    if _dirty(repo, prereg):
        raise CampaignError(f"{prereg} has uncommitted changes: the analysis runs on the committed registration")
    for rows in row_files:
        if os.path.realpath(rows) == os.path.realpath(against) or _repo_of(rows) != repo:
            continue  # the rows it is checked against (below), or rows no commit holds yet
        history = _commits(repo, rows)
        if not history:
            continue
        added = history[-1]
        late = [c for c in registered if c == added or not _is_ancestor(repo, c, added)]
        if late:
            raise CampaignError(f"{prereg} changed in commit {late[0][:10]}, not before {added[:10]}, the first "
                                f"commit with the campaign rows {rows}: the registration (its tie band included) "
                                "must be fixed before any row; this analysis is refused")
    if against and _repo_of(against) == repo:
        if _dirty(repo, against):
            raise CampaignError(f"{against} (the committed rows of the reproduction check) has uncommitted changes")
        late = [c for c in _commits(repo, against) if not _is_ancestor(repo, c, registered[0])]
        if late:
            raise CampaignError(f"{against} (the committed rows of the reproduction check) changed in commit "
                                f"{late[0][:10]}, after the registration {registered[0][:10]}")


# ---- the CPU the runs ran on ------------------------------------------------------------------------------

def _sessions(folder: str) -> list[dict]:
    """A run folder's session records: ``run.json``'s ``provenance`` and ``sessions``, else ``sessions.jsonl``'s;
    none where neither is there (the 5-step reproduction runs stop before the job writes run.json, and were kept
    without it)."""
    from faircast_jobs.provenance import sessions

    path = os.path.join(folder, "run.json")
    if os.path.isfile(path):
        with open(path) as f:
            run = json.load(f)
        return [run.get("provenance") or {}, *(run.get("sessions") or [])]
    return sessions(folder)


def run_cpus(folder: str, key: str = "cpu_capability") -> set[str]:
    """What a run folder's sessions record under ``key`` (``provenance.record()``'s ``cpu_capability`` or
    ``cpu_vendor``; runs before 2026-12-08 record no vendor)."""
    return {entry[key] for entry in _sessions(folder) if entry.get(key)}


CPU_KEYS = ("cpu_capability", "cpu_vendor")


def campaign_cpu(folders: Sequence[str]) -> dict[str, str]:
    """The one CPU capability, and vendor where recorded, that the run folders in ``folders`` record, by key of
    :data:`CPU_KEYS` (a key none records is left out); refused when they record more than one, naming which run
    ran where."""
    found = {}
    for key in CPU_KEYS:
        by_cpu: dict[str, list[str]] = {}
        for folder in folders:
            for value in run_cpus(folder, key):
                by_cpu.setdefault(value, []).append(os.path.basename(os.path.normpath(folder)))
        if len(by_cpu) > 1:
            raise CampaignError("the runs ran on CPUs of more than one kind, and the registration takes every seed "
                                "on one: " + "; ".join(f"{v}: {', '.join(sorted(names))}"
                                                       for v, names in sorted(by_cpu.items())))
        if by_cpu:
            found[key] = next(iter(by_cpu))
    return found


def check_this_cpu(kept: str) -> str:
    """Before a campaign run starts: this machine's CPU capability must be the kept runs', and its vendor too where
    they record one (a message naming both otherwise). Returns this CPU's, as text."""
    import torch

    from faircast_jobs.provenance import cpu_vendor

    theirs = campaign_cpu(expand(kept))
    mine = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_vendor": cpu_vendor()}
    for key, value in mine.items():
        if key in theirs and value != theirs[key]:
            raise CampaignError(f"this CPU has {value}; the campaign's runs in {kept} ran on {theirs[key]}, and the "
                                f"registration takes every seed on one kind of CPU (matrix kernels round "
                                f"differently). Run the campaign on a CPU with {theirs[key]}")
    return " ".join(v for v in mine.values() if v)


# ---- the rows ---------------------------------------------------------------------------------------------

Run = tuple[str, str, int]  # (run name, mode, seed)


def read_runs(paths: Sequence[str], lr: float, committed: str = "") -> tuple[dict[Run, dict[int, dict]], dict[Run, str]]:
    """Every run at ``lr`` in ``paths``: its rows by step, and the file it came from. The same run read
    twice (a folder and a table holding it) must hold the same rows. The runs of ``committed`` (the
    reproduction check's committed rows) are named ``committed/<run>``: a seed run again in full on another
    machine keeps its run's name and is a different run, not the same one read twice."""
    runs: dict[Run, dict[int, dict]] = {}
    where: dict[Run, str] = {}
    for path in paths:
        try:
            rows = read_input(path)
        except (TableError, KeyError, ValueError) as exc:
            raise CampaignError(str(exc)) from exc
        prefix = "committed/" if committed and os.path.realpath(path) == os.path.realpath(committed) else ""
        mine: dict[Run, dict[int, dict]] = {}
        for r in rows:
            if not math.isclose(r["lr"], lr, rel_tol=1e-9):
                continue
            steps = mine.setdefault((prefix + r["run"], r["mode"], r["seed"]), {})
            if r["step"] in steps:
                raise CampaignError(f"{path}: run {r['run']} {r['mode']} seed {r['seed']} has step {r['step']} twice")
            steps[r["step"]] = r
        for key, steps in mine.items():
            if key in runs and not same_rows(runs[key], steps, ("reward", "changed", "kl_master")):
                raise CampaignError(f"run {key[0]} {key[1]} seed {key[2]} differs between {where[key]} and {path}")
            runs[key], where[key] = steps, path
    for (run, mode, seed), steps in runs.items():
        missing = sorted(set(range(1, max(steps) + 1)) - set(steps))
        if missing:
            raise CampaignError(f"{where[run, mode, seed]}: run {run} {mode} seed {seed} is missing step(s) "
                                f"{', '.join(map(str, missing[:10]))}{' …' if len(missing) > 10 else ''}")
    return runs, where


def _equal(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def same_rows(a: dict[int, dict], b: dict[int, dict], columns: Sequence[str]) -> bool:
    return a.keys() == b.keys() and all(_equal(a[s][c], b[s][c]) for s in a for c in columns)


def check_pasted(runs: dict[Run, dict[int, dict]], steps: int) -> None:
    """No two full runs share their reward series: that is rows pasted from one seed (or mode) into another."""
    seen: dict[tuple[float, ...], Run] = {}
    for key in sorted(runs, key=lambda k: (k[2], k[1], k[0])):
        if key[0].startswith("repro-") or not all(s in runs[key] for s in range(1, steps + 1)):
            continue
        series = tuple(runs[key][s]["reward"] for s in range(1, steps + 1))
        if series in seen:
            a = seen[series]
            raise CampaignError(f"{a[1]} seed {a[2]} (run {a[0]}) and {key[1]} seed {key[2]} (run {key[0]}) have the "
                                f"same {steps} rewards step for step: rows pasted from one into the other; refused")
        seen[series] = key


@dataclass
class Reproduction:
    seed: int
    lines: list[str]  # per mode, what the check found
    ok: bool


def reproduction(plan: Plan, runs: dict[Run, dict[int, dict]], where: dict[Run, str]) -> list[Reproduction]:
    """The first ``repro_steps`` steps of ``repro-seed<s>-<mode>`` against the committed rows, exactly."""
    out = []
    against = os.path.realpath(plan.against)
    for seed in plan.repro_seeds:
        lines, ok = [], True
        for mode in plan.pair:
            committed = [k for k in runs if os.path.realpath(where[k]) == against and k[1:] == (mode, seed)
                         and not k[0].startswith("repro-")]
            rerun = runs.get((f"repro-seed{seed}-{mode}", mode, seed), {})
            if len(committed) != 1:
                lines.append(f"{mode}: {len(committed)} committed runs at this lr in {plan.against}")
                ok = False
                continue
            old = runs[committed[0]]
            wanted = range(1, plan.repro_steps + 1)
            if not all(s in rerun for s in wanted):
                lines.append(f"{mode}: not checked yet (repro-seed{seed}-{mode} has {len(rerun)} of "
                             f"{plan.repro_steps} steps)")
                ok = False
                continue
            diffs = [(s, c) for s in wanted for c in plan.repro_columns if not _equal(old[s][c], rerun[s][c])]
            if diffs:
                s, c = diffs[0]
                lines.append(f"{mode}: differs at step {s}, {c}: committed {old[s][c]!r}, re-run {rerun[s][c]!r} "
                             f"({len(diffs)} values differ)")
                ok = False
            else:
                lines.append(f"{mode}: steps 1-{plan.repro_steps} equal in {', '.join(plan.repro_columns)}")
        out.append(Reproduction(seed, lines, ok))
    return out


def series(plan: Plan, runs: dict[Run, dict[int, dict]], where: dict[Run, str], counted_repro: set[int],
           ) -> tuple[dict[tuple[str, int], list[float]], list[str]]:
    """The reward series that count, per (mode, seed), and notes on what was left out. A seed of the
    reproduction check counts with its committed rows only once ``counted_repro`` holds it."""
    against = os.path.realpath(plan.against)
    chosen: dict[tuple[str, int], Run] = {}
    notes = []
    for key in sorted(runs, key=lambda k: (k[2], k[1], k[0])):
        name, mode, seed = key
        if name.startswith("repro-") or mode not in (*plan.pair, FP32):
            continue
        if seed not in plan.seeds or (mode == FP32 and seed not in plan.fp32_seeds):
            notes.append(f"run {name} {mode} seed {seed} is not in the registration: left out")
            continue
        committed = os.path.realpath(where[key]) == against
        if committed and (seed not in plan.repro_seeds or seed not in counted_repro):
            continue
        if (mode, seed) in chosen:
            raise CampaignError(f"{mode} seed {seed}: two runs, {chosen[mode, seed][0]} ({where[chosen[mode, seed]]}) "
                                f"and {name} ({where[key]}); give one")
        chosen[mode, seed] = key
    return {ms: [runs[k][s]["reward"] for s in sorted(runs[k]) if s <= plan.steps] for ms, k in chosen.items()}, notes


# ---- the statistics --------------------------------------------------------------------------------------

def endpoint_value(rewards: Sequence[float], ep: Endpoint) -> Fraction:
    """The mean reward over steps ``first..last``, exact (each reward is a float, so a Fraction holds it)."""
    window = rewards[ep.first - 1:ep.last]
    return sum((Fraction(r) for r in window), Fraction(0)) / len(window)


def wtl(diff: Fraction, tie: float) -> str:
    band = Fraction(repr(tie))  # the band as written (0.02 is 1/50, not the float nearest it)
    return "W" if diff >= band else "L" if diff <= -band else "T"


def bootstrap_over_seeds(diffs: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap of the mean over seeds: RESAMPLES resamples of the seeds, numpy default_rng(0)."""
    if len(diffs) < 2:
        return math.nan, math.nan
    means = np.random.default_rng(0).choice(np.asarray(diffs, dtype=np.float64), size=(RESAMPLES, len(diffs))).mean(1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


@dataclass
class Across:
    a: str
    b: str
    endpoint: Endpoint
    seeds: list[int]
    diffs: list[float]
    mean: float
    t: tuple[float, float]
    boot: tuple[float, float]
    wtl: str  # "W/T/L"


def across(a: str, b: str, ep: Endpoint, per_seed: dict[int, dict[str, dict[str, Fraction]]]) -> Across | None:
    seeds = [s for s in sorted(per_seed) if a in per_seed[s] and b in per_seed[s]]
    if not seeds:
        return None
    exact = [per_seed[s][a][ep.name] - per_seed[s][b][ep.name] for s in seeds]
    diffs = [float(d) for d in exact]
    mean, lo, hi = stats.mean_ci(diffs)
    marks = [wtl(d, ep.tie) for d in exact]
    return Across(a, b, ep, seeds, diffs, mean, (lo, hi), bootstrap_over_seeds(diffs),
                  "/".join(str(marks.count(m)) for m in "WTL"))


@dataclass
class Analysis:
    plan: Plan
    repro: list[Reproduction]
    count_unchecked: bool
    complete: list[int]  # seeds whose pair is complete
    incomplete: dict[int, str]  # seed -> what it lacks
    per_seed: dict[int, dict[str, dict[str, Fraction]]]  # seed -> mode -> endpoint -> value
    series: dict[tuple[str, int], list[float]]
    across: list[Across] = field(default_factory=list)
    pooled: list[tuple[Endpoint, int, tuple[float, float, float]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cpu: dict[str, str] = field(default_factory=dict)  # the one CPU kind the run folders record (campaign_cpu)


def analyse(plan: Plan, runs: dict[Run, dict[int, dict]], where: dict[Run, str], count_unchecked: bool = False,
            pooled: bool = False) -> Analysis:
    check_pasted(runs, plan.steps)
    repro = reproduction(plan, runs, where)
    counted = {r.seed for r in repro if r.ok or count_unchecked}
    found, notes = series(plan, runs, where, counted)
    a, b = plan.pair
    complete, incomplete, per_seed = [], {}, {}
    for seed in plan.seeds:
        have = {m: len(found.get((m, seed), [])) for m in plan.pair}
        if all(n >= plan.steps for n in have.values()):
            complete.append(seed)
        elif any(have.values()):
            incomplete[seed] = ", ".join(f"{m} {n}/{plan.steps} steps" for m, n in have.items())
        elif seed in plan.repro_seeds and seed not in counted:
            incomplete[seed] = "its committed rows do not count: the reproduction check has not passed"
        else:
            incomplete[seed] = "no rows yet"
    for seed in complete:
        modes = [*plan.pair] + ([FP32] if len(found.get((FP32, seed), [])) >= plan.steps else [])
        per_seed[seed] = {m: {ep.name: endpoint_value(found[m, seed], ep) for ep in plan.endpoints} for m in modes}
    out = Analysis(plan, repro, count_unchecked, complete, incomplete, per_seed, found, notes=notes)
    for x, y in ((a, b), (a, FP32), (b, FP32)):
        out.across += [c for ep in plan.endpoints if (c := across(x, y, ep, per_seed)) is not None]
    if pooled:
        for ep in plan.endpoints:
            steps = [found[a, s][t] - found[b, s][t] for s in complete for t in range(ep.first - 1, ep.last)]
            out.pooled.append((ep, len(complete), block_bootstrap(steps)))
    return out


# ---- the table and the figure ----------------------------------------------------------------------------

def _f(v: float, spec: str = "+.3f") -> str:
    return "–" if not math.isfinite(v) else format(v, spec)


def _span(ep: Endpoint) -> str:
    return f"{ep.name} (steps {ep.first}-{ep.last})"


def markdown(an: Analysis) -> str:
    p, (a, b) = an.plan, an.plan.pair
    lines = [f"# {a} − {b}: lr {p.lr:g}, {p.steps} steps, seeds {', '.join(map(str, p.seeds))}", ""]
    if not p.registered:
        lines += ["**Not the registered analysis:** --lr/--steps change what the registration fixed; the endpoints' "
                  "step ranges are scaled to the run.", ""]
    if an.cpu:
        lines += [f"Every run folder that records its CPU ran on one with {' '.join(an.cpu.values())} (run.json's "
                  "cpu_capability, and "
                  "cpu_vendor where recorded).", ""]
    lines += ["## Reproduction check", ""]
    for r in an.repro:
        verdict = "counts" if r.ok else "counts WITHOUT a passed check (--count-unchecked)" if an.count_unchecked \
            else "does not count"
        lines.append(f"- seed {r.seed} {verdict}: " + "; ".join(r.lines))
    if not an.repro:
        lines.append("- none registered")
    lines += ["", "## Per seed", "",
              f"{len(an.complete)} of {len(p.seeds)} seeds complete (both modes, {p.steps} steps)"
              + (f": {', '.join(map(str, an.complete))}." if an.complete else ".")]
    lines += [f"- seed {s} incomplete, left out: {why}" for s, why in an.incomplete.items()]
    lines += [f"- {n}" for n in an.notes]
    ties = ", ".join(f"{ep.name} {ep.tie:g}" for ep in p.endpoints)
    head = " | ".join(f"{b} {ep.name} | {a} {ep.name} | {a} − {b} | W/T/L" for ep in p.endpoints)
    lines += ["", f"Endpoints: mean reward over {', '.join(_span(ep) for ep in p.endpoints)}; "
              f"W/T/L: |{a} − {b}| < tie band ({ties}) is a tie.", "",
              f"| seed | {head} |", "|---|" + "---|" * 4 * len(p.endpoints)]
    for seed, modes in an.per_seed.items():
        cells = []
        for ep in p.endpoints:
            d = modes[a][ep.name] - modes[b][ep.name]
            cells.append(f"{float(modes[b][ep.name]):.4f} | {float(modes[a][ep.name]):.4f} | {float(d):+.4f} | "
                         f"{wtl(d, ep.tie)}")
        lines.append(f"| {seed} | {' | '.join(cells)} |")
    with_ref = [s for s, modes in an.per_seed.items() if FP32 in modes]
    if with_ref:
        lines += ["", f"The fp32 reference, on the seeds that have it ({', '.join(map(str, with_ref))}):", "",
                  "| seed | " + " | ".join(f"fp32 {ep.name} | {a} − fp32 | {b} − fp32" for ep in p.endpoints) + " |",
                  "|---|" + "---|" * 3 * len(p.endpoints)]
        for seed in with_ref:
            m = an.per_seed[seed]
            lines.append(f"| {seed} | " + " | ".join(
                f"{float(m[FP32][e.name]):.4f} | {float(m[a][e.name] - m[FP32][e.name]):+.4f} | "
                f"{float(m[b][e.name] - m[FP32][e.name]):+.4f}" for e in p.endpoints) + " |")
    lines += ["", "## Across seeds", "",
              "Mean of the per-seed differences; Student-t 95% interval over the seeds (df = n − 1); percentile "
              f"bootstrap over the seeds ({RESAMPLES:,} resamples, numpy default_rng(0)). n is the number of seeds.",
              f"W/T/L: under the tie band registered for {a} − {b} (beside fp32, descriptive only).",
              "", "| difference | endpoint | n seeds | mean | t 95% (df) | bootstrap over seeds 95% | W/T/L |",
              "|---|---|---|---|---|---|---|"]
    for c in an.across:
        lines.append(f"| {c.a} − {c.b} | {_span(c.endpoint)} | {len(c.seeds)} ({', '.join(map(str, c.seeds))}) | "
                     f"{c.mean:+.3f} | [{_f(c.t[0])}, {_f(c.t[1])}] ({len(c.seeds) - 1}) | "
                     f"[{_f(c.boot[0])}, {_f(c.boot[1])}] | {c.wtl} |")
    if not an.across:
        lines.append("| – | – | 0 | – | – | – | – |")
    fewest = min((len(c.seeds) for c in an.across), default=0)
    if 0 < fewest < 5:
        lines += ["", f"With {fewest} seeds these intervals say little: the t interval has "
                  f"{fewest - 1} degree(s) of freedom, the bootstrap can only resample the "
                  "seeds' own differences (at 2 seeds it spans them), and seeds whose differences coincide give an "
                  "interval of zero width, which is equal differences, not certainty."]
    if an.pooled:
        lines += ["", "## Within-run noise, seeds pooled (not an across-seed interval)", "",
                  f"A moving-block bootstrap (blocks of 10 steps) of the mean per-step {a} − {b} over the steps of all "
                  "complete seeds joined into one series (a block may cross from one seed into the next): the noise "
                  "of the steps within the runs. It says nothing about how much the result varies from seed to seed.",
                  "", "| endpoint | seeds × steps | mean | 95% block bootstrap over the pooled steps |", "|---|---|---|---|"]
        for ep, n, (mean, lo, hi) in an.pooled:
            lines.append(f"| {_span(ep)} | {n} × {ep.last - ep.first + 1} | {_f(mean)} | [{_f(lo)}, {_f(hi)}] |")
    return "\n".join(lines) + "\n"


def plot(an: Analysis, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from faircast_jobs.plots import COLORS, smooth

    a, b = an.plan.pair
    fig, axes = plt.subplots(1, 1 + len(an.plan.endpoints), figsize=(6 + 4.5 * len(an.plan.endpoints), 4.5))
    for (mode, seed), rewards in sorted(an.series.items()):
        if seed in an.complete:
            axes[0].plot(range(1, len(rewards) + 1), smooth(rewards, 10), color=COLORS.get(mode, "gray"), lw=1,
                         alpha=0.6, label=mode if seed == an.complete[0] else None)
    axes[0].set(xlabel="step", ylabel="reward (trailing mean of 10 steps)", title="complete seeds, one line each")
    if an.complete:
        axes[0].legend(fontsize=8)
    for ax, ep in zip(axes[1:], an.plan.endpoints):
        c = next((c for c in an.across if (c.a, c.b, c.endpoint) == (a, b, ep)), None)
        ax.axhspan(-ep.tie, ep.tie, color="gray", alpha=0.2, label=f"tie band ±{ep.tie:g}")
        ax.axhline(0, color="gray", lw=0.8)
        if c is not None:
            ax.plot(c.seeds, c.diffs, "o", color=COLORS.get(a), label="per seed")
            if math.isfinite(c.t[0]):
                ax.errorbar([max(c.seeds) + 1], [c.mean], yerr=[[c.mean - c.t[0]], [c.t[1] - c.mean]], fmt="s",
                            color="black", capsize=4, label=f"mean, t 95% over {len(c.seeds)} seeds")
            ax.set_xticks([*c.seeds, max(c.seeds) + 1], [*map(str, c.seeds), "mean"])
        ax.set(xlabel="seed", ylabel=f"mean reward, {a} − {b}", title=_span(ep))
        ax.legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"SmolLM2-135M-Instruct campaign, lr {an.plan.lr:g} (docs/pretrained/campaign/README.md)")
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


def expand(path: str) -> list[str]:
    """A folder of run folders (runs/campaign) is its run folders; anything else is itself."""
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "steps.csv")):
        return sorted(os.path.join(path, d) for d in os.listdir(path)
                      if os.path.isfile(os.path.join(path, d, "steps.csv")))
    return [path]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m faircast_jobs.campaign", description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="*", help="run folders (steps.csv + job.json) or steps.csv tables")
    parser.add_argument("--prereg", default=PREREG, help=f"the registration (default {PREREG})")
    parser.add_argument("--out", help="write table.md and campaign.png here")
    parser.add_argument("--pooled-steps", action="store_true",
                        help="add the block bootstrap over the pooled steps of all seeds (within-run noise)")
    parser.add_argument("--count-unchecked", action="store_true",
                        help="count the reproduction's seeds on their committed rows without a passed check")
    parser.add_argument("--lr", type=float, help="analyse rows of another learning rate (not the registered analysis)")
    parser.add_argument("--steps", type=int, help="runs of this many steps (not the registered analysis)")
    parser.add_argument("--this-cpu", metavar="KEPT",
                        help="only check that this machine's CPU capability (and vendor, where recorded) is that "
                             "of the runs in KEPT")
    args = parser.parse_args(argv)
    if args.this_cpu:
        try:
            print(f"campaign: this CPU has {check_this_cpu(args.this_cpu)}, as the runs in {args.this_cpu}")
        except (CampaignError, OSError, json.JSONDecodeError) as exc:
            print(f"campaign: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        plan = load_plan(args.prereg, args.lr, args.steps)
        given = [p for p in args.rows if not plan.against or os.path.realpath(p) != os.path.realpath(plan.against)]
        paths = ([plan.against] if plan.against else []) + [q for p in given for q in expand(p)]
        files = [p if p.endswith(".csv") else os.path.join(p, "steps.csv") for p in paths]
        check_dates(args.prereg, files, plan.against)
        runs, where = read_runs(paths, plan.lr, plan.against)
        an = analyse(plan, runs, where, args.count_unchecked, args.pooled_steps)
        an.cpu = campaign_cpu([p for p in paths if os.path.isdir(p)])
    except (CampaignError, OSError, KeyError, json.JSONDecodeError) as exc:
        print(f"campaign: {exc}", file=sys.stderr)
        return 2
    text = markdown(an)
    print(text, end="")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(text)
        plot(an, os.path.join(args.out, "campaign.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
