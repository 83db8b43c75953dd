"""A Qwen3-shaped Megatron-Core GPT model (local spec: RMSNorm, GQA fused QKV with query/key norms, SwiGLU,
no biases, untied embeddings) under tensor parallel 2 with Fair Cast, its served weights read under HF names
through the one served-weight source (``ServedSource(model)``: the ``MegatronHFReader`` the attach provided),
for tests/megatron_tests/test_megatron_hf.py. ``LAYOUTS``: ``tp,pp`` pairs separated by ``;`` (the world is their product).

Per layout: the fp32 main params are set from full masters (the layout worker's: split by ``torch.chunk``),
Fair Cast (stochastic) serves them, and a dense walk of the source yields every HF tensor on every rank.
Rank 0 writes those (``hf_<tp>x<pp>.pt``) and, as the oracle, every full served parameter reassembled from
all ranks' local served tensors with ``torch.cat`` (the layout worker's ``join``) and split into HF
tensors here by explicit row indices (``oracle_<tp>x<pp>.pt``), with the full masters (``masters_...``).
Nothing of faircast_ds.megatron.reader or faircast_ds.megatron.layout is used for the oracle.
"""
from __future__ import annotations

import json
import os
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_cpu  # noqa: E402

megatron_cpu.enable()

import megatron_layout_worker as layouts  # noqa: E402  (its masters, splits and joins)

OUT = os.environ["OUT_DIR"]
LAYOUTS = [tuple(int(x) for x in part.split(",")) for part in os.environ.get("LAYOUTS", "2,1").split(";") if part]
SEED = 77
NUM_LAYERS, HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, VOCAB, SEQ = 2, 128, 4, 2, 32, 256, 128, 8  # vllm_worker's sizes
VLLM = os.environ.get("VLLM", "") == "1"  # push the first layout's served weights into a vLLM CPU engine
KV_CACHE_GIB = 1 / 16


def start_vllm() -> tuple[threading.Thread, dict]:
    """Rank 0, before the first layout: a vLLM engine (its own process) on a Qwen3 HF directory of this shape
    (random weights), started on a thread, so that its start (a minute of one process importing) runs while
    the ranks build and walk the first layout; push_to_vllm waits for it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import vllm  # noqa: F401  (imported here, before the ranks build: the thread only starts the engine)

    from faircast_ds.vllm import VllmEngine

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=NUM_LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HEAD_DIM,
                      max_position_embeddings=64, tie_word_embeddings=False)
    where = os.path.join(OUT, "qwen3-random")
    with torch.random.fork_rng():  # the random weights leave this rank's generator as it was
        torch.manual_seed(1)
        Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(where)
    box: dict = {}

    def start() -> None:
        try:
            box["engine"] = VllmEngine(where, max_model_len=64, seed=0, kv_cache_gib=KV_CACHE_GIB, in_process=False)
        except BaseException as exc:  # noqa: BLE001 - raised on rank 0 by push_to_vllm
            box["error"] = exc

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread, box


def push_to_vllm(source, walked: dict[str, torch.Tensor], starting) -> dict:  # walked: name -> served bf16 tensor
    """Every rank pushes the source's served bits into the engine start_vllm started on rank 0 (WeightPush,
    verified by the engine's digests), then rank 0 reads every HF tensor back from the engine and compares
    its bits with the walk's."""
    from faircast_ds.vllm import WeightPush, canonical
    from faircast_ds.vllm.bits import bit_pattern

    rank = torch.distributed.get_rank()
    engine = None
    if rank == 0:
        thread, box = starting
        thread.join()
        if "error" in box:
            raise box["error"]
        engine = box["engine"]
    push = WeightPush(None, engine, source=source, delta=False, verify=True)
    report = push.push(version=1)
    out = {"verified": report.verified, "mismatched": list(report.mismatched), "params": report.params}
    if rank == 0:
        differing = {}
        for name, served in walked.items():
            back = engine.read(name, list(served.shape))
            want = canonical(served)
            n = int((bit_pattern(back).reshape(-1) != bit_pattern(want).reshape(-1)).sum())
            if n:
                differing[name] = n
        out["read_back_differing"] = differing
        out["read_back"] = len(walked)
        out["packed"] = engine.info["packed"]
        engine.close()
    return out


def build(tp: int, pp: int):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from faircast_ds.megatron import attach

    config = TransformerConfig(num_layers=NUM_LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=HEAD_DIM, ffn_hidden_size=FFN,
                               gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                               add_bias_linear=False, normalization="RMSNorm", qk_layernorm=True, bf16=True,
                               params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                               use_cpu_initialization=True, tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=pp, attention_dropout=0.0, hidden_dropout=0.0)
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
                     vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=False,
                     position_embedding_type="rope")
    model = Float16Module(config, model)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                          grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, clip_grad=0.0,
                                                       use_distributed_optimizer=True), [model])
    fc = attach(optimizer, {"mode": "stochastic", "seed": SEED}, route="runtime")
    return config, model, optimizer, fc


