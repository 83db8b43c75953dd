"""launch/smollm2_campaign.sh keeps each finished run's rows where git tracks them and does not run a kept run
again: the run folders under runs/ are ignored by git and do not outlive the checkout that wrote them, so the
rows committed from the kept folder are what a later session continues from.

The script runs for real, in a copy of its launch folder, with launch/main.sh replaced by a job that writes a
run folder the way the real one does (steps.csv, job.json, and run.json only once every step is done, not
after a session stopped by --session-steps) and records every call; the real job is
tested by tests/jobs/test_job_pretrained.py."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from conftest import ROOT

FAKE_JOB = r"""#!/usr/bin/env bash
set -u
session=""
while [ $# -gt 0 ]; do
  case "$1" in --out) out="$2"; shift 2;; --name) name="$2"; shift 2;; --session-steps) session="$2"; shift 2;;
    *) shift;; esac
done
echo "$name" >> "$CALLS"
[ "$name" = "${FAIL:-}" ] && exit 1
mkdir -p "$out/$name"
printf 'step,reward\n1,0.5\n' > "$out/$name/steps.csv"
echo '{"name": "'"$name"'"}' > "$out/$name/job.json"
# as the real job: run.json only when every step is done, not after a session stopped by --session-steps
[ "$name" = "${NO_RUN_JSON:-}" ] || [ -n "$session" ] || echo '{}' > "$out/$name/run.json"
"""

ALL_RUNS = ([f"repro-seed{s}-{m}" for s in (0, 1) for m in ("nearest", "dither")]
            + [f"lr1e-5-seed{s}-{m}" for s in (0, 1, 2, 3, 4, 5, 6, 7) for m in ("nearest", "dither")] + [f"lr1e-5-fp32-seed{s}" for s in (0, 1, 2)])


def copy_repo(tmp: Path) -> Path:
    repo = tmp / "repo"
    (repo / "launch").mkdir(parents=True)
    for name in ("smollm2_campaign.sh", "smollm2_run.sh"):
        shutil.copy(ROOT / "launch" / name, repo / "launch" / name)
    (repo / "launch" / "main.sh").write_text(FAKE_JOB)
    (repo / "docs" / "pretrained" / "campaign").mkdir(parents=True)
    shutil.copy(ROOT / "docs/pretrained/campaign/preregistered.json", repo / "docs/pretrained/campaign/")
    return repo


def campaign(repo: Path, calls: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "CALLS": str(calls), "RETRIES": "1", "PAUSE": "0",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env}
    return subprocess.run(["bash", "launch/smollm2_campaign.sh"], cwd=repo, env=environ, capture_output=True,
                          text=True, timeout=300)


def test_finished_runs_are_kept_whole_and_not_run_again(tmp_path):
    repo, calls = copy_repo(tmp_path), tmp_path / "calls"
    first = campaign(repo, calls)
    assert first.returncode == 0, first.stderr
    # the fake rows reproduce nothing, so seeds 0 and 1 run again in full, with their fp32 references
    assert calls.read_text().split() == ALL_RUNS
    kept = repo / "docs/pretrained/campaign/runs"
    assert sorted(p.name for p in kept.iterdir()) == sorted(ALL_RUNS)  # no partial folder left beside them
    for name in ALL_RUNS:  # the reproduction runs stop after 5 steps on purpose: the job writes no run.json then
        files = ["job.json", "steps.csv"] if name.startswith("repro-") else ["job.json", "run.json", "steps.csv"]
        assert sorted(p.name for p in (kept / name).iterdir()) == files
        assert (kept / name / "job.json").read_text() == (repo / "runs/campaign" / name / "job.json").read_text()
    # a later checkout has the kept rows and none of runs/: nothing runs again
    shutil.rmtree(repo / "runs")
    calls.unlink()
    second = campaign(repo, calls)
    assert second.returncode == 0, second.stderr
    assert not calls.exists()


def test_a_failed_or_incomplete_run_is_not_kept_and_runs_again_next_time(tmp_path):
    repo, calls = copy_repo(tmp_path), tmp_path / "calls"
    campaign(repo, calls, FAIL="lr1e-5-seed3-dither", NO_RUN_JSON="lr1e-5-seed5-nearest")
    kept = repo / "docs/pretrained/campaign/runs"
    assert not (kept / "lr1e-5-seed3-dither").exists()
    assert not (kept / "lr1e-5-seed5-nearest").exists()
    assert not [p for p in kept.iterdir() if p.name.startswith(".")]  # the half-made copy was removed
    assert (kept / "lr1e-5-seed4-nearest" / "steps.csv").exists()  # the campaign went on past the failure
    calls.unlink()
    campaign(repo, calls)
    assert calls.read_text().split() == ["lr1e-5-seed3-dither", "lr1e-5-seed5-nearest"]


def test_the_campaign_does_not_start_on_another_kind_of_cpu(tmp_path):
    """The registration takes every seed on one kind of CPU: with a kept run from another kind, no run starts."""
    import json

    import torch

    repo, calls = copy_repo(tmp_path), tmp_path / "calls"
    other = "AVX2" if torch.backends.cpu.get_cpu_capability() != "AVX2" else "AVX512"
    kept = repo / "docs/pretrained/campaign/runs/lr1e-5-seed0-nearest"
    kept.mkdir(parents=True)
    (kept / "steps.csv").write_text("step,reward\n1,0.5\n")
    (kept / "run.json").write_text(json.dumps({"provenance": {"cpu_capability": other}, "sessions": []}))
    proc = campaign(repo, calls)
    assert proc.returncode == 2 and not calls.exists(), proc.stdout + proc.stderr
    assert f"ran on {other}" in proc.stderr and f"Run the campaign on a CPU with {other}" in proc.stderr
