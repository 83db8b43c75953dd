"""Statistics of ``python3 -m faircast_bench --model``: a configuration's median step time against plain
DeepSpeed's, with a bootstrap interval that respects the rounds.

Each configuration has, per round, the timed steps of one launch; launches of a round run back to back
(plain and every mode, interleaved), so two launches of one round share the machine's state and two
rounds may not (plain's own median has moved by half between rounds on a shared machine). The ratio is
``median(steps of the mode) / median(steps of plain)`` over all rounds; its interval resamples rounds
with replacement (the same rounds for the mode and for plain: a round's drift cancels in the ratio, and
the spread between rounds widens the interval as it should) and, inside each drawn round, each side's
steps with replacement. Percentile interval, fixed seed: the same data print the same interval.
"""
from __future__ import annotations

import random
import statistics
from typing import Sequence

RESAMPLES = 2000
LEVEL = 0.95
SEED = 20240229


def median_ratio(mode: Sequence[Sequence[float]], plain: Sequence[Sequence[float]]) -> float:
    """``median(all of mode's steps) / median(all of plain's steps)`` (each a list of rounds)."""
    return statistics.median(_flat(mode)) / statistics.median(_flat(plain))


def bootstrap_ratio_interval(mode: Sequence[Sequence[float]], plain: Sequence[Sequence[float]], *,
                             resamples: int = RESAMPLES, level: float = LEVEL,
                             seed: int = SEED) -> tuple[float, float]:
    """The percentile bootstrap interval of :func:`median_ratio`, resampling rounds (paired: round ``r``
    of the mode with round ``r`` of plain) and then the steps inside each drawn round. ``mode`` and
    ``plain`` hold the same number of rounds, each round at least one step."""
    if len(mode) != len(plain) or not mode:
        raise ValueError(f"paired rounds needed: {len(mode)} of the mode, {len(plain)} of plain")
    if any(not r for r in mode) or any(not r for r in plain):
        raise ValueError("every round needs at least one timed step")
    rng = random.Random(seed)
    n = len(mode)
    ratios = []
    for _ in range(resamples):
        rounds = [rng.randrange(n) for _ in range(n)]
        m = [x for r in rounds for x in rng.choices(mode[r], k=len(mode[r]))]
        p = [x for r in rounds for x in rng.choices(plain[r], k=len(plain[r]))]
        ratios.append(statistics.median(m) / statistics.median(p))
    ratios.sort()
    tail = (1 - level) / 2
    lo = ratios[int(tail * (resamples - 1))]
    hi = ratios[int(round((1 - tail) * (resamples - 1)))]
    return lo, hi


def spread(values: Sequence[float]) -> float:
    """Largest minus smallest (a configuration's round-to-round spread)."""
    return max(values) - min(values) if values else 0.0


def _flat(rounds: Sequence[Sequence[float]]) -> list[float]:
    return [x for r in rounds for x in r]
