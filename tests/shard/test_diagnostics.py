"""Diagnostics: S1, the master-served gap, the lag and the lag along the drift, checked against the full
recorded trajectory; the lag along the drift also in a noisy regime (lr 1e-4) where the L2 lag reads 0."""
from __future__ import annotations

import csv
import re

import pytest
import torch
from conftest import DIST, deepspeed_launch

from faircast_ds.casting.bits import bf16_spacing

pytestmark = pytest.mark.slow
HORIZON = 64


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("diagnostics")
    deepspeed_launch(DIST / "diagnostics_worker.py", 2, out)
    return out, torch.load(out / "diagnostics.pt")


def as_float(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) << 16).view(torch.float32)


def brute_force_lag(masters: torch.Tensor, served: torch.Tensor, i: int) -> int:
    """The past step whose master (over every element) is closest to the served copy at step i+1."""
    served_now = as_float(served[i]).double()
    distances = [float(((masters[i - k].double() - served_now) ** 2).sum()) for k in range(min(i + 1, HORIZON))]
    return min(range(len(distances)), key=distances.__getitem__)


def test_lag_estimate_matches_brute_force_for_round_to_nearest(run):
    d = run[1]["nearest"]
    masters, served = torch.stack(d["masters"]), torch.stack(d["served"])
    assert len(d["reports"]) == 8 and 0 < d["sample"] < masters.shape[1] / 4  # a real sample, not everything
    for step, report in d["reports"].items():
        truth = brute_force_lag(masters, served, step - 1)
        assert abs(report["lag_steps"] - truth) <= 0.3 * truth + 1, (step, report["lag_steps"], truth)
    assert d["reports"][40]["lag_steps"] >= 30, "in this regime round-to-nearest barely moves: the lag grows"


def test_lag_estimate_is_near_zero_for_unbiased_modes(run):
    results = run[1]
    rn = sum(r["lag_steps"] for r in results["nearest"]["reports"].values()) / 8
    for mode in ("stochastic", "dither", "error_feedback"):
        lags = [r["lag_steps"] for r in results[mode]["reports"].values()]
        assert sum(lags) / len(lags) <= 0.15 * rn, (mode, lags)
        assert lags[-1] <= 3, (mode, lags)


def drift_lag_over_every_element(masters: torch.Tensor, served: torch.Tensor, i: int) -> float:
    """K <master - served, D> / |D|^2 with D = master now - master K steps ago, over every element."""
    k = min(i, HORIZON - 1)
    d = (masters[i] - masters[i - k]).double()
    error = masters[i].double() - as_float(served[i]).double()
    return float(k * (error @ d) / (d @ d))


def test_drift_lag_matches_brute_force_for_round_to_nearest(run):
    d = run[1]["nearest"]
    masters, served = torch.stack(d["masters"]), torch.stack(d["served"])
    for step, report in d["reports"].items():
        truth = brute_force_lag(masters, served, step - 1)
        assert abs(report["lag_drift_steps"] - truth) <= 0.3 * truth + 1, (step, report["lag_drift_steps"], truth)
        # the sampled estimate is the same formula over every element, up to sampling
        full = drift_lag_over_every_element(masters, served, step - 1)
        assert report["lag_drift_steps"] == pytest.approx(full, rel=0.15, abs=1.0), (step, full)
    biases = [r["bias_spacings"] for r in d["reports"].values()]
    assert all(b < -0.03 for b in biases), biases  # served behind the master along the drift


def test_drift_lag_and_bias_are_near_zero_for_unbiased_modes(run):
    results = run[1]
    rn = results["nearest"]["reports"].values()
    rn_lag = sum(r["lag_drift_steps"] for r in rn) / len(rn)
    rn_bias = sum(r["bias_spacings"] for r in rn) / len(rn)
    for mode in ("stochastic", "dither", "error_feedback"):
        reports = results[mode]["reports"].values()
        lag = sum(r["lag_drift_steps"] for r in reports) / len(reports)
        bias = sum(r["bias_spacings"] for r in reports) / len(reports)
        assert abs(lag) <= 0.15 * rn_lag, (mode, lag, rn_lag)
        assert abs(bias) <= 0.2 * abs(rn_bias), (mode, bias, rn_bias)


