"""jobs/paper_table.py: the paper's table from run directories. Synthetic runs with known answers: the
changed fraction's median, the lag's peak, a paired reward difference that is a tie or not."""
from __future__ import annotations

import csv
import json
import math

import pytest

from faircast_jobs import paper_table

COLUMNS = ["mode", "seed", "step", "reward", "changed", "numel", "changed_fraction", "gap_spacings", "lag_steps",
           "lag_drift_steps", "bias_spacings", "kl_master", "rollout_ms", "train_ms", "extra_ms"]


def write_run(path, lr, rows):
    path.mkdir()
    (path / "job.json").write_text(json.dumps({"lr": lr, "steps": 40}))
    with open(path / "steps.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "nan") for k in COLUMNS})


def rows(mode, seed, reward_of, changed=0.01, lag_of=lambda s: float(s)):
    return [{"mode": mode, "seed": seed, "step": s, "reward": reward_of(s), "changed_fraction": changed if s > 1 else 0,
             "lag_drift_steps": lag_of(s) if s > 1 else "nan", "kl_master": 0.1, "rollout_ms": 1000,
             "train_ms": 2000, "extra_ms": 500} for s in range(1, 41)]


def test_block_bootstrap_of_a_constant_is_the_constant_and_covers_a_known_mean():
    assert paper_table.block_bootstrap([0.25] * 30) == (0.25, 0.25, 0.25)
    m, lo, hi = paper_table.block_bootstrap([0.0, 1.0] * 50)
    assert m == 0.5 and lo <= 0.5 <= hi and hi - lo < 0.2
    assert math.isnan(paper_table.block_bootstrap([])[0])


def test_the_table_reads_runs_of_two_rates(tmp_path, capsys):
    write_run(tmp_path / "a", 1e-5, rows("nearest", 0, lambda s: 0.2, changed=0.012, lag_of=lambda s: 30 - abs(s - 20))
              + rows("dither", 0, lambda s: 0.7, changed=0.02, lag_of=lambda s: 0.0))
    write_run(tmp_path / "b", 1e-6, rows("nearest", 0, lambda s: (s % 2) * 0.5) + rows("dither", 0, lambda s: (s % 2) * 0.5))
    (tmp_path / "p.json").write_text(json.dumps({"lr": 1e-5, "predicted_changed_fraction": 0.05,
                                                 "predicted_changed_fraction_over_run": 0.04,
                                                 "predicted_delay_steps": 21.0, "predicted_delay_peak_step": 48,
                                                 "share_below_half_spacing": 0.98}))
    assert paper_table.main([str(tmp_path / "a"), str(tmp_path / "b"), "--predict", f"start={tmp_path / 'p.json'}",
                             "--out", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "| 1e-05 | nearest | 1 × 40 | 1.20%, 1.08% | 20.2, 30.0 @ 20 |" in text  # first 10: nine of 1.2%, one 0; lag 789 / 39
    assert "| 1e-05 | 40 | +0.500 [+0.500, +0.500] | dither ahead |" in text
    assert "| 1e-06 | 40 | +0.000 [+0.000, +0.000] | tie (the interval holds 0) |" in text
    assert "| start | 1e-05 | 4.00%, 1.20% | 21.0 @ 48, 30.0 @ 20 (of 40) | 98.0% |" in text
    with open(tmp_path / "out" / "steps.csv") as f:
        merged = list(csv.DictReader(f))
    assert len(merged) == 160 and {r["lr"] for r in merged} == {"1e-05", "1e-06"} and merged[0]["run"] == "a"
    assert (tmp_path / "out" / "curves.png").stat().st_size > 10_000
    assert (tmp_path / "out" / "table.md").read_text() == text


def test_each_mode_is_paired_with_the_fp32_reference_where_it_ran(tmp_path, capsys):
    write_run(tmp_path / "a", 1e-5, rows("nearest", 0, lambda s: 0.2) + rows("dither", 0, lambda s: 0.7)
              + rows("nearest", 1, lambda s: 0.3) + rows("dither", 1, lambda s: 0.5))
    write_run(tmp_path / "f", 1e-5, rows("fp32", 0, lambda s: 0.6, changed=0.99))  # seed 0 only
    assert paper_table.main([str(tmp_path / "a"), str(tmp_path / "f")]) == 0
    text = capsys.readouterr().out
    assert "| lr | pairs (seed, step) | dither − fp32 reward [95% block CI] | reading |" in text
    assert "| 1e-05 | 40 | +0.100 [+0.100, +0.100] | dither ahead |" in text  # seed 0's 40 steps: 0.7 − 0.6
    assert "| 1e-05 | 40 | -0.400 [-0.400, -0.400] | fp32 ahead |" in text  # nearest: 0.2 − 0.6
    assert "| 1e-05 | 80 | +0.350 [" in text  # dither − nearest over both seeds: 0.5 and 0.2
    write_run(tmp_path / "g", 1e-6, rows("nearest", 0, lambda s: 0.2) + rows("dither", 0, lambda s: 0.7))
    assert paper_table.main([str(tmp_path / "g")]) == 0
    assert "fp32 reward" not in capsys.readouterr().out  # no reference, no table against it


def test_what_is_not_a_run_is_named(tmp_path, capsys):
    assert paper_table.main([str(tmp_path)]) == 2
    assert "not a job's run directory" in capsys.readouterr().err
    write_run(tmp_path / "a", 1e-5, rows("nearest", 0, lambda s: 0.0))
    assert paper_table.main([str(tmp_path / "a"), "--predict", "nolabel.json"]) == 2
    assert "--predict wants LABEL=FILE" in capsys.readouterr().err


def test_the_written_rows_rebuild_the_same_table(tmp_path, capsys):
    write_run(tmp_path / "a", 1e-5, rows("nearest", 0, lambda s: s % 3 / 4) + rows("dither", 0, lambda s: s % 4 / 4))
    assert paper_table.main([str(tmp_path / "a"), "--out", str(tmp_path / "one")]) == 0
    first = capsys.readouterr().out
    assert paper_table.main([str(tmp_path / "one" / "steps.csv"), "--out", str(tmp_path / "two")]) == 0
    assert capsys.readouterr().out == first
    assert (tmp_path / "two" / "steps.csv").read_bytes() == (tmp_path / "one" / "steps.csv").read_bytes()


PREDICTIONS = ["start lr 1e-5=docs/pretrained/predict-start-lr1e-5.json",
               "start lr 1e-6=docs/pretrained/predict-start-lr1e-6.json"]
# the committed tables: the first runs (taken before the tied LM head followed a push) and the runs since
TABLES = {"pretrained": PREDICTIONS, "pretrained/tied-head-fixed": PREDICTIONS}


@pytest.mark.parametrize("folder", sorted(TABLES))
def test_the_committed_table_rebuilds_from_the_committed_rows(tmp_path, capsys, folder):
    """docs/<folder>/table.md is what the documented command prints from the committed rows and predictions,
    and docs/pretrained.md shows the command and the table."""
    from conftest import ROOT

    committed = ROOT / "docs" / folder
    predictions = TABLES[folder]
    argv = [str(committed / "steps.csv"), *[p.replace("docs/", f"{ROOT}/docs/", 1) for p in predictions]]
    argv = [argv[0]] + [x for p in argv[1:] for x in ("--predict", p)] + ["--out", str(tmp_path)]
    assert paper_table.main(argv) == 0
    assert capsys.readouterr().out == (committed / "table.md").read_text()
    assert (tmp_path / "steps.csv").read_bytes() == (committed / "steps.csv").read_bytes()
    doc = (ROOT / "docs" / "pretrained.md").read_text()
    command = (f"python3 -m faircast_jobs.paper_table docs/{folder}/steps.csv "
               + " ".join(f'--predict "{p}"' for p in predictions) + f" --out docs/{folder}")
    assert command in doc  # the documented command is this one
    assert (committed / "table.md").read_text().split("\n\n", 1)[1].strip() in doc  # and the page shows its table
