"""examples/trl_grpo/summarize.py: the TRL runs' table is the rows' arithmetic, done here by hand."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

SCRIPT = ROOT / "examples" / "trl_grpo" / "summarize.py"


def write(run, rewards, changed=0.01, done=True, masked_at=()):
    run.mkdir(parents=True)
    rows = [{"step": i + 1, "reward": r, "fair_cast/changed_fraction": changed, "fair_cast/lag_steps": 2.0,
             "sampling/importance_sampling_ratio/min": 0.0 if i + 1 in masked_at else 0.9 - i / 100,
             "sampling/importance_sampling_ratio/mean": 0.95 if i % 2 else 1.05,
             "sampling/importance_sampling_ratio/max": 1.1, "step_time": 40.0} for i, r in enumerate(rewards)]
    (run / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if done:
        (run / "done.json").write_text("{}")


def summarize(runs, docs):
    return subprocess.run([sys.executable, str(SCRIPT), str(runs), str(docs)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_the_table_is_the_rows_arithmetic(tmp_path):
    runs, docs = tmp_path / "runs", tmp_path / "docs"
    write(runs / "nearest-seed0", [0.0] * 10 + [0.5] * 20)  # all: 10/30 = 0.333; last 20: 0.5
    write(runs / "dither-seed0", [0.25] * 30, changed=0.03, masked_at=(4, 17))  # two steps logged a 0: masked
    write(runs / "dither-seed1", [1.0] * 3, done=False)  # no nearest partner: no difference row
    proc = summarize(runs, docs)
    assert proc.returncode == 0, proc.stderr
    table = (docs / "table.md").read_text()
    # ratio means alternate 1.05, 0.95 over 30 steps: 1.000
    assert "| nearest | 0 | 30 | 0.333 | 0.500 | 1.00% | 2.0 | [0.61, 1.10] | 1.000 | 0 | 40 |" in table
    assert "| dither | 0 | 30 | 0.250 | 0.250 | 3.00% | 2.0 | [0.00, 1.10] | 1.000 | 2 | 40 |" in table
    assert "| dither | 1 | 3 (unfinished) | 1.000 | 1.000 |" in table
    assert "| 0 | 30 | -0.083 | -0.250 |" in table and "| 1 | 3 |" not in table
    assert (docs / "rewards.png").stat().st_size > 1000
    assert (docs / "nearest-seed0.jsonl").read_text() == (runs / "nearest-seed0" / "steps.jsonl").read_text()


@pytest.mark.parametrize("steps", [[1, 3], [2, 1]])
def test_a_mixed_up_rows_file_is_refused(tmp_path, steps):
    run = tmp_path / "runs" / "dither-seed0"
    run.mkdir(parents=True)
    (run / "steps.jsonl").write_text("".join(json.dumps({"step": s, "reward": 0.0}) + "\n" for s in steps))
    proc = summarize(tmp_path / "runs", tmp_path / "docs")
    assert proc.returncode != 0 and "are not 1, 2, 3" in proc.stderr


def test_no_runs_is_an_error(tmp_path):
    (tmp_path / "runs").mkdir()
    proc = summarize(tmp_path / "runs", tmp_path / "docs")
    assert proc.returncode != 0 and "no <mode>-seed<seed>/steps.jsonl" in proc.stderr


def test_committed_rows_meet_the_new_runs_and_a_new_run_replaces_its_committed_rows(tmp_path):
    first, docs = tmp_path / "session1", tmp_path / "docs"
    write(first / "nearest-seed0", [0.5] * 4)
    write(first / "dither-seed0", [1.0] * 2, done=False)  # the session ended at step 2
    assert summarize(first, docs).returncode == 0
    assert json.loads((docs / "runs.json").read_text()) == {
        "dither-seed0": {"steps": 2, "finished": False}, "nearest-seed0": {"steps": 4, "finished": True}}
    # a later checkout: runs/ is gone; dither-seed0 ran again from the start and finished
    second = tmp_path / "session2"
    write(second / "dither-seed0", [0.75] * 4)
    proc = summarize(second, docs)
    assert proc.returncode == 0, proc.stderr
    table = (docs / "table.md").read_text()
    assert "| nearest | 0 | 4 | 0.500 |" in table  # read back from the committed rows
    assert "| dither | 0 | 4 | 0.750 |" in table and "unfinished" not in table
    assert "| 0 | 4 | +0.250 | +0.250 |" in table
    assert json.loads((docs / "runs.json").read_text())["dither-seed0"] == {"steps": 4, "finished": True}
    # with no runs at all, the committed rows alone give the same table
    (tmp_path / "empty").mkdir()
    assert summarize(tmp_path / "empty", docs).returncode == 0
    assert (docs / "table.md").read_text() == table


@pytest.mark.parametrize("record", [None, {"nearest-seed0": {"steps": 3, "finished": True}}])
def test_committed_rows_without_a_true_record_are_refused(tmp_path, record):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "nearest-seed0.jsonl").write_text("".join(json.dumps({"step": s, "reward": 0.0}) + "\n" for s in (1, 2)))
    if record is not None:
        (docs / "runs.json").write_text(json.dumps(record))
    proc = summarize(tmp_path / "none", docs)
    assert proc.returncode != 0
    assert ("says whether this run finished" if record is None else "2 steps, but") in proc.stderr
