"""The colocated route (an in-process vLLM engine, ``WeightPush``) with a model whose LM head is tied to its
embedding: writes what it measured to OUT_DIR/tied.json for tests/vllm_tests/transfer/test_tied_head.py.

A dense verified push, a delta that moves two embedding elements (verified; the head read back through
its kernel is compared here with the embedding's bits), then a kernel fault in the head (its logits read
one element 1.0 larger, installed in the engine's worker) with a delta that moves that element: the
verified push must fail naming ``lm_head.weight``.

Usage: python tests/dist/tied_colocated_worker.py OUT_DIR
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
from fault_trainer import canonical_bits
from vllm_worker import KV_CACHE_GIB, exported

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

ROW, COLUMN = 9, 5  # the element the head's faulty kernel reads wrong


def build():
    from faircast_bench.builders import tiny_causal_lm

    return tiny_causal_lm("qwen3", seed=0, init_std=0.1, max_position_embeddings=64, tie_word_embeddings=True,
                          head_dim=32).eval()


def head_fault(worker) -> bool:
    """In the engine's worker: the tied head's kernel computes as if element (ROW, COLUMN) were 1.0 larger."""
    head = worker.model_runner.get_model().lm_head
    method = head.quant_method
    apply = method.apply

    def faulty(layer, x, bias=None):
        out = apply(layer, x, bias)
        if layer is head:
            out = out.clone()
            out[..., ROW] += x[..., COLUMN].to(out.dtype)
        return out

    method.apply = faulty
    return True


def main(out_dir: str) -> None:
    from faircast_ds.vllm import EngineWeightsMismatch, VllmEngine, WeightPush

    out: dict = {}
    model = build()
    export = exported(model, out_dir)
    engine = VllmEngine(export, max_model_len=64, seed=0, kv_cache_gib=KV_CACHE_GIB)
    out["tied_head"] = engine.info["tied_head"]
    push = WeightPush(model, engine)
    out["checked"] = [n for n, _ in push.checked]
    r = push.push(version=0)
    out["dense"] = {"kind": r.kind, "verified": r.verified}
    embedding = model.model.embed_tokens.weight
    with torch.no_grad():
        embedding.view(torch.int16)[5, 3] += 1
        embedding.view(torch.int16)[40, 17] += 1
    r = push.push(version=1)
    out["delta"] = {"kind": r.kind, "verified": r.verified}
    head = engine.read("lm_head.weight", list(embedding.shape))
    out["head_equals_embedding_bits"] = torch.equal(canonical_bits(head), canonical_bits(embedding))
    engine.llm.collective_rpc(head_fault)
    with torch.no_grad():
        embedding.view(torch.int16)[ROW, COLUMN] += 1
    try:
        push.push(version=2)
        out["fault"] = {"raised": False}
    except EngineWeightsMismatch as exc:
        out["fault"] = {"raised": True, "mismatched": list(exc.mismatched)}
    (Path(out_dir) / "tied.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    sys.stdout.flush()
    os._exit(0)