def test_drift_lag_sees_round_to_nearest_where_the_l2_lag_reads_zero(run):
    noisy = run[1]["noisy"]
    reports = {mode: list(v["reports"].values()) for mode, v in noisy.items()}
    assert [r["lag_steps"] for r in reports["nearest"][-4:]] == [0, 0, 0, 0]  # the L2 search is blind here
    mean = {mode: sum(r["lag_drift_steps"] for r in rs) / len(rs) for mode, rs in reports.items()}
    assert mean["nearest"] > 0.2, mean
    for mode in ("stochastic", "dither", "error_feedback"):
        assert mean["nearest"] - mean[mode] >= 0.2, mean
        assert abs(mean[mode]) < 0.5, mean


@pytest.mark.parametrize("mode", ("nearest", "stochastic"))
def test_changed_fraction_and_gap_are_exact(run, mode):
    d = run[1][mode]
    masters, served = torch.stack(d["masters"]), torch.stack(d["served"])
    for step, report in d["reports"].items():
        i = step - 1
        changed = float((served[i] != served[i - 1]).double().mean())
        assert report["changed_fraction"] == pytest.approx(changed, rel=1e-12)
        s = as_float(served[i])
        mantissa, exponent = torch.frexp(s)  # s = mantissa * 2^exponent, 0.5 <= |mantissa| < 1
        spacing = torch.where(s == 0, torch.tensor(2.0**-133), torch.ldexp(torch.ones_like(s), exponent - 8))
        gap = float(((masters[i] - s).abs() / spacing).double().mean())
        assert report["gap_spacings"] == pytest.approx(gap, rel=1e-9)


def test_bf16_spacing():
    values = torch.tensor([1.0, 1.5, -3.0, 2.0**-126, 2.0**-130, 0.0]).to(torch.bfloat16)
    assert bf16_spacing(values).tolist() == [2.0**-7, 2.0**-7, 2.0**-6, 2.0**-133, 2.0**-133, 2.0**-133]


def test_bf16_spacing_of_every_bf16_value_and_of_fp32_values():
    """Every one of the 65,536 bf16 bit patterns, and fp32 values (special ones, every binade's edges, 2^20 random
    bit patterns), against the frexp definition written here (float64): 2^(e - 8) for |x| = m 2^e, 0.5 <= m < 1;
    2^-133 below 2^-126 and at 0; for Inf and NaN 2^121 (the top exponent field's binade)."""
    def oracle(x: torch.Tensor) -> torch.Tensor:
        d = x.double()
        _, exponent = torch.frexp(d)
        want = torch.where(d.abs() < 2.0**-126, torch.tensor(2.0**-133, dtype=torch.float64),
                           torch.ldexp(torch.ones_like(d), exponent - 8))
        return torch.where(d.isfinite(), want, torch.tensor(2.0**121, dtype=torch.float64)).float()

    every = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(bf16_spacing(every), oracle(every.float()))
    edges = torch.tensor([2.0**e for e in range(-149, 128)], dtype=torch.float64)
    special = torch.cat([edges, edges * (2 - 2.0**-23), -edges, torch.tensor([0.0, -0.0, 3.4e38, float("inf"),
                                                                              float("-inf"), float("nan")],
                                                                             dtype=torch.float64)]).float()
    random = torch.randint(-2**31, 2**31, (1 << 20,), generator=torch.Generator().manual_seed(3),
                           dtype=torch.int64).to(torch.int32).view(torch.float32)
    for x in (special, random):
        assert torch.equal(bf16_spacing(x), oracle(x))
    assert bf16_spacing(torch.zeros(2, 3)).shape == (2, 3) and bf16_spacing(torch.zeros(2, 3)).dtype == torch.float32


def test_metrics_reach_deepspeed_monitor_and_the_log(run):
    out, _ = run
    rows = list(csv.reader(open(next(out.glob("csv/fc/fair_cast_lag_steps.csv")))))
    assert [int(r[0]) for r in rows[1:]] == [5, 10, 15, 20, 25, 30, 35, 40]
    reports = run[1]["nearest"]["reports"]  # the worker writes the csv monitor for nearest only
    assert sorted(reports) == [5, 10, 15, 20, 25, 30, 35, 40]
    for name in ("changed_fraction", "gap_spacings", "lag_drift_steps", "bias_spacings"):
        path = out / "csv" / "fc" / f"fair_cast_{name}.csv"
        assert path.is_file(), f"DeepSpeed's csv monitor got no {name}"
        rows = list(csv.reader(open(path)))
        assert rows[0] == ["step", name]
        # every report, at its step, with the value Fair Cast reported
        assert [(int(r[0]), float(r[1])) for r in rows[1:]] == [(step, reports[step][name]) for step in sorted(reports)]


