"""faircast_jobs.delta_table: the per-mode delta-sync table of docs/modes.md, read from job folders."""
import csv
import json

import pytest

from faircast_jobs import delta_table

FIELDS = ("mode", "seed", "step", "changed_fraction", "sync_bytes", "sync_bytes_dense", "engine_sync_bytes")


def write_job(folder, lr, rows):
    folder.mkdir(parents=True)
    (folder / "job.json").write_text(json.dumps({"lr": lr}))
    with open(folder / "steps.csv", "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow(dict(zip(FIELDS, r)))


def test_medians_leave_step_one_out_and_each_lr_keeps_its_own_rows(tmp_path):
    # step 1 is huge on purpose: a table that kept it would show it (median of 3 values would move)
    write_job(tmp_path / "a", 1e-5, [("nearest", 0, 1, 0.5, 900, 1000, 900), ("nearest", 0, 2, 0.01, 10, 1000, 12),
                                      ("nearest", 0, 3, 0.03, 30, 1000, 32), ("dither", 0, 2, 0.02, 20, 1000, 22)])
    write_job(tmp_path / "b", 1e-6, [("nearest", 0, 2, 0.004, 4, 1000, 5)])
    text = delta_table.table(delta_table.read(tmp_path))
    lines = [line for line in text.splitlines() if line.startswith("| 1e-")]
    # by hand: lr 1e-5 nearest over steps 2,3: changed median 2%, delta median 20 B = 2.0% of 1000, pushed 22 B
    assert lines[0] == "| 1e-05 | nearest | 2..3 | 2.00% | 98.00% | 0.0 MB | 2.0% | 0.0 MB |"
    assert lines[1].startswith("| 1e-05 | dither | 2..2 | 2.00% |")
    assert lines[2] == "| 1e-06 | nearest | 2..2 | 0.40% | 99.60% | 0.0 MB | 0.4% | 0.0 MB |"


def test_a_folder_without_its_job_or_rows_is_named(tmp_path):
    with pytest.raises(SystemExit, match="no .*steps.csv"):
        delta_table.read(tmp_path)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "steps.csv").write_text("mode,step\n")
    with pytest.raises(SystemExit, match="no job.json"):
        delta_table.read(tmp_path)
    write_job(tmp_path / "y", 1e-5, [("nearest", 0, 1, 0.5, 900, 1000, 900)])
    (tmp_path / "x" / "steps.csv").unlink()
    with pytest.raises(SystemExit, match="only step 1"):
        delta_table.table(delta_table.read(tmp_path))


def test_the_correction_table_reads_the_importance_sampling_columns_beside_the_lag(tmp_path):
    fields = ("mode", "step", "lag_drift_steps", "is_token_mean", "is_seq_min", "is_seq_max", "is_seq_masked",
              "phantom_clip_tokens", "engine_mismatch_k3")
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "job.json").write_text(json.dumps({"lr": 1e-6}))
    rows = [("nearest", 1, "nan", 9.0, 0.1, 9.0, 1.0, 1.0, 1.0),  # step 1: left out (it would move every figure)
            ("nearest", 2, 3.0, 1.01, 0.90, 1.20, 0.0, 0.02, 1e-3),
            ("nearest", 3, 5.0, 1.03, 0.80, 1.10, 0.5, 0.04, 3e-3),
            ("dither", 2, "nan", "nan", "nan", "nan", "nan", "nan", "nan")]  # no columns yet: no row
    with open(folder / "steps.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        w.writerows(rows)
    text = delta_table.correction_table(delta_table.read(tmp_path))
    body = [line for line in text.splitlines() if line.startswith("| 1e-")]
    # by hand over steps 2-3: lag median 4.0, token mean median 1.02, sequence min 0.80 max 1.20,
    # masked mean 25%, outside mean 3%, K3 median 2e-3
    assert body == ["| 1e-06 | nearest | 2 | 4.0 | 1.0200 | 0.800, 1.200 | 25.00% | 3.00% | 2.00e-03 |"]


def test_the_committed_table_is_what_the_committed_rows_print():
    """docs/modes.md's real-model delta table is the output of delta_table on the rows committed beside it."""
    from conftest import ROOT

    printed = delta_table.table(delta_table.read(ROOT / "docs/pretrained/delta"))
    doc = (ROOT / "docs/modes.md").read_text()
    rows = [line for line in printed.splitlines() if line.startswith("| 1e-")]
    assert rows and all(line in doc for line in rows), printed
