"""faircast_jobs.stats: the paired statistics of the GRPO job, against independent computations."""
from __future__ import annotations

import math
import random

import pytest

from faircast_jobs import stats


@pytest.mark.parametrize("df,q975", [(1, 12.7062047), (2, 4.3026527), (7, 2.3646243), (30, 2.0422725)])
def test_t_quantile_matches_tables(df, q975):
    assert stats.t_quantile(0.975, df) == pytest.approx(q975, abs=1e-6)
    assert stats.t_quantile(0.025, df) == pytest.approx(-q975, abs=1e-6)
    assert stats.t_cdf(q975, df) == pytest.approx(0.975, abs=1e-7)  # the table rounds to 7 digits


def test_t_cdf_against_numeric_integration():
    df = 5
    c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    pdf = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)  # noqa: E731
    h, n = 1.5 / 20000, 20000
    area = sum(pdf((i + 0.5) * h) for i in range(n)) * h  # P(0 < T < 1.5), midpoint rule
    assert stats.t_cdf(1.5, df) == pytest.approx(0.5 + area, abs=1e-8)


def test_mean_ci():
    xs = [0.1, 0.4, 0.35, 0.2, 0.3, 0.25, 0.5, 0.15]
    mean, lo, hi = stats.mean_ci(xs)
    m = sum(xs) / 8
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / 7)
    assert mean == pytest.approx(m)
    assert hi - mean == pytest.approx(mean - lo) == pytest.approx(2.3646243 * sd / math.sqrt(8), rel=1e-6)
    one = stats.mean_ci([0.3])
    assert one[0] == 0.3 and math.isnan(one[1]) and math.isnan(one[2])
    assert stats.mean_ci([0.2, float("nan"), 0.4])[0] == pytest.approx(0.3)  # missing values are dropped
    with pytest.raises(ValueError, match="no values"):
        stats.mean_ci([float("nan")])


def test_sign_test_exact_binomial():
    assert stats.sign_test(8, 0) == pytest.approx(2 / 256)
    assert stats.sign_test(0, 8) == pytest.approx(2 / 256)
    assert stats.sign_test(7, 1) == pytest.approx(2 * 9 / 256)
    assert stats.sign_test(4, 4) == 1.0
    assert stats.sign_test(0, 0) == 1.0
    # against a brute-force enumeration of every outcome of 9 fair coins
    outcomes = [bin(i).count("1") for i in range(2**9)]
    extreme = sum(1 for w in outcomes if abs(w - 4.5) >= abs(2 - 4.5)) / 2**9
    assert stats.sign_test(2, 7) == pytest.approx(extreme)
    with pytest.raises(ValueError):
        stats.sign_test(-1, 3)


def test_bootstrap_ci_is_reproducible_and_covers_the_mean():
    rng = random.Random(3)
    xs = [rng.gauss(0.05, 0.1) for _ in range(12)]
    lo, hi = stats.bootstrap_ci(xs, resamples=4000)
    assert (lo, hi) == stats.bootstrap_ci(xs, resamples=4000)  # fixed resampling seed
    assert lo < sum(xs) / len(xs) < hi
    t_lo, t_hi = stats.mean_ci(xs)[1:]
    assert abs((hi - lo) - (t_hi - t_lo)) < 0.35 * (t_hi - t_lo)  # near the t interval's width
    assert stats.bootstrap_ci([0.2] * 5) == (0.2, 0.2)


def test_paired_counts_and_separation():
    a = {s: 0.5 + 0.01 * s for s in range(8)}
    b = {s: 0.3 for s in range(8)}
    b[9] = 0.9  # a seed only one side has is left out
    p = stats.paired(a, b, tie=0.01, names=("dither", "nearest"))
    assert (p.n, p.wins, p.ties, p.losses) == (8, 8, 0, 0)
    assert p.mean == pytest.approx(0.235)
    assert p.p_sign == pytest.approx(2 / 256) and p.separates
    assert p.ci_boot[0] > 0 and p.ci_t[0] > 0
    noisy = stats.paired({s: (-1) ** s * 0.1 for s in range(8)}, {s: 0.0 for s in range(8)}, tie=0.01)
    assert (noisy.wins, noisy.losses) == (4, 4) and not noisy.separates
    ties = stats.paired({0: 0.3, 1: 0.305}, {0: 0.3, 1: 0.3}, tie=0.01)
    assert (ties.wins, ties.ties, ties.losses) == (0, 2, 0)
    assert (ties.positive, ties.negative) == (1, 0)  # the sign test sees the sign inside the tie band
    small = stats.paired({s: 0.304 for s in range(8)}, {s: 0.3 for s in range(8)}, tie=0.01)
    assert (small.wins, small.ties, small.losses) == (0, 8, 0) and small.p_sign == pytest.approx(2 / 256)
    with pytest.raises(ValueError, match="no common seeds"):
        stats.paired({0: 1.0}, {1: 1.0}, tie=0.01)


