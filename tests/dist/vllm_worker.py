"""Every check against a real in-process vLLM engine, run once (vLLM takes 15-30 s to start; `vllm serve`
is checked by tests/dist/vllm_serve_worker.py): writes what it measured to OUT_DIR/vllm.json for tests/vllm_tests/test_vllm.py.

Usage: python tests/dist/vllm_worker.py OUT_DIR
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

KV_CACHE_GIB = 1 / 16  # 64 MiB of KV cache: ~0.8 GiB per engine instead of ~1.7
MODEL = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=64, tie_word_embeddings=False)


def build():
    from faircast_bench.builders import tiny_causal_lm

    # a large init std and RMSNorm weights around 1 so rounding differences show in the log-probs; built as
    # from_pretrained builds (fp32 RoPE buffers), as the engine computes its own fp32 tables
    return tiny_causal_lm("qwen3", seed=0, init_std=0.3, norm_jitter=0.2, attn="eager", **MODEL).eval()


def served_digests(model) -> dict[str, str]:
    from faircast_ds.export import served_weights
    from faircast_ds.vllm import digest

    return {n: digest(t) for n, t in served_weights(model)}


def report(r) -> dict:
    return {k: getattr(r, k) for k in ("version", "kind", "params", "params_total", "elements", "bytes", "seconds",
                                       "load_seconds", "verify_seconds", "verified", "mismatched")}


def gaps(trainer: torch.Tensor, engine: torch.Tensor) -> dict:
    from faircast_ds.align.meter import gap_stats

    return {**gap_stats(trainer, engine), "equal": float((trainer == engine).double().mean())}


def alignment_checks(model, engine, out: dict) -> None:
    from faircast_ds.align import REGIONS, align_model
    from faircast_ds.align.meter import token_logprobs

    def trainer(ids, engine_name=None, regions=REGIONS):
        with torch.no_grad():
            if engine_name is None:
                return token_logprobs(model(input_ids=ids).logits, ids)
            with align_model(model, engine_name, regions):
                return token_logprobs(model(input_ids=ids).logits, ids)

    ids = torch.randint(0, MODEL["vocab_size"], (32, 12), generator=torch.Generator().manual_seed(7))
    t0 = time.perf_counter()
    scored = engine.score(ids)  # teacher forced: one prefill per sequence
    out["score_seconds"] = time.perf_counter() - t0
    prefill = {"unaligned": gaps(trainer(ids), scored), "aligned": gaps(trainer(ids, "vllm-cpu"), scored),
               "vllm-cuda": gaps(trainer(ids, "vllm-cuda"), scored), "sglang": gaps(trainer(ids, "sglang"), scored)}
    for region in REGIONS:
        prefill[f"all but {region}"] = gaps(trainer(ids, "vllm-cpu", [r for r in REGIONS if r != region]), scored)
    out["prefill"] = prefill
    prompts = ids[:, :4]
    tokens, logps = engine.generate(prompts, 8, seeds=list(range(100, 132)))
    seqs = torch.cat([prompts, tokens], dim=1)
    out["decode"] = {"unaligned": gaps(trainer(seqs)[:, 3:], logps),
                     "aligned": gaps(trainer(seqs, "vllm-cpu")[:, 3:], logps)}


def exported(model, out_dir: str) -> Path:
    """OUT_DIR/export: ``model`` saved as the engine loads it (version 0), with the sync secret set."""
    from faircast_ds.export import save_hf

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("FAIRCAST_DS_SYNC_SECRET", "faircast-ds vllm test secret 0123456789")
    export = Path(out_dir) / "export"
    save_hf(model, export, version=0)
    return export


def main(out_dir: str) -> None:
    from faircast_ds.vllm import EngineWeightsMismatch, VllmEngine, WeightPush, canonical
    from faircast_ds.vllm.bits import bit_pattern, differing

    out: dict = {}
    model = build()
    export = exported(model, out_dir)
    out["config_architectures"] = json.loads((export / "config.json").read_text()).get("architectures")
    bare = Path(out_dir) / "export-without-architectures"
    shutil.copytree(export, bare, dirs_exist_ok=True)
    config = json.loads((bare / "config.json").read_text())
    config.pop("architectures", None)
    (bare / "config.json").write_text(json.dumps(config))
    from vllm.config import ModelConfig

    out["resolved"] = {name: {"architectures": list(mc.architectures), "runner": mc.runner_type}
                       for name, mc in (("export", ModelConfig(model=str(export), skip_tokenizer_init=True)),
                                        ("bare", ModelConfig(model=str(bare), skip_tokenizer_init=True)))}

    t0 = time.perf_counter()
    engine = VllmEngine(export, max_model_len=64, seed=0, kv_cache_gib=KV_CACHE_GIB,
                        weight_transfer_config={"backend": "faircast"})
    out["start_seconds"] = time.perf_counter() - t0
    out["in_process"] = engine.in_process
    out["architecture"] = engine.info["architecture"]
    out["packed"] = engine.info["packed"]

    # the export alone: the engine computes with the served bits before any push
    expected = served_digests(model)
    got = engine.digests([(n, list(p.shape)) for n, p in model.named_parameters()])
    out["export_mismatched"] = [n for n in expected if got.get(n) != expected[n]]

    # pushes: dense, then only the changed groups
    push = WeightPush(model, engine)
    out["push_dense"] = report(push.push(version=0))
    layers = model.model.layers
    with torch.no_grad():
        layers[0].self_attn.k_proj.weight[3, 5] += 0.125
        layers[1].input_layernorm.weight[7] += 0.0625
    out["push_delta"] = report(push.push(version=1))
    out["push_nothing"] = report(push.push(version=2))
    # -0.0 and a subnormal: the kernels flush them; the check counts them as +0
    with torch.no_grad():
        w = layers[0].self_attn.o_proj.weight
        w[0, 0] = -0.0
        w[0, 1] = torch.tensor(3e-39, dtype=torch.float32).to(torch.bfloat16)
    out["push_flush"] = report(push.push(version=3))
    back = engine.read("model.layers.0.self_attn.o_proj.weight", list(w.shape))
    out["flush"] = {"served_bits": bit_pattern(w[0, :2]).tolist(), "engine_bits": bit_pattern(back[0, :2]).tolist(),
                    "served_is_subnormal": bool(0 < abs(float(w[0, 1])) < torch.finfo(torch.bfloat16).tiny),
                    "differing_canonical": differing(canonical(w), back)}
    # one part of a fused layer alone: vLLM rebuilds qkv_proj with k and v uninitialized; the check catches it
    q = "model.layers.1.self_attn.q_proj.weight"
    k = "model.layers.1.self_attn.k_proj.weight"
    engine.reload([(q, layers[1].self_attn.q_proj.weight.detach().clone())])
    kw = layers[1].self_attn.k_proj.weight
    out["lone_part"] = {"k_differing": differing(kw, engine.read(k, list(kw.shape))), "k_numel": kw.numel()}
    try:
        push.push(version=4, kind="delta")
        out["lone_part"]["raised"] = None
    except EngineWeightsMismatch as exc:
        out["lone_part"]["raised"] = {"message": str(exc)[:400], "mismatched": exc.mismatched}
    out["repair"] = report(push.push(version=5))  # after a failed check the next push is dense

    # sampling: the same seeds give the same tokens and log-prob bits
    prompts = torch.randint(0, MODEL["vocab_size"], (16, 4), generator=torch.Generator().manual_seed(3))
    seeds = list(range(16))
    a_tok, a_lp = engine.generate(prompts, 8, seeds)
    b_tok, b_lp = engine.generate(prompts, 8, seeds)
    c_tok, _ = engine.generate(prompts, 8, [s + 1000 for s in seeds])
    out["sampling"] = {"same_tokens": bool(torch.equal(a_tok, b_tok)),
                       "same_logprob_bits": bool(torch.equal(a_lp.view(torch.int32), b_lp.view(torch.int32))),
                       "other_seeds_differ": bool(not torch.equal(a_tok, c_tok)),
                       "shape": list(a_tok.shape), "finite": bool(torch.isfinite(a_lp).all()),
                       "max_logprob": float(a_lp.max())}

    alignment_checks(model, engine, out)

    # the faircast weight-transfer backend through the in-process LLM's own RL methods (colocated; the same
    # engine and trainer classes `vllm serve` uses, tests/dist/vllm_serve_worker.py): vLLM's checksums
    # (from the kernels) against the served bits, vLLM's weight version
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from faircast_ds.export import served_weights
    from faircast_ds.vllm.transfer.checksums import served_checksums
    from faircast_ds.vllm.transfer.trainer import FairCastTrainerInitInfo, LLMWeightSyncClient

    def colocated(r) -> dict:
        engine.reset_prefix_cache()
        got = {}
        for worker in engine.llm.collective_rpc("compute_weight_checksums"):
            got.update(worker)
        want = served_checksums(served_weights(model))
        return {"kind": r.kind, "params": r.params, "changed": r.changed, "bytes": r.bytes, "plane": r.plane,
                "version": engine.llm.get_weight_version(), "checksums": len(got),
                "mismatched": sorted(k for k in got.keys() | want.keys() if got.get(k) != want.get(k))}

    transfer = WeightTransferTrainerFactory.trainer_init(FairCastTrainerInitInfo(rank=0),
                                                         client=LLMWeightSyncClient(engine.llm), source=model)
    out["colocated_dense"] = colocated(transfer.send_weights(version=10))
    with torch.no_grad():
        layers[1].mlp.up_proj.weight[0, :4] += 0.25
    out["colocated_delta"] = colocated(transfer.send_weights(version=11))
    out["up_proj_bytes"] = layers[1].mlp.up_proj.weight.numel() * layers[1].mlp.up_proj.weight.element_size()
    tok_a, lp_a = engine.generate(prompts, 8, seeds)
    push.push(version=12)  # the colocated push of the same weights (in memory, read back per HF tensor)
    tok_b, lp_b = engine.generate(prompts, 8, seeds)
    out["colocated_vs_push"] = {"same_tokens": bool(torch.equal(tok_a, tok_b)),
                                "same_logprob_bits": bool(torch.equal(lp_a.view(torch.int32), lp_b.view(torch.int32)))}
    transfer.shutdown()
    engine.close()
    out["ok"] = True
    with open(Path(out_dir) / "vllm.json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # vLLM's threads are not waited for at interpreter exit
