"""The pre-registered endpoints of the GRPO job (docs/grpo.md, "Pre-registered"), from a run's steps.csv.

Per (mode, seed) reward curve ``r_t`` (the ``reward`` column, ``t = 1 … T``):

- AUC: the mean of ``r_t`` over the steps (optionally a span ``a..b`` of them);
- steps to 0.30: the first ``t`` whose trailing 25-step mean of ``r`` (fewer before step 25) is >= 0.30,
  ``T + 1`` when none is (censored);
- final-window reward: the mean over the last 20% of steps (the job's "final reward").

With ``--span a-b`` the AUC is the mean over steps ``a..b``, and steps to 0.30 and the final window are
those of the curve cut at step ``b`` (the 500-step endpoints of a longer run: ``--span 1-500``).

Contrasts are paired by seed with :func:`faircast_jobs.stats.paired` (bootstrap interval, sign
test, W/T/L with a tie band per endpoint). ``python3 -m faircast_jobs.endpoints RUN_DIR [--span a-b]``
prints the table.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

from faircast_jobs import stats
from faircast_jobs.steps_csv import read_csv

THRESHOLD = 0.30
WINDOW = 25
TIES = {"auc": 0.005, "final": 0.01, "steps_to": 5.0}
ENDPOINT_NAMES = {"auc": "AUC (mean reward per step)", "final": "final-window reward (last 20%)",
                  "steps_to": f"steps to {THRESHOLD:.2f} (trailing {WINDOW}-step mean)"}
PRIMARY = ("dither", "nearest", "auc")
# (a, b, endpoint): a − b per seed; for steps to the threshold RN comes first (positive: RN later)
CONTRASTS: tuple[tuple[str, str, str], ...] = (
    PRIMARY, ("dither", "nearest", "final"), ("nearest", "dither", "steps_to"),
    ("fp32", "nearest", "auc"), ("fp32", "nearest", "final"), ("nearest", "fp32", "steps_to"),
    ("dither", "fp32", "auc"), ("dither", "fp32", "final"), ("fp32", "dither", "steps_to"),
)


def curves(rows: Sequence[dict]) -> dict[tuple[str, int], list[float]]:
    """Per (mode, seed) the rewards in step order; a curve must hold steps 1..T without a gap."""
    by: dict[tuple[str, int], dict[int, float]] = {}
    for r in rows:
        by.setdefault((str(r["mode"]), int(r["seed"])), {})[int(r["step"])] = float(r["reward"])
    out = {}
    for key, steps in by.items():
        if sorted(steps) != list(range(1, len(steps) + 1)):
            raise ValueError(f"{key[0]} seed {key[1]}: steps are not 1..{len(steps)} without gaps")
        out[key] = [steps[t] for t in range(1, len(steps) + 1)]
    return out


def auc(r: Sequence[float], first: int = 1, last: int | None = None) -> float:
    """Mean reward per step over steps ``first..last`` (1-based, inclusive; default: all)."""
    last = len(r) if last is None else last
    if not 1 <= first <= last <= len(r):
        raise ValueError(f"span {first}-{last} is outside steps 1-{len(r)}")
    window = r[first - 1:last]
    return sum(window) / len(window)


def steps_to(r: Sequence[float], threshold: float = THRESHOLD, window: int = WINDOW) -> int:
    """First step whose trailing ``window``-step mean reaches ``threshold``; ``len(r) + 1`` if none."""
    acc = 0.0
    for i, v in enumerate(r):
        acc += v
        if i >= window:
            acc -= r[i - window]
        if acc / min(i + 1, window) >= threshold:
            return i + 1
    return len(r) + 1


def final_window(r: Sequence[float], fraction: float = 0.2) -> float:
    """Mean over the last ``fraction`` of steps (at least one), as the job's final reward."""
    n = max(1, round(fraction * len(r)))
    return sum(r[-n:]) / n


