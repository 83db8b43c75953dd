"""Run by tests/align/test_align_engine.py in its own process: a tiny Llama served by vLLM's CPU engine (in
process, eager), which scores token ids teacher-forced and hands back its own intermediates.

Writes OUT_DIR/engine.pt: the model's export directory, the token ids, the engine's log-probs of every
token after the first (``prompt_logprobs``), and for the first sequence (scored alone, with forward hooks on
the engine's modules) each layer's RoPE input and output (q, k), attention input (q, k, v) and output, and
the LM head's input (the final norm's output) and the logits, in their dtype.

Usage: python tests/align/engine_capture.py OUT_DIR
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODEL = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=64, tie_word_embeddings=False)
SEQUENCES, LENGTH = 32, 12


def build():
    from faircast_bench.builders import tiny_causal_lm

    # large init std and norm weights around 1 so rounding differences show; fp32 RoPE buffers as from_pretrained
    return tiny_causal_lm("llama", seed=0, init_std=0.3, norm_jitter=0.2, attn="eager", **MODEL).eval()


def main(out_dir: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from faircast_ds.vllm.colocated.inference import VllmEngine

    out = Path(out_dir)
    export = out / "export"
    build().save_pretrained(export)
    ids = torch.randint(0, MODEL["vocab_size"], (SEQUENCES, LENGTH), generator=torch.Generator().manual_seed(7))
    engine = VllmEngine(export, max_model_len=64, seed=0, kv_cache_gib=1 / 16, enable_prefix_caching=False)
    try:
        model = engine.rpc("_faircast_model")
        calls: dict[str, list] = {}

        def keep(x):
            if isinstance(x, torch.Tensor):
                return x.detach().clone()
            if isinstance(x, (tuple, list)):
                return tuple(keep(t) for t in x if isinstance(t, torch.Tensor))
            return None

        hooks = []
        for name, module in model.named_modules():
            leaf = name.split(".")[-1]
            if leaf in ("rotary_emb", "attn", "logits_processor"):
                hooks.append(module.register_forward_pre_hook(
                    lambda m, a, leaf=leaf: calls.setdefault(leaf + ".in", []).append(keep(a))))
                hooks.append(module.register_forward_hook(
                    lambda m, a, o, leaf=leaf: calls.setdefault(leaf + ".out", []).append(keep(o))))
        first = engine.score(ids[:1])  # alone: one prefill, every hooked module called once per layer
        for h in hooks:
            h.remove()
        scored = engine.score(ids)
        assert torch.equal(first, scored[:1]), "the engine scores a sequence alike alone and in a batch"
    finally:
        engine.close()
    torch.save({"export": str(export), "ids": ids, "engine_logprobs": scored,
                "rope_in": [c[1:3] for c in calls["rotary_emb.in"]], "rope_out": calls["rotary_emb.out"],
                "attn_in": [c[:3] for c in calls["attn.in"]], "attn_out": calls["attn.out"],
                "logits_in": calls["logits_processor.in"][0][0], "logits": calls["logits_processor.out"][0]}, out / "engine.pt")


if __name__ == "__main__":
    main(sys.argv[1])
