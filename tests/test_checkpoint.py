"""Durable state: bitwise resume for every stage and mode, elastic resume across world sizes, crash
recovery after a real SIGKILL, clear errors for bad state, and zero_to_fp32 still working."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import DIST, ROOT, assert_bitwise, cpu_env, deepspeed_launch

pytestmark = pytest.mark.slow
WORKER = DIST / "checkpoint_worker.py"
COMBOS = ["zero3/stochastic", "zero3/error_feedback", "zero3/dither", "zero3/nearest", "zero2/error_feedback",
          "zero1/error_feedback", "bf16_optimizer/error_feedback", "zero3+offload/error_feedback",
          "zero2+offload/stochastic"]


def to_universal(tag_dir: Path, out: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "faircast_ds.cli", "to-universal", str(tag_dir), str(out)],
                          capture_output=True, text=True, env=cpu_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def make_bad_copies(root: Path) -> None:
    src = root / "zero3-error_feedback"
    for name in ("corrupted", "truncated", "rank-missing"):
        shutil.copytree(src, root / name)
    f = root / "corrupted/step3/fair_cast/rank00001-of-00002.pt"  # silent bit rot in one residual value
    state = torch.load(f, weights_only=True)
    state["residual"][7] += 1e-3
    torch.save(state, f)
    f = root / "truncated/step3/fair_cast/rank00000-of-00002.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    (root / "rank-missing/step3/fair_cast/rank00001-of-00002.pt").unlink()


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {name: tmp_path_factory.mktemp(name) for name in ("straight", "crash", "resume", "ws3", "ws1")}
    deepspeed_launch(WORKER, 2, out["straight"], args=["straight", "--root", str(root)])
    make_bad_copies(root)
    crashed = deepspeed_launch(WORKER, 2, out["crash"], args=["crash", "--root", str(root)], check=False, timeout=300)
    deepspeed_launch(WORKER, 2, out["resume"], args=["resume", "--root", str(root)])
    run = root / "zero3-error_feedback"
    to_universal(run / "step3", run / "step3_universal")
    deepspeed_launch(WORKER, 3, out["ws3"], args=["elastic", "--root", str(root), "--load-tag", "step3_universal",
                                                  "--save-tag", "ws3_step5"])
    to_universal(run / "ws3_step5", run / "ws3_step5_universal")
    deepspeed_launch(WORKER, 1, out["ws1"], args=["elastic", "--root", str(root), "--load-tag", "ws3_step5_universal"])
    return {"root": root, "out": out, "crash_rc": crashed.returncode,
            "straight": torch.load(out["straight"] / "straight.pt"), "resume": torch.load(out["resume"] / "resume.pt"),
            "ws3": torch.load(out["ws3"] / "elastic_ws3.pt"), "ws1": torch.load(out["ws1"] / "elastic_ws1.pt"),
            "bad": json.loads((out["resume"] / "bad_state.json").read_text())}


@pytest.mark.parametrize("combo", COMBOS)
def test_resume_is_bitwise_identical_to_a_run_that_never_stopped(phases, combo):
    straight, resumed = phases["straight"][combo], phases["resume"][combo]
    for step in (3, 4, 5, 6):  # 3: right after the load, in new processes
        assert resumed[step]["step"] == straight[step]["step"] == step
        assert_bitwise(straight[step], resumed[step], f"{combo} step {step}")
    if combo.endswith("error_feedback"):  # the comparison covers a real residual, not zeros
        assert sum(int((r != 0).sum()) for r in straight[6]["residual"].values()) > 20_000


def test_crash_recovery_continues_exactly(phases):
    assert phases["crash_rc"] != 0, "the launcher must fail when a rank is killed"
    log = (phases["out"]["crash"] / "launch.log").read_text()
    assert "exits with return code = -9" in log
    assert (phases["root"] / "crash/latest").read_text().strip() == "global_step4"
    crash = phases["resume"]["crash"]
    assert crash["resumed_at"] == 4
    assert_bitwise(phases["straight"]["zero3/error_feedback"][6], crash[6], "crash-resumed step 6")


def test_elastic_resume_2_to_3_to_1_ranks(phases):
    saved_ws2 = phases["straight"]["zero3/error_feedback"][3]
    ws3, ws1 = phases["ws3"], phases["ws1"]
    assert ws3["loaded"]["step"] == 3
    assert_bitwise(saved_ws2, ws3["loaded"], "2 -> 3 ranks")  # residual re-sharded element by element
    assert ws3["continued_exact"], "after an elastic resume the cast must go on exactly"
    assert ws1["loaded"]["step"] == 5
    assert_bitwise(ws3["after"], ws1["loaded"], "3 -> 1 rank")
    assert ws1["continued_exact"]


@pytest.mark.parametrize("case, words", [
    ("missing", "no Fair Cast state in"),
    ("other_mode", "saved with fair_cast.mode='error_feedback', this run has 'stochastic'"),
    ("other_seed", "saved with fair_cast.seed=1234, this run has 99"),
    ("corrupted", "CRC mismatch for model.embed_tokens.weight"),
    ("truncated", "cannot read Fair Cast state file"),
    ("rank_file_missing", "a rank's file is missing"),
])
def test_bad_state_is_a_clear_error_on_every_rank(phases, case, words):
    got = phases["bad"][case]
    assert not got["ok"] and got["type"] == "FairCastStateError", got
    assert words in got["message"] and "on_missing_state" in got["message"]


def test_reset_policy_is_logged(phases):
    assert phases["bad"]["missing_reset"] == {"ok": True, "step": 1}
    log = (phases["out"]["resume"] / "launch.log").read_text()
    assert "on_missing_state=reset: residual starts at zero, noise step 1" in log


def test_zero_to_fp32_still_reads_our_checkpoints(phases):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for combo in ("zero3/stochastic", "zero2/error_feedback"):
        state = get_fp32_state_dict_from_zero_checkpoint(str(phases["root"] / combo.replace("/", "-")), tag="step3")
        masters = phases["straight"][combo][3]["master"]
        assert state.keys() == masters.keys()
        for name, value in state.items():
            assert torch.equal(value.reshape(-1), masters[name]), f"{combo}: {name}"
