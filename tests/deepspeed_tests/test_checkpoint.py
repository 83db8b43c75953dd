"""Durable state: bitwise resume for every stage and mode, module-only loads for every stage and mode,
elastic resume across world sizes for ZeRO-1/2/3, checkpoints converted without our state, crash
recovery after a real SIGKILL, a checkpoint saved after a failed (non-finite) cast, clear errors for
bad, incomplete or mixed checkpoints, and zero_to_fp32 still working."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import DIST, ROOT, assert_bitwise, cpu_env, deepspeed_launch

pytestmark = pytest.mark.slow
WORKER = DIST / "checkpoint_worker.py"
COMBOS = ["zero3/stochastic", "zero3/error_feedback", "zero3/dither", "zero3/nearest", "zero2/error_feedback",
          "zero1/error_feedback", "bf16_optimizer/error_feedback", "zero3+offload/error_feedback",
          "zero2+offload/stochastic"]
ELASTIC = ["zero3", "zero2", "zero1"]
NONFINITE = ["zero3/stochastic", "zero2/error_feedback"]


def convert(tag_dir: Path, out: Path, ours: bool = True) -> None:
    """``faircast-ds to-universal`` (ours) or DeepSpeed's own ds_to_universal, which drops fair_cast/."""
    cmd = ([sys.executable, "-m", "faircast_ds.tools.cli", "to-universal", str(tag_dir), str(out)] if ours else
           [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
            "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1"])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cpu_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def convert_all(jobs: list[tuple]) -> None:
    with ThreadPoolExecutor(2) as pool:  # each conversion is mostly interpreter start-up
        for done in [pool.submit(convert, *job) for job in jobs]:
            done.result()


def edit_state(path: Path, **fields) -> None:
    state = torch.load(path, weights_only=True)
    state.update(fields)
    torch.save(state, path)