def endpoint_fn(name: str, span: tuple[int, int] | None = None) -> Callable[[Sequence[float]], float]:
    if name == "auc":
        return (lambda r: auc(r, *span)) if span else auc
    if name == "steps_to":
        return (lambda r: float(steps_to(r[:span[1]] if span else r)))
    if name == "final":
        return (lambda r: final_window(r[:span[1]] if span else r))
    raise ValueError(f"unknown endpoint {name!r}; choose from {', '.join(ENDPOINT_NAMES)}")


@dataclass(frozen=True)
class Contrast:
    a: str
    b: str
    endpoint: str
    tie: float
    paired: stats.Paired


def complete_seeds(table: dict[tuple[str, int], list[float]], modes: Sequence[str]) -> list[int]:
    """Seeds whose every mode in ``modes`` has a curve of the run's full length."""
    length = max(len(c) for c in table.values())
    seeds = sorted({s for _, s in table})
    return [s for s in seeds if all(len(table.get((m, s), [])) == length for m in modes)]


def contrasts(rows: Sequence[dict], which: Sequence[tuple[str, str, str]] = CONTRASTS,
              span: tuple[int, int] | None = None) -> list[Contrast]:
    table = curves(rows)
    modes = sorted({m for m, _ in table})
    out = []
    for a, b, name in which:
        if a not in modes or b not in modes:
            continue
        seeds = complete_seeds(table, (a, b))
        f = endpoint_fn(name, span)
        va = {s: f(table[(a, s)]) for s in seeds}
        vb = {s: f(table[(b, s)]) for s in seeds}
        out.append(Contrast(a, b, name, TIES[name], stats.paired(va, vb, TIES[name], (a, b))))
    return out


def verdict(c: Contrast) -> str:
    """The pre-registered decision rule (for the primary contrast)."""
    lo, hi = c.paired.ci_boot
    if lo > 0 and c.paired.p_sign < 0.05:
        return "confirms"
    if hi < 0:
        return "contradicts"
    return "inconclusive"


def fewest_seeds_for_test(alpha: float = 0.05) -> int:
    """The fewest paired seeds whose exact two-sided sign test can give p < ``alpha`` (all of them one way)."""
    n = 1
    while stats.sign_test(n, 0) >= alpha:
        n += 1
    return n


def primary_text(rows: Sequence[dict], span: tuple[int, int] | None = None) -> str:
    """The pre-registered primary endpoint (dither − RN in AUC) as the job's end screen states it: with one
    seed labelled as one seed's size (no interval, no test), with more the decision rule's verdict."""
    a, b, name = PRIMARY
    label = f"{a} − {b} in {ENDPOINT_NAMES[name]}"
    found = contrasts(rows, (PRIMARY,), span)
    if not found:
        return f"Primary endpoint (pre-registered, docs/grpo.md): {label}: not measured, this run has no {a} or no {b}."
    p = found[0].paired
    table = curves(rows)
    steps = f"steps {span[0]}–{span[1]}" if span else f"steps 1–{max(len(c) for c in table.values())}"
    head = f"Primary endpoint (pre-registered, docs/grpo.md): {label}, {steps}"
    if p.n == 1:
        seed = complete_seeds(table, (a, b))[0]
        f = endpoint_fn(name, span)
        return (f"{head}, one seed ({seed}): {p.mean:+.4f} ({a} {f(table[(a, seed)]):.4f}, {b} {f(table[(b, seed)]):.4f}). "
                f"One seed gives the size of RN's cost on that seed, not a test of it: no interval, and the decision "
                f"rule's sign test can reach p < 0.05 only with at least {fewest_seeds_for_test()} paired seeds "
                f"(e.g. --seed-list 8-19).")
    lo, hi = p.ci_boot
    few = p.n < fewest_seeds_for_test()
    return (f"{head}, {p.n} seeds: {p.mean:+.4f} [{lo:+.4f}, {hi:+.4f}] (bootstrap 95%), W/T/L {p.wins}/{p.ties}/"
            f"{p.losses} (tie < {TIES[name]:g}), signs +{p.positive}/−{p.negative}, sign p = {p.p_sign:.2g}; "
            f"decision rule: {verdict(found[0])}" + (f" ({p.n} seeds cannot reach p < 0.05; at least {fewest_seeds_for_test()} can)"
                                       if few else "") + ".")


