"""The real-size path in CI (issue 23, item 5): Qwen3-0.6B's architecture at 2 layers (its real
vocabulary and widths, 187M parameters) under ZeRO-3 on 2 CPU ranks, one launch of
tests/dist/realsize_worker.py; every rank checks the served bits against an oracle on every
element, the engine's bits after a dense and a delta push, the export, and a bitwise resume."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import DIST, ROOT, cpu_env, deepspeed_launch

pytestmark = pytest.mark.slow
PARAMS = 187_045_376  # test_real_models.py works this out from the shapes


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("realsize")
    deepspeed_launch(DIST / "realsize_worker.py", 2, out, timeout=900)
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_built_partitioned_under_zero_init_at_the_published_init(ranks):
    for r in ranks[1]:
        assert r["params"] == PARAMS
        assert r["partitioned"], "a parameter was whole on a rank after deepspeed.zero.Init"
        assert r["init_wrong"] == 0
        assert r["routed_linears"] == 2 * 7 + 1  # q k v o gate up down per layer, the head


def test_served_bits_are_the_oracle_cast_of_every_master_element(ranks):
    shard = 0
    for r in ranks[1]:
        assert r["reference_disagreements"] == 0  # the vectorized oracle against faircast_ds.casting.reference
        for check in r["checks"] + [r["after_resume"]]:
            assert check["wrong"] == 0, check["first"]
        shard += r["checks"][0]["checked"]
    assert shard == PARAMS  # the two ranks' shards cover every element once


def test_engine_bits_are_the_served_bits_after_dense_and_delta_pushes(ranks):
    r0 = ranks[1][0]
    dense, delta = r0["pushes"]
    assert (dense["kind"], delta["kind"]) == ("dense", "delta")
    assert dense["changed"] == PARAMS and 0 < delta["changed"] < PARAMS
    for push in (dense, delta):
        assert push["engine"]["checked"] == PARAMS and push["engine"]["wrong"] == 0, push["engine"]["first"]
    assert [x["kind"] for x in r0["received"]] == ["dense", "delta"]


def test_resume_is_bitwise(ranks):
    for r in ranks[1]:
        assert r["loaded_step"] == 2
        assert r["resume"]["step"] == [3, 3]
        assert r["resume"]["served_equal"] and r["resume"]["master_equal"], r["resume"]


def test_export_holds_the_served_bits_and_vllm_resolves_a_causal_lm(ranks):
    out, rs = ranks
    assert rs[0]["export_wrong"] == 0
    assert "lm_head.weight" not in rs[0]["export_names"]  # tied: the embedding is the head
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["tie_word_embeddings"] is True
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (151_936, 1024, 2)
    pytest.importorskip("vllm")
    probe = ("import sys; from vllm.config import ModelConfig; "
             "mc = ModelConfig(model=sys.argv[1], skip_tokenizer_init=True); "
             "print(list(mc.architectures), mc.runner_type)")
    proc = subprocess.run([sys.executable, "-c", probe, str(out / "export")], capture_output=True, text=True,
                          env=cpu_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "['Qwen3ForCausalLM'] generate"


def test_memory_per_rank(ranks):
    for r in ranks[1]:
        assert r["peak_rss_mib"] < 6 * 1024, r["peak_rss_mib"]  # 187M params, AdamW, ZeRO-3 on 2 ranks
