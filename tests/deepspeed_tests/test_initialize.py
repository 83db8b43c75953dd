"""What initialize does with each config: bad values and unsupported DeepSpeed setups fail, naming the
problem; align_rounding in the JSON is applied to the engine's module."""
from __future__ import annotations

import json

import pytest
from conftest import DIST, deepspeed_launch

pytestmark = pytest.mark.slow

EXPECTED = {
    "zero_stage_0": ("UnsupportedSetupError", "ZeRO stage 0"),
    "fp16": ("UnsupportedSetupError", "fp16.enabled"),
    "no_bf16": ("UnsupportedSetupError", "bf16 is not enabled"),
    "nvme_param_offload": ("UnsupportedSetupError", "offload_param.device nvme"),
    "quantized_weights": ("UnsupportedSetupError", "zero_quantized_weights"),
    "hpz": ("UnsupportedSetupError", "zero_hpz_partition_size"),
    "super_offload": ("UnsupportedSetupError", "super_offload"),
    "zenflow": ("UnsupportedSetupError", "zenflow"),
    "nvme_optimizer_offload": ("UnsupportedSetupError", "offload_optimizer.device nvme"),
    "quantized_nontrainable_weights": ("UnsupportedSetupError", "zero_quantized_weights"),
    "torch_autocast": ("UnsupportedSetupError", "torch_autocast"),
    "low_precision_masters": ("UnsupportedSetupError", "low-precision master weights"),
    "unverified_deepspeed": ("UnsupportedSetupError",
                             "DeepSpeed 0.99.0 is not supported: faircast-ds supports deepspeed>=0.16.0,<0.20"),
    "misspelled_key": ("FairCastConfigError", "fair_cast.moed: unknown key (did you mean 'mode'?)"),
    "wrong_type": ("FairCastConfigError", "fair_cast.seed: str '1234' is not accepted"),
    "unknown_mode": ("FairCastConfigError", "expected one of nearest, stochastic, dither, error_feedback"),
    "not_an_object": ("FairCastConfigError", "fair_cast: expected an object"),
    "bad_align_engine": ("FairCastConfigError", "fair_cast.align_rounding.engine: str 'sglng' is not accepted"),
    "bad_diagnostics": ("FairCastConfigError", "fair_cast.diagnostics.evry: unknown key (did you mean 'every'?)"),
    "nonfinite": ("NonFiniteWeightError", "'model.layers.0.self_attn.q_proj.weight' element 5"),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = tmp_path_factory.mktemp("initialize")
    deepspeed_launch(DIST / "initialize_worker.py", 1, out)
    return json.loads((out / "initialize.json").read_text()), (out / "launch.log").read_text()


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_fails_at_initialize_with_a_message_naming_it(outcomes, case):
    kind, words = EXPECTED[case]
    got = outcomes[0][case]
    assert not got["ok"], f"{case} was accepted"
    assert got["type"] == kind, got
    assert words in got["message"], got["message"]


def test_absent_or_disabled_section_leaves_deepspeed_alone_and_says_so(outcomes):
    results, log = outcomes
    assert results["absent"] == {"ok": True, "attached": False}
    assert results["disabled"] == {"ok": True, "attached": False}
    assert "[fair_cast] disabled by config (fair_cast.enabled=false): serving round-to-nearest" in log


def test_align_rounding_from_the_json_is_applied(outcomes):
    results, log = outcomes
    assert results["alignment"] == {"ok": True, "aligned": True, "equals_engine_reference": True,
                                    "differs_from_hf_eager": True}
    from faircast_ds.align.profiles import REGIONS

    assert f"align_rounding=sglang[{','.join(REGIONS)}]" in log  # the default: every region