# rank 0's report line, as docs/diagnostics.md shows it
LOG_LINE = re.compile(r"\[fair_cast\] step (\d+): served changed (\d+\.\d{3})% \| gap (\d+\.\d{3}) spacings \| "
                      r"lag (\d+) steps \| lag along drift (-?\d+\.\d) steps \| bias ([+-]\d+\.\d{3}) spacings")


def report_lines(log: str, mode: str) -> dict[int, tuple[str, ...]]:
    """The report lines logged for the engine of ``mode`` (the worker builds nearest's first): between its
    banner and the next engine's."""
    lines = log.splitlines()
    start = next(i for i, line in enumerate(lines) if f"[fair_cast] active: mode={mode} " in line)
    end = next((i for i in range(start + 1, len(lines)) if "[fair_cast] active: mode=" in lines[i]), len(lines))
    found = [LOG_LINE.search(line) for line in lines[start:end]]
    return {int(m.group(1)): m.groups()[1:] for m in found if m}


def spacing_of(s: torch.Tensor) -> torch.Tensor:
    """The bf16 spacing at each fp32-held bf16 value: 2^(e - 8) for |s| = m 2^e with 0.5 <= m < 1; 2^-133
    (the subnormal spacing) below 2^-126 and at 0. Written here, not faircast_ds.casting.bits.bf16_spacing."""
    _, exponent = torch.frexp(s)
    return torch.where(s.abs() < 2.0**-126, torch.tensor(2.0**-133), torch.ldexp(torch.ones_like(s), exponent - 8))


def bias_over_every_element(masters: torch.Tensor, served: torch.Tensor, i: int) -> float:
    """The |D|-weighted mean of sign(D) (served - master) / spacing, D over the recorded history, every element."""
    k = min(i, HORIZON - 1)
    d = (masters[i] - masters[i - k]).double()
    s = as_float(served[i])
    spacing = spacing_of(s).double()
    return float(((s.double() - masters[i].double()) / spacing * d).sum() / d.abs().sum())


def test_the_log_prints_each_report_as_the_trajectory_has_it(run):
    """Round-to-nearest's report lines on rank 0, every number computed from the recorded trajectory:
    the changed percentage and the gap exactly (to the printed digits), the lag, the lag along the drift
    and the bias within the sampled estimates' tolerances of their every-element values; and each line
    prints the figures the monitor got."""
    out, results = run
    d = results["nearest"]
    masters, served = torch.stack(d["masters"]), torch.stack(d["served"])
    printed = report_lines((out / "launch.log").read_text(), "nearest")
    assert sorted(printed) == sorted(d["reports"]) == [5, 10, 15, 20, 25, 30, 35, 40], sorted(printed)
    for step, (changed, gap, lag, drift, bias) in printed.items():
        i = step - 1
        true_changed = 100 * float((served[i] != served[i - 1]).double().mean())
        s = as_float(served[i])
        true_gap = float(((masters[i] - s).abs() / spacing_of(s)).double().mean())
        assert abs(float(changed) - true_changed) <= 0.0005 + 1e-9, (step, changed, true_changed)
        assert abs(float(gap) - true_gap) <= 0.0005 + 1e-9, (step, gap, true_gap)
        truth = brute_force_lag(masters, served, i)
        assert abs(int(lag) - truth) <= 0.3 * truth + 1, (step, lag, truth)
        full = drift_lag_over_every_element(masters, served, i)
        assert abs(float(drift) - full) <= 0.15 * abs(full) + 1.05, (step, drift, full)
        full_bias = bias_over_every_element(masters, served, i)
        assert float(bias) < 0 and abs(float(bias) - full_bias) <= 0.25 * abs(full_bias) + 0.01, (step, bias, full_bias)
        r = d["reports"][step]  # what the monitor was sent (checked against its csv above)
        assert (changed, gap, lag, drift, bias) == (f"{100 * r['changed_fraction']:.3f}", f"{r['gap_spacings']:.3f}",
                                                    f"{r['lag_steps']:.0f}", f"{r['lag_drift_steps']:.1f}",
                                                    f"{r['bias_spacings']:+.3f}")
    assert int(printed[40][2]) >= 30  # in this regime round-to-nearest barely moves: the lag grows