def test_report_summarize_pairs_by_seed():
    """report.summarize on synthetic rows: the paired statistics are those of stats.paired on the
    per-seed final rewards (mean of the last 20% of steps), against RN and against fp32."""
    from faircast_jobs import report

    nan = float("nan")
    rows = []
    # dither − fp32 is −0.03 per seed: a clear loss, three tie bands from the edge (−0.01 would sit on the
    # band's edge, where float rounding of the two sums decides win or tie)
    for mode, offset in (("fp32", 0.12), ("nearest", 0.0), ("dither", 0.09)):
        for seed in range(8):
            for step in range(1, 11):
                reward = 0.3 + offset + 0.01 * seed + (0.2 if step > 8 else 0.0) * (seed % 2)
                rows.append({"mode": mode, "seed": seed, "step": step, "reward": reward, "changed_fraction": 0.01,
                             "numel": 100, "gap_spacings": nan, "lag_steps": nan, "sync_bytes": 10,
                             "sync_bytes_dense": 200, "cast_ms": nan, "rollout_ms": 1.0, "train_ms": 2.0,
                             "lag_drift_steps": 30.0 if mode == "nearest" and step < 8 else 0.0,
                             "bias_spacings": nan, "kl_step": 1e-6, "served_eval": 0.3 if step == 10 else nan,
                             "master_eval": (0.35 if mode == "nearest" else 0.3) if step == 10 else nan})
    out = {s.mode: s for s in report.summarize(rows, [], ("fp32", "nearest", "dither"), tie=0.01)}
    finals = {m: {seed: 0.3 + off + 0.01 * seed + 0.2 * (seed % 2) for seed in range(8)}
              for m, off in (("fp32", 0.12), ("nearest", 0.0), ("dither", 0.09))}
    for mode in ("fp32", "nearest", "dither"):
        assert out[mode].final_by_seed == pytest.approx(finals[mode])
    want = stats.paired(finals["dither"], finals["nearest"], tie=0.01)
    got = out["dither"].vs_control
    assert (got.wins, got.ties, got.losses) == (want.wins, want.ties, want.losses) == (8, 0, 0)
    assert got.mean == pytest.approx(0.09) and got.ci_boot == pytest.approx(want.ci_boot)
    ref = out["dither"].vs_reference
    assert ref.mean == pytest.approx(-0.03) and (ref.wins, ref.ties, ref.losses) == (0, 0, 8)
    assert out["nearest"].vs_control is None and out["fp32"].vs_reference is None
    assert out["nearest"].lag_drift_share == pytest.approx(0.7) and out["dither"].lag_drift_share == 0
    assert out["nearest"].consistency_end == {s: pytest.approx(0.05) for s in range(8)}
    assert out["fp32"].final_ci[0] < out["fp32"].final_mean < out["fp32"].final_ci[1]


def test_endpoints_on_known_curves():
    """jobs/endpoints.py (docs/grpo.md, "Pre-registered") on curves whose endpoints are known by hand."""
    from faircast_jobs import endpoints as ep

    r = [0.2] * 10 + [0.4] * 10
    assert ep.steps_to(r) == 20  # (10 x 0.2 + 10 x 0.4) / 20 = 0.30 first at step 20
    assert ep.steps_to([0.2] * 30) == 31  # never: censored at T + 1
    assert ep.steps_to([0.2] * 25 + [0.5] * 10) == 25 + 9  # trailing 25: (16 x 0.2 + 9 x 0.5) / 25 = 0.308
    assert ep.auc(r) == pytest.approx(0.3) and ep.auc(r, 11, 20) == pytest.approx(0.4)
    assert ep.final_window(r) == pytest.approx(0.4)  # the last 4 of 20 steps
    with pytest.raises(ValueError, match="outside steps"):
        ep.auc(r, 5, 21)

    def rows(shift: dict[int, float]) -> list[dict]:
        out = []
        for seed, d in shift.items():
            for step in range(1, 11):
                base = 0.2 + 0.01 * step + 0.001 * seed
                out += [{"mode": "nearest", "seed": seed, "step": step, "reward": base},
                        {"mode": "dither", "seed": seed, "step": step, "reward": base + d}]
        return out

    def primary(shift: dict[int, float]) -> ep.Contrast:
        return next(c for c in ep.contrasts(rows(shift)) if (c.a, c.b, c.endpoint) == ep.PRIMARY)

    up = primary({s: 0.01 + 0.001 * s for s in range(12)})
    assert up.paired.n == 12 and up.paired.mean == pytest.approx(0.0155) and ep.verdict(up) == "confirms"
    # 9 of 12 positive: the interval may exclude 0, the sign test (p = 0.146) does not: inconclusive
    nine = primary({s: (0.02 if s < 9 else -0.001) for s in range(12)})
    assert nine.paired.ci_boot[0] > 0 and nine.paired.p_sign > 0.05 and ep.verdict(nine) == "inconclusive"
    assert ep.verdict(primary({s: -0.01 - 0.001 * s for s in range(12)})) == "contradicts"
    # a seed missing a mode is left out of the pairing
    partial = [r for r in rows({s: 0.01 for s in range(3)}) if not (r["seed"] == 2 and r["mode"] == "dither")]
    assert next(c for c in ep.contrasts(partial) if c.endpoint == "auc").paired.n == 2


