"""Fair Cast inside the frameworks users run (docs/integrations.md).

In-process: where the section comes from (``FAIRCAST_DS_CONFIG`` as JSON or a path, both-and-differ),
and PEFT LoRA merges through the cast (real PEFT on the tiny Qwen3).

Launched, against the real libraries (``launch/setup.d/30-frameworks.sh`` installs them); TRL's,
Accelerate's (and, in test_activation.py, the HF Trainer's) served bits and forward weights are checked
bit for bit against the slow reference's cast of DeepSpeed's own fp32 masters (tests/served_oracle.py):
- TRL's GRPOTrainer, ZeRO-3, beta > 0 (a reference engine without optimizer), FairCastCallback;
- a script building its config with OpenRLHF's own get_train_ds_config, FAIRCAST_DS_CONFIG set by
  the launcher, 2 ranks: the same served bits as the JSON route;
- `accelerate launch` with deepspeed_config_file, 2 ranks.
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import DIST, ROOT, cpu_env, deepspeed_launch, free_port, run_logged
from served_oracle import check_forward, check_snapshot, expected_bits, rn_fraction

from faircast_ds.config import origin as config_origin
from faircast_ds.config.section import FairCastConfig, FairCastConfigError

ENV = config_origin.ENV


# -- FAIRCAST_DS_CONFIG ---------------------------------------------------------------------------

def test_env_section_inline_json_and_path(tmp_path):
    inline = config_origin.resolve({}, {ENV: '{"mode": "dither", "seed": 9}'})
    assert (inline.config.mode, inline.config.seed, inline.origin) == ("dither", 9, ENV)
    section = tmp_path / "fc.json"
    section.write_text('{"mode": "error_feedback"}')
    from_file = config_origin.resolve(None, {ENV: str(section)})
    assert from_file.config.mode == "error_feedback" and from_file.origin == f"{ENV}:{section}"
    whole = tmp_path / "ds.json"  # a whole DeepSpeed config: its fair_cast key is the section
    whole.write_text(json.dumps({"bf16": {"enabled": True}, "fair_cast": {"mode": "nearest", "seed": 2}}))
    assert config_origin.resolve({"bf16": {}}, {ENV: str(whole)}).config.mode == "nearest"
    assert config_origin.resolve({"bf16": {}}, {}) is None  # neither: Fair Cast stays off
    own = config_origin.resolve({"fair_cast": {"seed": 3}}, {})
    assert own.origin == "config" and own.config.seed == 3


@pytest.mark.parametrize("value, words", [
    ("", ["FAIRCAST_DS_CONFIG is set but empty"]),
    ("/nonexistent/fc.json", ["FAIRCAST_DS_CONFIG=/nonexistent/fc.json: no such file"]),
    ('{"mode": "stochastic"', ["FAIRCAST_DS_CONFIG (inline JSON): not valid JSON"]),
    ("{mode: stochastic}", ["not valid JSON", "double quotes are gone", "path"]),
    ('{"moed": "stochastic"}', ["FAIRCAST_DS_CONFIG (inline JSON): invalid fair_cast config",
                                "fair_cast.moed: unknown key (did you mean 'mode'?)"]),
    ('["stochastic"]', ["FAIRCAST_DS_CONFIG (inline JSON)", "fair_cast: expected an object"]),
])
def test_env_errors_name_the_variable(value, words):
    with pytest.raises(FairCastConfigError) as err:
        config_origin.resolve({"bf16": {"enabled": True}}, {ENV: value})
    for word in words:
        assert word in str(err.value), str(err.value)


def test_env_error_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"seed": "12"}')
    with pytest.raises(FairCastConfigError) as err:
        config_origin.resolve(None, {ENV: str(path)})
    assert f"FAIRCAST_DS_CONFIG={path}" in str(err.value) and "fair_cast.seed: str '12'" in str(err.value)


def test_both_sections_must_agree():
    same = config_origin.resolve({"fair_cast": {}}, {ENV: '{"enabled": true, "mode": "dither"}'})
    assert same.origin == f"config+{ENV}"  # compared after validation: {} is the defaults
    with pytest.raises(FairCastConfigError) as err:
        config_origin.resolve({"fair_cast": {"mode": "dither", "seed": 1}}, {ENV: '{"mode": "nearest", "seed": 1}'})
    message = str(err.value)
    assert 'the DeepSpeed config has {"mode": "dither", "seed": 1}' in message
    assert 'FAIRCAST_DS_CONFIG (inline JSON) has {"mode": "nearest", "seed": 1}' in message
    assert 'fair_cast.mode: "dither" vs "nearest"' in message and "fair_cast.seed" not in message


# -- LoRA merges through the cast (real PEFT) -------------------------------------------------------

def _lora_model(b_std: float):
    from peft import LoraConfig, get_peft_model

    from faircast_bench.builders import tiny_qwen3

    model = get_peft_model(tiny_qwen3(std=0.02), LoraConfig(r=4, lora_alpha=4, lora_dropout=0.0,
                                                            target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, b_std)  # an update far below half a bf16 spacing of the base weights
    return model


@torch.no_grad()
def _delta(layer):
    return (layer.lora_B["default"].weight.float() @ layer.lora_A["default"].weight.float()) * layer.scaling["default"]


def test_find_handle_reaches_the_handle_through_the_trainers_optimizer_wrappers():
    """What FairCastCallback is given: the model (the handle is on it) or only the optimizer, as the
    Trainer holds it (Accelerate's wrapper around DeepSpeed's ZeRO optimizer); every route keeps the
    handle on the optimizers it serves."""
    from types import SimpleNamespace

    from stand_ins import TwoGroups

    from faircast_ds.shard.caster import ShardCaster
    from faircast_ds.shard.handle import build
    from faircast_ds.shard.routes import DEEPSPEED_RUNTIME, ROUTES  # the route a Trainer's DeepSpeed engine takes
    from faircast_ds.transformers import find_handle

    class Optimizer:  # weakly referencable and holds attributes, as DeepSpeed's optimizer does
        pass

    config = FairCastConfig(mode="stochastic", seed=1, diagnostics={"every": 0})
    adapter = TwoGroups(ShardCaster(config))
    adapter.optimizer = Optimizer()
    engine = SimpleNamespace()
    handle = build(config, [adapter], route=DEEPSPEED_RUNTIME, owner=engine, connect=lambda a: None)
    try:
        wrapped = SimpleNamespace(optimizer=SimpleNamespace(optimizer=adapter.optimizer))
        assert find_handle(None, wrapped) is handle
        assert find_handle(SimpleNamespace(module=engine), None) is handle
        assert find_handle(SimpleNamespace(), SimpleNamespace(optimizer=None)) is None
    finally:
        ROUTES.remove(adapter.optimizer)


def test_lora_merge_round_to_nearest_loses_small_updates_fair_cast_keeps_them():
    from faircast_ds.casting.bits import bf16_spacing
    from faircast_ds.transformers import install_lora_merge, lora_layers

    model = _lora_model(4e-6)
    layers = lora_layers(model)
    base = {n: l.get_base_layer().weight.detach().clone() for n, l in layers}
    deltas = {n: _delta(l) for n, l in layers}
    assert max(float((deltas[n].abs() / bf16_spacing(base[n])).mean()) for n in base) < 0.2
    model.merge_adapter()  # PEFT's own merge: W += delta in bf16, round-to-nearest
    rn = {n: l.get_base_layer().weight.detach().clone() for n, l in layers}
    model.unmerge_adapter()
    rn_kept = sum(float(((rn[n].float() - base[n].float()) * deltas[n]).sum()) for n in base)
    energy = sum(float((deltas[n] ** 2).sum()) for n in base)
    assert abs(rn_kept / energy) < 0.2, rn_kept / energy  # the update is (almost) all lost
    base = {n: l.get_base_layer().weight.detach().clone() for n, l in layers}  # PEFT's unmerge rounded too

    step = {"n": 0}
    assert install_lora_merge(model, {"mode": "stochastic", "seed": 4}, step=lambda: step["n"]) == len(layers)
    total = {n: torch.zeros_like(base[n], dtype=torch.float32) for n in base}
    draws = 48
    for k in range(draws):
        step["n"] = k + 1  # one optimizer step between weight syncs: fresh noise
        model.merge_adapter()
        for n, l in layers:
            total[n] += l.get_base_layer().weight.float() - base[n].float()
        model.unmerge_adapter()
        for n, l in layers:  # unmerge gives the base weights back bit for bit
            assert torch.equal(l.get_base_layer().weight.view(torch.int16), base[n].view(torch.int16)), n
    kept = sum(float(((total[n] / draws) * deltas[n]).sum()) for n in base)
    assert 0.85 < kept / energy < 1.15, kept / energy  # unbiased: the mean merged update is the update


def test_lora_merge_refuses_what_it_cannot_cast():
    from peft import LoraConfig, get_peft_model

    from faircast_bench.builders import tiny_qwen3
    from faircast_ds.shard.adapter import UnsupportedSetupError
    from faircast_ds.transformers import install_lora_merge

    with pytest.raises(UnsupportedSetupError, match="error_feedback carries a residual"):
        install_lora_merge(_lora_model(1e-5), {"mode": "error_feedback"})
    dora = get_peft_model(tiny_qwen3(), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    install_lora_merge(dora, {"mode": "stochastic"})
    with pytest.raises(UnsupportedSetupError, match="DoRA or another variant"):
        dora.merge_adapter()
    with pytest.raises(UnsupportedSetupError, match="no PEFT lora.Linear"):
        install_lora_merge(tiny_qwen3(), {"mode": "stochastic"})


# -- the real clients --------------------------------------------------------------------------------

def _served_is_the_cast(record: dict, steps: int) -> dict[int, dict[str, torch.Tensor]]:
    """TRL's runs (mode stochastic, seed 11): after each optimizer step, as the Trainer numbered it,
    every trainable element is the oracle's cast of its fp32 master and every frozen one is served as
    loaded. Returns the expected served bits by step (step 0: as loaded)."""
    assert [s["step"] for s in record["snapshots"]] == list(range(1, steps + 1))
    expected = {0: record["initial"]}
    for snap in record["snapshots"]:
        expected[snap["step"]] = check_snapshot(snap, "stochastic", seed=11, frozen=record["initial"])
    assert rn_fraction(record["snapshots"][-1]) > 0.05  # the oracle's cast is not round-to-nearest here
    return expected


@pytest.mark.slow
def test_trl_grpo_zero3_with_reference_engine(tmp_path):
    """TRL GRPOTrainer, ZeRO-3, beta=0.04, 3 steps, one CPU rank (two ranks, with Accelerate told its
    backend: tests/transformers_tests/test_trl_colocate.py). Bits, not "differs from RN": after each step every served
    element is the oracle's cast of DeepSpeed's fp32 master (tests/served_oracle.py), TRL's generation
    and the loss's forward multiplied by the bits served before the step, and the reference engine
    serves and multiplies by the loaded weights throughout."""
    out = tmp_path / "trl"
    deepspeed_launch(DIST / "trl_grpo_script.py", 1, out, timeout=900)
    log = (out / "launch.log").read_text()
    result = json.loads((out / "trl_grpo.json").read_text())
    assert result["global_step"] == 3 and result["caster_step"] == 3 and result["kl_logged"]
    # the reference engine: no optimizer, left as built, one line, no error
    assert (result["ref_engine"], result["ref_optimizer"], result["ref_attached"]) == \
        ("DeepSpeedEngine", "DeepSpeedZeRoOffload", False)
    assert log.count("[fair_cast] not attached to this engine: it has no training optimizer (DeepSpeedZeRoOffload") == 1
    assert "[fair_cast] active: mode=stochastic zero_stage=3 seed=11" in log and "origin=config" in log
    record = torch.load(out / "trl_grpo.pt", weights_only=False)
    expected = _served_is_the_cast(record, steps=3)
    # TRL's generation and the loss's forward of steps 1-3 multiplied by the bits served before them
    # (the loss's forward reads lm_head.weight directly in TRL's fused LM head, not through lm_head's
    # forward: 2 x 7 Linear there, and lm_head too in generation)
    check_forward(record["tap"], expected, {"generate": 15, "train": 14}, steps=[0, 1, 2])
    # the reference engine stays as loaded: served before and after training, and in its forward
    initial = record["initial"]
    for when in ("ref_before", "ref_after"):
        assert record[when].keys() == initial.keys()
        assert all(torch.equal(record[when][n], initial[n]) for n in initial), when
    check_forward(record["ref_tap"], {k: initial for k in range(4)}, {"no_grad": 14}, steps=[0, 1, 2])
    # FairCastCallback: the figures are in the Trainer's log history, every step, and a callback
    # registered before it (as W&B's and TensorBoard's are) was shown them
    steps = [h for h in result["history"] if "fair_cast/changed_fraction" in h]
    assert [h["step"] for h in steps][:3] == [1, 2, 3]
    for h in steps:
        assert 0 < h["fair_cast/changed_fraction"] <= 1 and 0 < h["fair_cast/gap_spacings"] < 1
        assert h["fair_cast/lag_steps"] >= 0
    assert [s["fair_cast/changed_fraction"] for s in result["reporter_saw"] if s] == \
        [h["fair_cast/changed_fraction"] for h in steps]


@pytest.mark.slow
def test_trl_grpo_lora_casts_the_trainable_part_and_merges_through_the_cast(tmp_path):
    """TRL GRPOTrainer with a PEFT LoRA config under ZeRO-3 (TRL then needs no reference engine: it
    disables the adapter), FairCastCallback(lora_merge=True), then TRL's weight-sync sequence for a
    PEFT model (gather all, merge_adapter, read, unmerge_adapter)."""
    out = tmp_path / "trl_lora"
    deepspeed_launch(DIST / "trl_grpo_script.py", 1, out, timeout=900, FAIR_CAST_LORA="1")
    log = (out / "launch.log").read_text()
    result = json.loads((out / "trl_grpo_lora.json").read_text())
    assert result["attached"] and result["global_step"] == result["caster_step"] == 3 and result["ref_model"]
    assert result["local_numel"] == result["trainable"] == 896  # the LoRA A and B matrices, nothing frozen
    assert ("[fair_cast] frozen parameters: 896 of 25,984 elements (3.45%) are trainable and under Fair Cast; "
            "25,088 elements in 25 frozen tensors are served as loaded") in log
    assert "[fair_cast] LoRA merges of 4 layers cast with mode=stochastic" in log
    layers = result["layers"]
    assert len(layers) == 4 and all(layer["restored"] for layer in layers.values())
    # merged through the cast: not round-to-nearest of W + B A s (PEFT's own merge rounds to nearest, up to a double rounding)
    assert sum(layer["vs_rn"] for layer in layers.values()) > 0.05 * sum(layer["numel"] for layer in layers.values())
    assert result["history_has_figures"]
    record = torch.load(out / "trl_grpo_lora.pt", weights_only=False)
    frozen = {n for n, m in record["snapshots"][0]["master"].items() if m is None}
    assert len(frozen) == 25 and all(".lora_" not in n for n in frozen)
    expected = _served_is_the_cast(record, steps=3)  # the adapters cast, the frozen base served as loaded
    # 15 base Linear + 4 x (lora_A, lora_B): generation and the loss's forward run the adapters (the
    # loss's forward reads lm_head.weight directly: one fewer there)
    check_forward(record["tap"], expected, {"generate": 23, "train": 22}, steps=[0, 1, 2])
    # each merge is the oracle's cast of W + B A s, noise keyed by the layer's name and the Trainer's step
    assert record["merge_step"] == 3 and len(record["merges"]) == 4
    for layer, merge in record["merges"].items():
        want = expected_bits(merge["target"], "stochastic", seed=11, step=3, name=f"{layer}.base_layer.weight@lora_merge")
        assert torch.equal(merge["merged"], want), f"{layer}: {int((merge['merged'] != want).sum())} merged bits differ"


@pytest.mark.slow
def test_openrlhf_config_builder_with_env_section_matches_json_route(tmp_path):
    out = tmp_path / "openrlhf"
    section = tmp_path / "fair_cast.json"
    section.write_text('{"enabled": true, "mode": "stochastic", "seed": 5}')
    deepspeed_launch(DIST / "openrlhf_style_script.py", 2, out, FAIRCAST_DS_CONFIG=str(section))
    log = (out / "launch.log").read_text()
    result = json.loads((out / "openrlhf_style.json").read_text())
    assert result["builder"].endswith("openrlhf/utils/deepspeed/deepspeed_utils.py")  # OpenRLHF's own builder
    assert result["world"] == 2 and not result["config_has_section"]
    assert result["origin"] == f"FAIRCAST_DS_CONFIG:{section}" and result["json_origin"] == "config"
    assert f"route=deepspeed-runtime origin=FAIRCAST_DS_CONFIG:{section}" in log
    assert result["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    assert (result["ref_optimizer"], result["ref_attached"]) == ("DeepSpeedZeRoOffload", False)
    assert result["params"] == 25 and result["bits_differ"] == []  # env route == JSON route, bit for bit
    # the env route's served bits, bit for bit: the oracle's cast of DeepSpeed's fp32 masters at DeepSpeed's step 3
    snap = torch.load(out / "openrlhf_style.pt", weights_only=False)
    assert snap["step"] == 3
    check_snapshot(snap, "stochastic", seed=5)
    assert rn_fraction(snap) > 0.05
    assert "rank 0: " in result["disagreement"] and "rank 1: no fair_cast section" in result["disagreement"]
    # a rank without Fair Cast at all: named after the (shortened) wait, not a hang until the job's timeout
    # (the launch's timeout is the liveness limit; the seconds the script records are not asserted)
    assert "ranks [1] of this engine never reached Fair Cast's attach" in result["missing_rank"], result["missing_rank"]
    assert "Fair Cast is not loaded there" in result["missing_rank"]
    assert result["disabled"] == {"ok": True, "attached": False}, result["disabled"]


@pytest.mark.slow
def test_accelerate_launch_with_deepspeed_config_file(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 40}, "steps_per_print": 10**9,
        "fair_cast": {"enabled": True, "mode": "stochastic", "seed": 21}}))
    acc = tmp_path / "accelerate.yaml"
    acc.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
                   f"  deepspeed_config_file: {ds}\n  zero3_init_flag: false\nnum_machines: 1\nnum_processes: 2\n"
                   "machine_rank: 0\nuse_cpu: false\n")
    out = tmp_path / "acc"
    out.mkdir()
    run_logged(["accelerate", "launch", "--config_file", str(acc), "--main_process_port", str(free_port()),
                str(DIST / "accelerate_script.py")], out / "launch.log", env=cpu_env(OUT_DIR=str(out)), timeout=600,
               cwd=ROOT)
    result = json.loads((out / "accelerate.json").read_text())
    assert (result["world"], result["origin"], result["step"]) == (2, "config", 3)
    assert "[fair_cast] active: mode=stochastic zero_stage=3 seed=21 local_shard_elements=12544" in \
        (out / "launch.log").read_text()
    # bit for bit: after each of the loop's 3 steps every element is the oracle's cast of its master,
    # and each rank's forward at step k multiplied by the bits served after k steps
    record = torch.load(out / "accelerate.pt", weights_only=False)
    expected = {0: record["initial"]}
    for snap in record["snapshots"]:
        expected[snap["step"]] = check_snapshot(snap, "stochastic", seed=21)
    assert sorted(expected) == [0, 1, 2, 3] and rn_fraction(record["snapshots"][-1]) > 0.05
    assert len(record["taps"]) == 2
    for tap in record["taps"]:
        check_forward(tap, expected, {"train": 15}, steps=[0, 1, 2])  # 2 x 7 Linear + lm_head