def per_mode(rows: Sequence[dict], span: tuple[int, int] | None = None) -> dict[str, dict[str, float]]:
    """Per mode, each endpoint's mean over the seeds every mode finished (a partial run's steps.csv holds
    some modes of its last seed), and how many of them never reached the threshold."""
    table = curves(rows)
    modes = list(dict.fromkeys(m for m, _ in table))
    seeds = set(complete_seeds(table, modes))
    out: dict[str, dict[str, float]] = {}
    for mode in modes:
        mine = [c for (m, s), c in table.items() if m == mode and s in seeds]
        row = {name: sum(endpoint_fn(name, span)(c) for c in mine) / len(mine) for name in ENDPOINT_NAMES}
        horizon = span[1] if span else len(mine[0])
        row["censored"] = sum(steps_to(c[:horizon]) > horizon for c in mine)
        row["seeds"] = len(mine)
        out[mode] = row
    return out


def _cell(x: float, spec: str) -> str:
    return "—" if math.isnan(x) else format(x, spec)


def markdown(rows: Sequence[dict], span: tuple[int, int] | None = None) -> str:
    spec = {"auc": "+.4f", "final": "+.4f", "steps_to": "+.1f"}
    where = f"steps {span[0]}–{span[1]}" if span else "all steps"
    lines = [f"Endpoints over {where} (docs/grpo.md, \"Pre-registered\").", "",
             "| mode | seeds | AUC | final-window reward | steps to 0.30 (censored) |", "|---|---|---|---|---|"]
    for mode, row in per_mode(rows, span).items():
        lines.append(f"| {mode} | {row['seeds']} | {row['auc']:.4f} | {row['final']:.4f} "
                     f"| {row['steps_to']:.1f} ({row['censored']}) |")
    lines += ["", "| contrast | endpoint | seeds | mean [95% bootstrap CI] | W/T/L (tie) | signs | sign p | |",
              "|---|---|---|---|---|---|---|---|"]
    for c in contrasts(rows, span=span):
        p, s = c.paired, spec[c.endpoint]
        lo, hi = p.ci_boot
        primary = (c.a, c.b, c.endpoint) == PRIMARY
        decision = (verdict(c) if p.n > 1 else "one seed: no test") if primary else ""
        lines.append(f"| {c.a} − {c.b}{' (primary)' if primary else ''} | {ENDPOINT_NAMES[c.endpoint]} | {p.n} "
                     f"| {p.mean:{s}} [{_cell(lo, s)}, {_cell(hi, s)}] | {p.wins}/{p.ties}/{p.losses} (< {c.tie:g}) "
                     f"| +{p.positive}/−{p.negative} | {p.p_sign:.3g} | {decision} |")
    return "\n".join(lines) + "\n\n" + primary_text(rows, span) + "\n"


def _span(text: str) -> tuple[int, int]:
    a, sep, b = text.partition("-")
    try:
        first, last = int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--span {text!r}: give steps as a-b, e.g. 1-500") from None
    if not sep or not 1 <= first <= last:
        raise argparse.ArgumentTypeError(f"--span {text!r}: need 1 <= a <= b")
    return first, last


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory holding steps.csv (or the CSV itself)")
    parser.add_argument("--span", type=_span, default=None, help="steps a-b (inclusive) for the endpoints")
    args = parser.parse_args(argv)
    path = args.run_dir if args.run_dir.endswith(".csv") else os.path.join(args.run_dir, "steps.csv")
    print(markdown(read_csv(path), args.span), end="")


if __name__ == "__main__":
    main()
