"""Paired statistics of the GRPO job's per-seed results: pure functions of lists of floats.

Every (mode, seed) run shares its seed's initial weights, prompts and sampling noise with the other
modes, so modes are compared *paired by seed*: per seed the difference of the two modes' final
rewards, then over seeds

- :func:`mean_ci`: the mean with a Student-t confidence interval,
- :func:`bootstrap_ci`: a percentile bootstrap interval of the mean (fixed resampling seed),
- :func:`sign_test`: the exact two-sided sign test on the signs of the differences (exact zeros dropped),
- :func:`paired`: all of it plus wins/ties/losses for one pair of modes. W/T/L is descriptive, with a
  tie band; the sign test uses the signs themselves, so a consistent difference smaller than the band
  still counts.

No dependency beyond the standard library (the t quantile is computed here).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Mapping, Sequence


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc needs 0 <= x <= 1, got {x}")
    if x in (0.0, 1.0):
        return x
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on :func:`t_cdf`)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _clean(values: Sequence[float]) -> list[float]:
    out = [float(v) for v in values if not math.isnan(float(v))]
    if not out:
        raise ValueError("no values (all missing)")
    return out


def mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the Student-t interval of the mean; with one value the interval is (nan, nan)."""
    xs = _clean(values)
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def bootstrap_ci(values: Sequence[float], level: float = 0.95, resamples: int = 10_000,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean: ``resamples`` resamples with replacement, drawn from
    ``random.Random(seed)`` so the interval is reproducible."""
    xs = _clean(values)
    n = len(xs)
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(xs, k=n)) / n for _ in range(resamples))
    lo_i = int(math.floor((1.0 - level) / 2.0 * resamples))
    hi_i = min(resamples - 1, int(math.ceil((1.0 + level) / 2.0 * resamples)) - 1)
    return means[lo_i], means[hi_i]


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided sign test: P(a split at least this uneven | each untied seed a fair coin)."""
    if wins < 0 or losses < 0:
        raise ValueError(f"sign_test needs counts >= 0, got {wins}, {losses}")
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    p = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * p)


@dataclass(frozen=True)
class Paired:
    """``a - b`` paired by seed."""

    a: str
    b: str
    n: int
    mean: float
    ci_t: tuple[float, float]
    ci_boot: tuple[float, float]
    wins: int  # difference >= tie
    ties: int
    losses: int  # difference <= -tie
    positive: int  # difference > 0 (the sign test's counts)
    negative: int
    p_sign: float

    @property
    def separates(self) -> bool:
        """Both the bootstrap interval excludes 0 and the sign test is significant at 5%."""
        return (self.ci_boot[0] > 0 or self.ci_boot[1] < 0) and self.p_sign < 0.05


def paired(a: Mapping[int, float], b: Mapping[int, float], tie: float, names: tuple[str, str] = ("a", "b"),
           level: float = 0.95) -> Paired:
    """``a - b`` over the seeds both have: mean, t and bootstrap intervals, W/T/L (|diff| < ``tie`` is a
    tie) and the sign test's p on the signs of the differences."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError(f"no common seeds between {names[0]} and {names[1]}")
    diffs = [a[s] - b[s] for s in seeds]
    mean, lo, hi = mean_ci(diffs, level)
    wins = sum(d >= tie for d in diffs)
    losses = sum(d <= -tie for d in diffs)
    ties = len(diffs) - wins - losses
    positive, negative = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    boot = bootstrap_ci(diffs, level) if len(diffs) > 1 else (math.nan, math.nan)
    return Paired(names[0], names[1], len(diffs), mean, (lo, hi), boot, wins, ties, losses, positive, negative,
                  sign_test(positive, negative))
