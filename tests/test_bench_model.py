"""faircast-ds bench --model: the pooling of the ranks' figures and the goal verdicts, on figures made
up here (the launches themselves are what `faircast-ds bench --model ... --layers 2` runs)."""
from __future__ import annotations

import pytest

from faircast_ds.bench_model import figures, format_table


def _rank(config: str, seconds: list[float], cast: float, peak: float, save: float, size: int,
          shard: int | None = 1000 * 1024 * 1024) -> dict:
    return {"config": config, "warmup": 1, "params": 187_045_376, "shard_elements": shard,
            "steps": [{"step": i + 1, "seconds": s, "cast_s": cast, "guard_s": 0.5 if i == 0 else 0.01,
                       "diagnostics_s": 0.2 if i == 0 else 0.0} for i, s in enumerate(seconds)],
            "train_peak_mib": peak, "peak_mib": peak + 100, "save_s": save, "load_s": save / 2,
            "checkpoint_bytes": size}


def test_figures_take_the_slower_rank_and_skip_the_warmup():
    f = figures(3, "dither", [[_rank("dither", [20.0, 8.0, 9.0, 10.0], 0.05, 3000, 4.0, 100),
                               _rank("dither", [21.0, 8.5, 8.0, 12.0], 0.06, 3100, 5.0, 0)]])
    assert f.step_s == 9.0  # median of max(8, 8.5), max(9, 8), max(10, 12)
    assert f.cast_ms == pytest.approx(60.0)
    assert f.guard_first_ms == pytest.approx(500.0) and f.guard_ms == pytest.approx(10.0)
    assert f.diagnostics_first_ms == pytest.approx(200.0) and f.diagnostics_ms == 0.0
    assert (f.peak_mib, f.save_s, f.checkpoint_bytes) == (3100, 5.0, 100)


def test_table_prints_ratios_to_plain_and_the_goals():
    plain = figures(3, "plain", [[_rank("plain", [9, 10, 10, 10], 0.0, 3000, 10.0, 1000, None)] * 2])
    fine = figures(3, "stochastic", [[_rank("stochastic", [9, 10.05, 10.05, 10.05], 0.05, 3050, 10.5, 1000)] * 2])
    slow = figures(3, "dither", [[_rank("dither", [9, 10.5, 10.5, 10.5], 0.05, 3100, 12.0, 1000)] * 2])
    # error feedback may add its 4-byte residual per shard element (4,000 MiB here) + 64 MiB
    ef = figures(3, "error_feedback", [[_rank("error_feedback", [9, 10.2, 10.2, 10.2], 0.1, 7000, 10.0, 1000)] * 2])
    text = format_table([plain, fine, slow, ef], model="qwen3-0.6b", layers=2, rounds=1, steps=3, command="x")
    rows = {line.split()[1]: line for line in text.splitlines() if line.startswith("3 ")}
    assert "1.005" in rows["stochastic"] and "<=1.01 pass" in rows["stochastic"]
    assert "<=+64 pass" in rows["stochastic"] and "+50" in rows["stochastic"]
    assert "1.050" in rows["dither"] and "<=1.01 MISS" in rows["dither"] and "<=+64 MISS" in rows["dither"]
    assert "<=1.10 MISS" in rows["dither"] and "<=1.10 pass" in rows["stochastic"]
    assert "<=+4064 pass" in rows["error_feedback"] and "<=1.03 pass" in rows["error_feedback"]
    assert "187,045,376 parameters" in text


def test_stages_are_checked(capsys):
    import argparse

    from faircast_ds.bench_model import main_from_args

    args = argparse.Namespace(stages="3,1", modes=["dither"])
    assert main_from_args(args) == 2
    assert "--stages takes 2 and/or 3" in capsys.readouterr().err
