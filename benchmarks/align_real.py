"""The trainer against the running vLLM CPU engine on a real checkpoint (issue 51 item 1).

vLLM's CPU engine (in this process, eager, bf16) samples chat-templated completions of SmolLM2-135M-Instruct
(fixed prompts, one seed each, temperature 1, up to --tokens tokens, stopping at EOS) and returns its own
log-prob of every sampled token (decode, from the KV cache). The same tokens are then scored teacher-forced
by HF transformers (eager attention) on the same bf16 weights, in each trainer variant; Δ = logp_trainer −
logp_engine over the sampled tokens. The engine's own teacher-forced log-probs of the same sequences
(prefill, ``prompt_logprobs``) are printed too: that is the engine against itself, how far its decode and
prefill paths part.

    python benchmarks/align_real.py                 # sample (cached in --samples) and score every variant
    python benchmarks/align_real.py --variants bf16,aligned

Variants: fp32 (the bf16 weights upcast), bf16, aligned (bf16 + ``align_model(model, "vllm-cpu")``), gemm
(bf16 + ``models.gemm.use_fp32_accumulation``), gemm+aligned (both), aligned@vllm-cpu-avx512bf16 (the
profile that rounds the CPU kernels' outputs to nearest: what ``vllm-cpu`` was before issue 51, and is on a
CPU with AVX512-BF16).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "What is the capital of France?", "Write a haiku about autumn leaves.", "Explain photosynthesis in one sentence.",
    "Give me three tips for better sleep.", "What is 17 times 23?", "Translate 'good morning' into Spanish.",
    "Name a famous painting by Van Gogh.", "Why is the sky blue?", "Write a short poem about the sea.",
    "What does a compiler do?", "Suggest a name for a pet turtle.", "How many legs does a spider have?",
    "Describe a cat in two sentences.", "What is the boiling point of water?", "List three primary colors.",
    "Tell me a fun fact about octopuses.", "What is machine learning?", "How do I make a cup of tea?",
    "Who wrote Romeo and Juliet?", "Explain gravity to a child.", "What is the largest planet?",
    "Write a sentence using the word 'serendipity'.", "What are prime numbers?", "Give an example of a mammal.",
    "How does a rainbow form?", "What is the square root of 144?", "Recommend a book for a long trip.",
    "What is the difference between weather and climate?", "Write a limerick about a frog.",
    "Why do we have seasons?", "What is an API?", "Summarize the plot of Cinderella.",
]
VARIANTS = ("fp32", "bf16", "aligned", "gemm", "gemm+aligned", "aligned@vllm-cpu-avx512bf16")


def sample(directory: Path, n: int, tokens: int) -> dict:
    """Prompts, the engine's sampled completions and their decode log-probs, and its prefill log-probs."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer

    from faircast_ds.vllm.colocated.inference import VllmEngine

    tok = AutoTokenizer.from_pretrained(directory)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
               for p in PROMPTS[:n]]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    engine = VllmEngine(directory, max_model_len=256, seed=0, kv_cache_gib=1.0)
    try:
        vllm = engine._vllm
        params = [vllm.SamplingParams(max_tokens=tokens, temperature=1.0, top_p=1.0, top_k=0, logprobs=0,
                                      seed=1000 + i, stop_token_ids=[tok.eos_token_id], detokenize=False) for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        completions, decode = [], []
        for out in outs:
            seq = out.outputs[0]
            completions.append(list(seq.token_ids))
            decode.append([step[t].logprob for step, t in zip(seq.logprobs, seq.token_ids)])
        full = [p + c for p, c in zip(prompts, completions)]
        scored = engine.llm.generate([{"prompt_token_ids": s} for s in full],
                                     vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                                     use_tqdm=False)
        prefill = [[step[t].logprob for step, t in zip(out.prompt_logprobs[len(p):], c)]
                   for out, p, c in zip(scored, prompts, completions)]
    finally:
        engine.close()
    return {"vllm": __import__("vllm").__version__, "torch": torch.__version__, "seconds": seconds,
            "prompts": prompts, "completions": completions, "decode": decode, "prefill": prefill}


def trainer(directory: Path, variant: str):
    """The HF model (eager attention) of one variant, and the alignment handle (or None). ``aligned`` is
    ``align_model(model, "vllm-cpu")``; ``aligned@NAME`` aligns to the profile NAME instead."""
    from faircast_ds.align import align_model
    from faircast_ds.models.gemm import use_fp32_accumulation
    from faircast_ds.models.pretrained import load_causal_lm

    model = load_causal_lm(directory, dtype=torch.float32 if variant == "fp32" else torch.bfloat16).eval()
    if "gemm" in variant:
        use_fp32_accumulation(model)
    engine = variant.split("@")[1] if "@" in variant else "vllm-cpu"
    handle = align_model(model, engine) if "aligned" in variant else None
    return model, handle


def score(model, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
    """Teacher-forced log-prob of each completion token, one sequence at a time (no padding)."""
    from faircast_ds.align.meter import token_logprobs

    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            ids = torch.tensor([p + c])
            lp = token_logprobs(model(input_ids=ids).logits, ids)[0, len(p) - 1:]
            out.append(lp.double().tolist())
    return out


def stats(trainer_lp: list[list[float]], engine_lp: list[list[float]]) -> dict:
    r = torch.tensor([t - e for ts, es in zip(trainer_lp, engine_lp) for t, e in zip(ts, es)], dtype=torch.float64)
    a = r.abs()
    q = torch.quantile(a, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    return {"tokens": r.numel(), "mean_abs": a.mean().item(), "rms": r.pow(2).mean().sqrt().item(),
            "k3_kl": (torch.expm1(r) - r).mean().item(),
            "outside": ((r.exp() < 0.8) | (r.exp() > 1.2)).double().mean().item(),
            "equal": (r == 0).double().mean().item(), "p50": q[0], "p90": q[1], "p99": q[2], "max": a.max().item()}


def row(name: str, s: dict) -> str:
    return (f"| {name} | {s['mean_abs']:.4f} | {s['rms']:.4f} | {s['k3_kl']:.2e} | {s['outside']:.2%} | "
            f"{s['equal']:.1%} | {s['p50']:.4f} | {s['p90']:.4f} | {s['p99']:.4f} | {s['max']:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--samples", default=str(ROOT / "docs/alignment/real_samples.json"),
                    help="the engine's samples: read if present (same model, prompts, tokens), else written")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-prefill-row", action="store_true", help="leave out the engine-against-itself row")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from faircast_ds.models.pretrained import checkpoint

    directory = checkpoint(args.model)
    path = Path(args.samples)
    key = {"model": args.model, "prompts": args.prompts, "tokens": args.tokens}
    data = json.loads(path.read_text()) if path.exists() else None
    if data is None or data.get("key") != key:
        data = {"key": key, **sample(directory, args.prompts, args.tokens)}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
    prompts, completions, decode = data["prompts"], data["completions"], data["decode"]
    n = sum(map(len, completions))
    print(f"{args.model}: vLLM {data['vllm']} CPU engine (eager, bf16), {len(prompts)} chat-templated prompts, "
          f"{n} sampled tokens (temperature 1, up to {args.tokens} each, seeds 1000+i); torch {torch.__version__}, "
          f"AVX-512: {torch.backends.cpu.get_cpu_capability()}")
    print("Δ = logp_trainer − logp_engine(decode) over the sampled tokens; quantiles of |Δ|\n")
    print("| trainer | mean \\|Δ\\| | RMS | K3 KL | ratio outside [0.8, 1.2] | Δ = 0 | p50 | p90 | p99 | max |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    if not args.no_prefill_row:
        print(row("engine's own prefill (prompt_logprobs)", stats(data["prefill"], decode)), flush=True)
    results = {}
    for variant in args.variants.split(","):
        t0 = time.perf_counter()
        model, _ = trainer(directory, variant)
        lp = score(model, prompts, completions)
        results[variant] = stats(lp, decode)
        print(row(variant, results[variant]) + f" <!-- {time.perf_counter() - t0:.0f} s -->", flush=True)
        del model


if __name__ == "__main__":
    main()
