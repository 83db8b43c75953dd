"""Megatron-Core's served weights in HF names (faircast_ds.megatron.reader) through the one served-weight source,
into a vLLM CPU engine bit for bit.

Without a launch: the name map (Llama and Qwen3), the fused QKV / gate-up split against row indices written
here, refusals. One 2-rank launch of tests/dist/megatron_hf_worker.py (a Qwen3-shaped GPT model, Fair Cast
stochastic): (TP2, PP1) and (TP1, PP2); the walk's HF tensors equal the worker's oracle (full parameters
joined with ``torch.cat``, split by explicit rows), the served full parameters are ``cast_reference`` of
the full masters, both layouts serve the same HF bits, the names and shapes are exactly
``transformers.Qwen3ForCausalLM``'s; the TP2 trainer pushes them into a vLLM engine (its own process,
started once on rank 0) through ``WeightPush``: verified by the engine's digests and read back tensor by
tensor, bit for bit.
"""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from conftest import DIST, cpu_env, free_port, run_logged

from faircast_ds.megatron.reader import Attention, hf_names, hf_shapes, to_hf

HAS_MEGATRON = importlib.util.find_spec("megatron") is not None
HAS_VLLM = importlib.util.find_spec("vllm") is not None
SEED = 77


def test_names_of_every_megatron_gpt_parameter():
    assert hf_names("embedding.word_embeddings.weight") == ["model.embed_tokens.weight"]
    assert hf_names("output_layer.weight", "llama") == ["lm_head.weight"]
    assert hf_names("decoder.final_layernorm.weight") == ["model.norm.weight"]
    assert hf_names("decoder.layers.7.self_attention.linear_qkv.weight") == [
        f"model.layers.7.self_attn.{p}_proj.weight" for p in "qkv"]
    assert hf_names("decoder.layers.0.mlp.linear_fc1.weight", "llama") == [
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    # the local spec's norms and Transformer Engine's fused ones name the same HF tensors
    for megatron in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
        assert hf_names(f"decoder.layers.3.{megatron}") == ["model.layers.3.input_layernorm.weight"]
    for megatron in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
        assert hf_names(f"decoder.layers.3.{megatron}") == ["model.layers.3.post_attention_layernorm.weight"]
    assert hf_names("decoder.layers.1.self_attention.k_layernorm.weight") == ["model.layers.1.self_attn.k_norm.weight"]


@pytest.mark.parametrize("name, family, why", [
    ("embedding.position_embeddings.weight", "qwen3", "not a Megatron GPT parameter"),
    ("decoder.layers.0.mlp.experts.linear_fc1.weight0", "qwen3", "not a Megatron GPT parameter"),
    ("decoder.layers.0.self_attention.q_layernorm.weight", "llama", "Llama has no query/key norm"),
    ("output_layer.weight", "gpt2", "unknown model family"),
])
def test_unmapped_parameters_are_named_in_the_error(name, family, why):
    with pytest.raises(ValueError, match=why):
        hf_names(name, family)


def test_fused_qkv_and_gate_up_split_by_query_group():
    """Rows of linear_qkv: per query group, its query heads, then its key head, then its value head."""
    a = Attention(heads=6, groups=2, head_dim=4)
    rows = torch.arange(2 * (3 + 2) * 4, dtype=torch.float32).unsqueeze(1).repeat(1, 5)
    pieces = dict(to_hf("decoder.layers.2.self_attention.linear_qkv.weight", rows, a))
    q, k, v = (pieces[f"model.layers.2.self_attn.{p}_proj.weight"] for p in "qkv")
    block = 5 * 4
    want_q = [g * block + i for g in range(2) for i in range(3 * 4)]
    want_k = [g * block + 12 + i for g in range(2) for i in range(4)]
    want_v = [g * block + 16 + i for g in range(2) for i in range(4)]
    assert q[:, 0].tolist() == want_q and k[:, 0].tolist() == want_k and v[:, 0].tolist() == want_v
    assert [tuple(t.shape) for t in (q, k, v)] == hf_shapes("x.linear_qkv.weight", (40, 5), a)
    fc1 = torch.arange(12.0).reshape(6, 2)
    gate, up = (t for _, t in to_hf("decoder.layers.0.mlp.linear_fc1.weight", fc1, a))
    assert torch.equal(gate, fc1[:3]) and torch.equal(up, fc1[3:])
    with pytest.raises(ValueError, match="do not divide"):
        Attention(heads=5, groups=2, head_dim=4)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    if not HAS_MEGATRON:
        pytest.skip("needs megatron-core")
    out = tmp_path_factory.mktemp("megatron_hf")
    env = cpu_env(OUT_DIR=str(out), LAYOUTS="2,1;1,2", VLLM="1" if HAS_VLLM else "0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(DIST / "megatron_hf_worker.py")]
    run_logged(cmd, out / "launch.log", env=env, timeout=900)
    return out


LAYOUT_TAGS = ("2x1", "1x2")


@pytest.mark.slow
@pytest.mark.parametrize("tag", LAYOUT_TAGS)
def test_hf_tensors_are_the_served_parameters_reassembled(launch, tag):
    walked, oracle = torch.load(launch / f"hf_{tag}.pt"), torch.load(launch / f"oracle_{tag}.pt")
    assert sorted(walked) == sorted(oracle) and len(walked) == 25
    for name in oracle:
        assert torch.equal(walked[name], oracle[name]), f"{tag}: {name}"


@pytest.mark.slow
@pytest.mark.parametrize("tag", LAYOUT_TAGS)
def test_served_parameters_are_the_reference_cast_of_the_masters(launch, tag):
    from faircast_ds.casting.reference import cast_reference

    saved = torch.load(launch / f"masters_{tag}.pt")
    assert len(saved["masters"]) == 19  # Megatron parameters: 8 per layer, embedding, final norm, output layer
    for name, master in saved["masters"].items():
        want = cast_reference(master.reshape(-1), "stochastic", seed=SEED, step=1, name=name)
        assert torch.equal(want.view(torch.int16).to(torch.int64) & 0xFFFF, saved["full"][name].reshape(-1)), name


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_serve_the_same_hf_bits(launch):
    a, b = torch.load(launch / "hf_2x1.pt"), torch.load(launch / "hf_1x2.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.slow
def test_names_and_shapes_are_transformers_qwen3(launch):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    c = json.loads((launch / "hf.json").read_text())["config"]
    cfg = Qwen3Config(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["ffn"],
                      num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["groups"],
                      head_dim=c["head_dim"], tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    walked = torch.load(launch / "hf_2x1.pt")
    want = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    assert {n: tuple(t.shape) for n, t in walked.items()} == want


@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="needs vllm")
def test_a_tp2_trainer_pushes_its_served_bits_into_vllm(launch):
    report = json.loads((launch / "hf.json").read_text())["layouts"][0]
    assert report["layout"] == [2, 1]
    pushed = report["vllm"]
    assert pushed["verified"] is True and pushed["mismatched"] == [] and pushed["params"] == 25
    assert pushed["read_back"] == 25 and pushed["read_back_differing"] == {}  # every HF tensor, bit for bit
    assert pushed["packed"]["qkv_proj"] == ["q_proj", "k_proj", "v_proj"]