def oracle_hf(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors from full Megatron parameters, by explicit row indices (written apart from hf.py)."""
    out = {}
    per = HEADS // GROUPS
    for name, t in full.items():
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
        elif name == "output_layer.weight":
            out["lm_head.weight"] = t
        else:
            parts = name.split(".")
            layer, rest = parts[2], ".".join(parts[3:])
            p = f"model.layers.{layer}."
            if rest == "self_attention.linear_qkv.weight":
                rows = {"q": [], "k": [], "v": []}
                block = (per + 2) * HEAD_DIM
                for g in range(GROUPS):
                    base = g * block
                    rows["q"] += list(range(base, base + per * HEAD_DIM))
                    rows["k"] += list(range(base + per * HEAD_DIM, base + (per + 1) * HEAD_DIM))
                    rows["v"] += list(range(base + (per + 1) * HEAD_DIM, base + block))
                for k, r in rows.items():
                    out[f"{p}self_attn.{k}_proj.weight"] = t[torch.tensor(r)]
            elif rest == "mlp.linear_fc1.weight":
                out[f"{p}mlp.gate_proj.weight"] = t[:FFN]
                out[f"{p}mlp.up_proj.weight"] = t[FFN:]
            else:
                out[p + {"self_attention.linear_proj.weight": "self_attn.o_proj.weight",
                         "input_layernorm.weight": "input_layernorm.weight",
                         "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
                         "mlp.linear_fc2.weight": "mlp.down_proj.weight",
                         "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
                         "self_attention.k_layernorm.weight": "self_attn.k_norm.weight"}[rest]] = t
    return out


def run_layout(tp: int, pp: int, starting=None) -> dict:
    from megatron.core import parallel_state as ps

    from faircast_ds.casting.bits import bf16_bits
    from faircast_ds.export.source import ServedSource
    from faircast_ds.megatron.reader import MegatronHFReader

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    layouts.PP_SIZE[0] = pp
    layouts.NUM_LAYERS = NUM_LAYERS
    rank = torch.distributed.get_rank()
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    config, model, optimizer, fc = build(tp, pp)
    layouts.set_masters(model, optimizer, 1, tp, tp_rank, pp_rank)
    layouts.serve(optimizer)
    # the reader Megatron's attach handed export under the model chunk (faircast_ds.export.source.provide)
    source = ServedSource(model, delta=False)
    assert isinstance(source.reader, MegatronHFReader) and source.reader.family == "qwen3", type(source.reader)
    walked, raw = {}, {}
    for item in source.walk("dense"):
        raw[item.name] = item.tensor.clone()
        walked[item.name] = bf16_bits(raw[item.name]).reshape(item.tensor.shape)
    # the oracle: every rank's local served tensors, gathered and joined by the worker's own rules
    local = [(layouts.full_name(n, pp_rank), tp_rank, p.detach().clone())
             for n, p in layouts.local_params(model).items()]
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, local)
    report = {"layout": [tp, pp], "specs": [(s.name, list(s.shape)) for s in source.specs]}
    if VLLM and (tp, pp) == LAYOUTS[0]:
        report["vllm"] = push_to_vllm(source, raw, starting)
    if rank == 0:
        pieces: dict[str, dict[int, torch.Tensor]] = {}
        for rank_local in everyone:
            for name, r, t in rank_local:
                pieces.setdefault(name, {})[r] = t
        full = {n: layouts.join([by[r] for r in sorted(by)], layouts.kind_of(n)) for n, by in pieces.items()}
        masters = {n: layouts.full_master(n, tuple(t.shape), 1) for n, t in full.items()}
        oracle = {n: bf16_bits(t).reshape(t.shape) for n, t in oracle_hf(full).items()}
        tag = f"{tp}x{pp}"
        torch.save(walked, os.path.join(OUT, f"hf_{tag}.pt"))
        torch.save(oracle, os.path.join(OUT, f"oracle_{tag}.pt"))
        torch.save({"full": {n: bf16_bits(t) for n, t in full.items()}, "masters": masters},
                   os.path.join(OUT, f"masters_{tag}.pt"))
    torch.distributed.barrier()
    ps.destroy_model_parallel()
    return report


def main() -> None:
    torch.distributed.init_process_group("gloo")
    starting = start_vllm() if VLLM and torch.distributed.get_rank() == 0 else None
    reports = [run_layout(tp, pp, starting) for tp, pp in LAYOUTS]
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(OUT, "hf.json"), "w") as f:
            json.dump({"layouts": reports, "config": dict(hidden=HIDDEN, heads=HEADS, groups=GROUPS, head_dim=HEAD_DIM,
                                                          ffn=FFN, vocab=VOCAB, layers=NUM_LAYERS)}, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