def test_primary_endpoint_on_the_end_screen():
    """The job's end screen states the pre-registered primary endpoint (dither − RN in AUC): one seed is
    labelled as one seed (its difference, no interval, no verdict), several seeds get the decision rule."""
    from faircast_jobs import endpoints as ep

    def rows(shift: dict[int, float], modes=("nearest", "dither")) -> list[dict]:
        out = []
        for seed, d in shift.items():
            for step in range(1, 11):
                base = 0.2 + 0.01 * step + 0.001 * seed
                out += [{"mode": m, "seed": seed, "step": step, "reward": base + (d if m == "dither" else 0.0)}
                        for m in modes]
        return out

    # the fewest seeds whose two-sided sign test can reach p < 0.05: 2 / 2**n < 0.05 first at n = 6
    assert min(n for n in range(1, 20) if 2 / 2**n < 0.05) == ep.fewest_seeds_for_test() == 6
    one = ep.primary_text(rows({7: 0.0123}))
    auc_rn = sum(0.2 + 0.01 * t + 0.007 for t in range(1, 11)) / 10
    assert "one seed (7): +0.0123" in one and f"nearest {auc_rn:.4f}" in one and f"dither {auc_rn + 0.0123:.4f}" in one
    assert "steps 1–10" in one and "not a test" in one and "at least 6 paired seeds" in one
    assert "[" not in one and "confirms" not in one and "inconclusive" not in one
    table = ep.markdown(rows({7: 0.0123}))
    assert "| one seed: no test |" in table and table.rstrip().endswith(one.rstrip())
    many = ep.primary_text(rows({s: 0.01 + 0.001 * s for s in range(12)}))
    assert "12 seeds: +0.0155 [" in many and "signs +12/−0" in many and many.endswith("decision rule: confirms.")
    few = ep.primary_text(rows({s: 0.01 for s in range(4)}))
    assert "decision rule: inconclusive (4 seeds cannot reach p < 0.05; at least 6 can)" in few
    assert "steps 3–8, one seed (0): +0.0100" in ep.primary_text(rows({0: 0.01}), (3, 8))
    assert "not measured, this run has no dither or no nearest" in ep.primary_text(rows({0: 0.0}, ("nearest", "fp32")))


def test_report_summary_labels_one_seed_and_states_the_primary_endpoint():
    from faircast_jobs import report
    from faircast_jobs.config import JobConfig

    nan = float("nan")
    rows = []
    for seeds in ((3,), (3, 4)):
        rows = [{"mode": m, "seed": s, "step": t, "reward": 0.3 + (0.02 if m == "dither" else 0.0) + 0.001 * t,
                 "changed_fraction": 0.01, "numel": 100, "gap_spacings": nan, "lag_steps": nan, "sync_bytes": 10,
                 "sync_bytes_dense": 200, "rollout_ms": 1.0, "train_ms": 2.0}
                for s in seeds for m in ("nearest", "dither") for t in range(1, 11)]
        summaries = report.summarize(rows, [], ("nearest", "dither"), tie=0.01)
        text = report.summary_text(summaries, JobConfig(), 2, 1.0, "run", rows)
        assert ("One seed (3): every figure above is that seed's" in text) == (len(seeds) == 1)
        assert "Primary endpoint (pre-registered, docs/grpo.md): dither − nearest in AUC" in text
        assert ("one seed (3): +0.0200" in text) == (len(seeds) == 1)
        assert ("2 seeds: +0.0200" in text) == (len(seeds) == 2)
        assert "Primary endpoint" not in report.summary_text(summaries, JobConfig(), 2, 1.0, "run")
