"""Every supported optimizer class (ZeRO-3, ZeRO-2, ZeRO-1, BF16_Optimizer; with and without CPU
offload) with real DeepSpeed on 1-3 CPU ranks over gloo: the served copy is the configured cast of
the fp32 master, bitwise identical for any stage and world size, built without materializing fp32
beyond the rank's shard."""
from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import DIST, deepspeed_launch

pytestmark = pytest.mark.slow

TRAINING = ["zero3/nearest", "zero3/stochastic", "zero3/dither", "zero3/error_feedback", "zero2/stochastic",
            "zero2/error_feedback", "zero1/stochastic", "zero1/error_feedback", "bf16_optimizer/stochastic",
            "bf16_optimizer/error_feedback"]
CLASSES = {"zero3": ("DeepSpeedZeroOptimizer_Stage3", 3), "zero2": ("DeepSpeedZeroOptimizer", 2),
           "zero1": ("DeepSpeedZeroOptimizer", 1), "bf16_optimizer": ("BF16_Optimizer", 1)}
TOTAL = 25088  # parameters of the tiny Qwen3


@pytest.fixture(scope="session")
def stage_runs(tmp_path_factory):
    """One worker launch per world size (1, 2, 3), shared by every test in this file. The 1-rank launch
    leaves a core idle: it runs beside the 2-rank one, then the 3-rank one."""
    runs = {world: tmp_path_factory.mktemp(f"stages_ws{world}") for world in (1, 2, 3)}
    with ThreadPoolExecutor(1) as pool:
        alone = pool.submit(deepspeed_launch, DIST / "stages_worker.py", 1, runs[1])
        for world in (2, 3):
            deepspeed_launch(DIST / "stages_worker.py", world, runs[world])
        alone.result()
    return runs


def reports(runs, world):
    return [json.loads((runs[world] / f"stages_ws{world}_rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", (1, 2, 3))
@pytest.mark.parametrize("run", TRAINING)
def test_served_is_the_configured_cast_of_the_master(stage_runs, world, run):
    for rank_report in reports(stage_runs, world):
        r = rank_report["training"][run]
        assert r["hooked"], "the interpreter-start hook did not wrap DeepSpeedEngine.__init__"
        assert r["attached"], "an unmodified script did not get Fair Cast from its config"
        assert (r["optimizer"], r["zero_stage"]) == CLASSES[run.split("/")[0]]
        assert [s["step"] for s in r["steps"]] == [1, 2, 3, 4]
        for s in r["steps"]:
            assert s["exact_replay"], f"rank shard differs from cast(master) at step {s['step']}"
            assert s["neighbour"], "a served weight is not a bf16 neighbour of its master"
            assert s["shard_matches_gathered"], "the all-gathered parameter differs from the cast shard"
            assert s["ranks_agree"], "ranks hold different served models"
            assert s["stats_changed"] == s["observed_changed"]
            assert s["numel"] == TOTAL


@pytest.mark.parametrize("world", (1, 2, 3))
def test_changed_fraction_is_what_each_mode_predicts(stage_runs, world):
    runs = reports(stage_runs, world)[0]["training"]
    for s in runs["zero3/stochastic"]["steps"]:  # independent Bernoulli changes: 5 sigma
        sigma = math.sqrt(s["var_changed"])
        assert abs(s["observed_changed"] - s["expected_changed"]) <= 5 * sigma + 1, s
    # stochastic redraws every element between two bf16 values; the others change far less
    mean = {m: sum(s["observed_changed"] for s in runs[f"zero3/{m}"]["steps"]) / 4 / TOTAL
            for m in ("nearest", "stochastic", "dither")}
    assert mean["stochastic"] > 1.5 * mean["nearest"], mean
    assert mean["dither"] < mean["stochastic"], mean


def test_same_bits_for_every_stage_offload_and_world_size(stage_runs):
    bits = {w: torch.load(stage_runs[w] / f"invariance_ws{w}.pt") for w in (1, 2, 3)}
    reference = {mode: bits[1][f"zero3/{mode}"] for mode in ("stochastic", "error_feedback", "nearest", "dither")}
    compared = 0
    for world in (1, 2, 3):
        for run, served in bits[world].items():
            ref = reference[run.split("/")[1]]
            for step in (0, 1):
                assert ref[step].keys() == served[step].keys()
                for name in ref[step]:
                    assert torch.equal(ref[step][name], served[step][name]), f"{run} ws {world} step {step + 1}: {name}"
                    compared += 1
    assert compared == 3 * 16 * 2 * 25
    # the comparison is not vacuous: modes and steps really serve different bits from the same masters
    assert not torch.equal(reference["stochastic"][0]["lm_head.weight"], reference["nearest"][0]["lm_head.weight"])
    assert not torch.equal(reference["stochastic"][0]["lm_head.weight"], reference["stochastic"][1]["lm_head.weight"])


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("run", ("zero3/stochastic", "zero3/error_feedback", "zero2/stochastic", "zero2/error_feedback"))
def test_no_full_fp32_model_and_nothing_fp32_gathered(stage_runs, world, run):
    for rank_report in reports(stage_runs, world):
        a = rank_report["allocation"][run]
        assert 0 < a["cast_max_numel"] <= a["largest_local_slice"], a
        assert a["local_shard"] < TOTAL
        if run.startswith("zero3"):  # ZeRO-3 slices are per parameter: a full parameter would be caught
            assert a["largest_param"] > a["largest_local_slice"]
        residual = a["local_shard_padded"] if run.endswith("error_feedback") else 0
        assert a["residual_numel"] == residual  # the residual is state: one fp32 per local shard element
        assert a["cast_collectives"] == [], "the cast must not communicate"
        assert a["n_gathers"] > 0 and all(g.endswith(":torch.bfloat16") for g in a["gathers"]), a["gathers"]


@pytest.mark.parametrize("world", (1, 2, 3))
def test_engine_methods_are_wrapped_once_with_the_documented_hooks(stage_runs, world):
    """On a real engine of every stage: step, save, load and module-load are each one dispatcher over
    DeepSpeed's own method, running the hooks faircast_ds/deepspeed/engine_hooks.py lists, in that order."""
    expected = ["engine.step: before guard", "engine.step: after guard",
                "engine.save_checkpoint: around checkpoint state", "engine.load_checkpoint: before guard",
                "engine.load_checkpoint: around checkpoint state", "engine.load_checkpoint: after guard",
                "engine.load_module_state_dict: around checkpoint state"]
    for rank_report in reports(stage_runs, world):
        for run, r in rank_report["training"].items():
            if not r["attached"]:
                continue
            assert all(r["wrapped_once"].values()), (run, r["wrapped_once"])
            owners = [":".join(line.split(":")[:2]) for line in r["hooks"]]
            diagnostics = ["engine.step: after diagnostics"] if "engine.step: after diagnostics" in owners else []
            assert owners == expected[:1] + diagnostics + expected[1:], (run, owners)