def make_bad_copies(root: Path) -> None:
    src = root / "zero3-error_feedback"
    names = ("corrupted", "truncated", "rank-missing", "two-saves", "torn-zero-file", "zero-file-missing",
             "empty-latest")
    for name in names:
        shutil.copytree(src, root / name)
    f = root / "corrupted/step3/fair_cast/rank00001-of-00002.pt"  # silent bit rot in one residual value
    state = torch.load(f, weights_only=True)
    state["residual"][7] += 1e-3
    torch.save(state, f)
    f = root / "truncated/step3/fair_cast/rank00000-of-00002.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    (root / "rank-missing/step3/fair_cast/rank00001-of-00002.pt").unlink()
    for r in (0, 1):  # a newer save's Fair Cast state over the older save's DeepSpeed files
        edit_state(root / f"two-saves/step3/fair_cast/rank{r:05d}-of-00002.pt", step=5, engine_step=5)
    f = root / "torn-zero-file/step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"  # killed mid-write
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    (root / "zero-file-missing/step3/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    (root / "empty-latest/latest").write_text("")  # DeepSpeed's in-place write, killed after the truncation


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {name: tmp_path_factory.mktemp(name) for name in ("straight", "resume", "ws3", "ws1")}
    # one launch: the straight phase, then (same processes, once straight.pt is written) the crash phase, whose
    # rank 1 SIGKILLs itself: the launch fails by design, so the straight phase's success is its straight.pt
    crashed = deepspeed_launch(WORKER, 2, out["straight"], args=["straight", "--root", str(root), "--then-crash"],
                               check=False, timeout=900)
    out["crash"] = out["straight"]
    assert (out["straight"] / "straight.pt").exists(), (out["straight"] / "launch.log").read_text()[-6000:]
    make_bad_copies(root)
    # the resume launch reads only the step-3 tags (and the crash run, the bad copies); the elastic chain
    # writes only other tags (the conversions' output folders, ws3_step5): the two run side by side
    with ThreadPoolExecutor(1) as pool:
        resumed = pool.submit(deepspeed_launch, WORKER, 2, out["resume"], args=["resume", "--root", str(root)],
                              STRAIGHT_DIR=str(out["straight"]))
        convert_all([(root / f"{stage}-error_feedback/step3", root / f"{stage}-error_feedback/step3_universal")
                     for stage in ELASTIC]
                    + [(root / f"zero3-{mode}/step3", root / f"zero3-{mode}/step3_ds_universal", False)
                       for mode in ("stochastic", "error_feedback")])
        deepspeed_launch(WORKER, 3, out["ws3"], args=["elastic", "--root", str(root), "--load-tag", "step3_universal",
                                                      "--save-tag", "ws3_step5"])
        convert_all([(root / f"{stage}-error_feedback/ws3_step5", root / f"{stage}-error_feedback/ws3_step5_universal")
                     for stage in ELASTIC])
        deepspeed_launch(WORKER, 1, out["ws1"], args=["elastic", "--root", str(root), "--load-tag",
                                                      "ws3_step5_universal"])
        resumed.result()
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
    # one cast per flat group in a load (the restore's at the saved step; ZeRO-3's load site leaves its
    # round-to-nearest refresh for it), none where error feedback's restore writes the saved bits
    load = resumed["load_casts"]
    assert load["casts"] == (0 if combo.endswith("error_feedback") else load["groups"]), load
    # ZeRO-1/2: the load's recast (error feedback: its restore of the saved bits) changed nothing
    # (DeepSpeed's load already holds the saved served bits on every rank), so its all-gather was skipped
    if combo.split("/")[0].startswith(("zero1", "zero2")):
        assert load["skipped_gathers"] == 1, load


@pytest.mark.parametrize("combo", ["zero2+offload/stochastic", "zero2/error_feedback"])
def test_a_zero2_load_whose_recast_changes_a_bit_gathers(phases, combo):
    """The module file changed on disk in one element of the last rank's partition: the recast on its
    owner (error feedback: the restore of the saved served bits) writes the served bit back, the count is
    not zero, the load all-gathers, and rank 0's full copy holds the straight run's bits (a skipped gather
    would leave the changed element there)."""
    got = phases["resume"]["tampered" if combo.endswith("stochastic") else "tampered_error_feedback"]
    want = phases["straight"][combo][3]["served"]
    assert got["served"].keys() == want.keys()
    assert [n for n in want if not torch.equal(got["served"][n], want[n])] == []
    assert got["skipped_gathers"] == 0


@pytest.mark.parametrize("kind", ["no_optimizer_states", "module_only"])
@pytest.mark.parametrize("combo", COMBOS)
def test_module_only_load_serves_the_saved_bits(phases, combo, kind):
    """load_checkpoint(load_optimizer_states=False) and (load_module_only=True): the model serves exactly
    what it served at save time (DeepSpeed rebuilds the masters from it), the residual starts at zero, the
    noise step is the saved one, and the next step is the exact cast of the next master."""
    got = phases["resume"]["module_only"][f"{combo}/{kind}"]
    assert got["differ"] == 0, f"{combo} {kind}: {got['differ']} of {got['numel']} served elements differ"
    assert got["masters_are_served"] and got["residual_zero"] and got["step"] == 3, got
    assert got["continued_exact"], got


def test_module_only_load_of_a_tag_latest_does_not_name(phases):
    """zero3/stochastic's `latest` names step5; its step3 loaded module-only serves step 3's bits (DeepSpeed
    alone reads the masters of the tag `latest` names)."""
    assert (phases["root"] / "zero3-stochastic/latest").read_text().strip() == "step5"
    assert phases["resume"]["module_only"]["zero3/stochastic/no_optimizer_states"]["differ"] == 0
    log = (phases["out"]["resume"] / "launch.log").read_text()
    assert "ZeRO-3 module load: the model gets the bits the checkpoint served (mode=stochastic, step 3)" in log
    assert "ZeRO-3 load_module_only: the weights come from the fp32 masters" in log


def test_crash_recovery_continues_exactly(phases):
    assert phases["crash_rc"] != 0, "the launcher must fail when a rank is killed"
    # rank 1 recorded its kill just before its SIGKILL, and the launcher (tests/conftest.py supervise, which logs
    # every rank's exit) saw it die by signal 9; the launch's own code may be rank 0's 1 if its failed
    # collective ended it first
    log = (phases["out"]["crash"] / "launch.log").read_text()
    killed = phases["out"]["crash"] / "killed.json"
    assert killed.exists(), log[-4000:]
    assert json.loads(killed.read_text()) == {"step": 5, "rank": 1}
    assert re.search(r"rank 1 \(pid \d+\) exits with return code = -9", log), log[-4000:]
    assert (phases["root"] / "crash/latest").read_text().strip() == "global_step4"
    crash = phases["resume"]["crash"]
    assert crash["resumed_at"] == 4
    assert_bitwise(phases["straight"]["zero3/error_feedback"][6], crash[6], "crash-resumed step 6")


@pytest.mark.parametrize("stage", ELASTIC)
def test_elastic_resume_2_to_3_to_1_ranks(phases, stage):
    saved_ws2 = phases["straight"][f"{stage}/error_feedback"][3]
    ws3, ws1 = phases["ws3"][stage], phases["ws1"][stage]
    assert ws3["loaded"]["step"] == 3
    assert_bitwise(saved_ws2, ws3["loaded"], f"{stage}: 2 -> 3 ranks")  # residual re-sharded element by element
    assert ws3["continued_exact"], "after an elastic resume the cast must go on exactly"
    assert ws1["loaded"]["step"] == 5
    assert_bitwise(ws3["after"], ws1["loaded"], f"{stage}: 3 -> 1 rank")
    assert ws1["continued_exact"]


def test_checkpoint_converted_without_our_state(phases):
    """DeepSpeed's own ds_to_universal drops fair_cast/: stochastic's whole state is (mode, seed, step), so it
    is recovered from the config and the engine's step, bit for bit; error_feedback's residual is lost, and
    the error names the conversion that keeps it."""
    assert not (phases["root"] / "zero3-stochastic/step3_ds_universal/fair_cast").exists()
    got = phases["ws3"]["ds_universal_stochastic"]
    assert got["step"] == 3
    assert_bitwise(phases["straight"]["zero3/stochastic"][3], got, "ds_to_universal, stochastic, 2 -> 3 ranks")
    log = (phases["out"]["ws3"] / "launch.log").read_text()
    assert "mode=stochastic keeps nothing beyond (mode, seed, step)" in log and "noise step 3 from the engine" in log
    ef = phases["ws3"]["ds_universal_error_feedback"]
    assert not ef["ok"] and ef["type"] == "FairCastStateError", ef
    assert "faircast-ds to-universal <tag folder> <output folder>" in ef["message"]
    assert "on_missing_state" in ef["message"]


@pytest.mark.parametrize("combo", NONFINITE)
def test_checkpoint_after_a_nonfinite_cast_holds_one_step(phases, combo):
    """A NaN master under on_nonfinite=error: every rank raises naming its parameter and element; the cast
    of that step is finished (the flat shards the step did not reach are cast before the save), so the
    served copy is step 3's cast throughout, and the checkpoint saved from the exception handler restores
    exactly that."""
    live = phases["straight"]["nonfinite"][combo]
    name, element = live["poisoned"][0]
    assert live["raised"] == "NonFiniteWeightError"
    assert f"parameter {name!r} element {element} would be served as nan" in live["message"]
    assert "at step 3" in live["message"]
    assert all(m is not None and "would be served as nan" in m for m in live["messages"]), live["messages"]
    assert live["flat_shards"] > 1 and live["flat_shards"] == live["cast_after_save"]
    if combo.startswith("zero3"):  # raised at the failing sub-group: the save casts the ones the step did not reach
        assert live["cast_by_failed_step"] < live["flat_shards"]
    else:  # ZeRO-1/2 cast in the place of DeepSpeed's copy of each group inside step(), which goes on to step
        # every group: the error is raised once every group is cast, before the all-gather
        assert live["cast_by_failed_step"] == live["flat_shards"]
    assert live["replay_one_step"], "the served copy mixes two steps"
    assert live["caster_step"] == 3 and live["global_steps"] == 2
    restored = phases["resume"]["nonfinite"][combo]
    assert restored["step"] == 3
    assert_bitwise(live["snapshot"], restored, f"{combo}: checkpoint saved after the failed cast")
    log = (phases["out"]["resume"] / "launch.log").read_text()
    assert "the restored served copy holds non-finite weights" in log


@pytest.mark.parametrize("case, error, words", [
    ("missing", "FairCastStateError", "no Fair Cast state in"),
    ("missing_module_only", "FairCastStateError", "`faircast-ds to-universal <tag folder> <output folder>`"),
    ("other_mode", "FairCastStateError", "saved with fair_cast.mode='error_feedback', this run has 'stochastic'"),
    ("other_seed", "FairCastStateError", "saved with fair_cast.seed=1234, this run has 99"),
    ("corrupted", "FairCastStateError", "CRC mismatch for model.embed_tokens.weight"),
    ("truncated", "FairCastStateError", "cannot read Fair Cast state file"),
    ("rank_file_missing", "FairCastStateError", "a rank's file is missing"),
    ("two_saves", "FairCastStateError", "saved at engine step 5 but the checkpoint's own files are from step 3"),
    ("torn_zero_file", "IncompleteCheckpointError", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt is truncated"),
    ("zero_file_missing", "IncompleteCheckpointError", "no *zero_pp_rank_0_mp_rank_*_optim_states.pt"),
    ("empty_latest", "IncompleteCheckpointError", "latest is empty (a save was killed while writing it)"),
])
def test_bad_state_is_a_clear_error_on_every_rank(phases, case, error, words):
    got = phases["bad"][case]
    assert not got["ok"] and got["type"] == error, got
    assert words in got["message"], got["message"]
    if error == "FairCastStateError":
        assert "on_missing_state" in got["message"]


def test_reset_policy_is_logged_and_stochastic_recovers_without_state(phases):
    assert phases["bad"]["missing_reset"] == {"ok": True, "step": 1}
    assert phases["bad"]["missing_recovered"] == {"ok": True, "step": 1}
    assert phases["bad"]["missing_module_only_recovered"] == {"ok": True, "step": 1}  # ZeRO-3, from the masters
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
