"""How often SmolLM2-135M-Instruct answers small additions right at temperature 1 (docs/pretrained.md):
the reward spread the GRPO task needs (a group whose rewards are all equal has no advantage).

    python benchmarks/pretrained_task_spread.py [--prompts 16] [--group 4] [--tokens 24]

Starts `vllm serve` on the cached bf16 checkpoint (faircast_ds/models/pretrained.py), asks ``prompts`` additions
through the chat template, ``group`` sampled answers each, and prints per operand range and wording the mean
reward (jobs/addition.py's rule: the last integer of the answer is a + b) and how many groups hold both a
right and a wrong answer.
"""
from __future__ import annotations

import argparse
import random
import re
import time

import torch

from faircast_ds.models import pretrained
from faircast_ds.vllm.transfer.server import VllmServer

SETTINGS = [(1, 9, "What is {a} + {b}?"), (1, 9, "What is {a} + {b}? Answer with the number only."),
            (10, 49, "What is {a} + {b}?")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--tokens", type=int, default=24)
    args = p.parse_args()
    directory = pretrained.checkpoint("smollm2-135m-instruct")
    tok = pretrained.load_tokenizer(directory)
    began = time.perf_counter()
    with VllmServer(directory, max_model_len=128, log_path="vllm-task-spread.log") as server:
        print(f"vllm serve up in {time.perf_counter() - began:.0f} s")
        for low, high, template in SETTINGS:
            rng = random.Random(0)
            pairs = [(rng.randint(low, high), rng.randint(low, high)) for _ in range(args.prompts)]
            prompts = [pretrained.chat_prompt_ids(tok, template.format(a=a, b=b)) for a, b in pairs
                       for _ in range(args.group)]
            t0 = time.perf_counter()
            tokens, _ = server.generate(prompts, args.tokens, list(range(len(prompts))), temperature=1.0)
            seconds = time.perf_counter() - t0
            rewards = []
            for row, (a, b) in zip(tokens.tolist(), [p for p in pairs for _ in range(args.group)]):
                row = row[:row.index(tok.eos_token_id)] if tok.eos_token_id in row else row
                numbers = re.findall(r"-?\d+", tok.decode(row))
                rewards.append(float(bool(numbers) and int(numbers[-1]) == a + b))
            r = torch.tensor(rewards).view(args.prompts, args.group)
            mixed = int(((r.sum(1) > 0) & (r.sum(1) < args.group)).sum())
            print(f"operands {low}-{high}, {template!r}: mean reward {r.mean():.3f}, groups with both {mixed}/"
                  f"{args.prompts}, {len(prompts)} x {args.tokens} tokens in {seconds:.0f} s")


if __name__ == "__main__":
    main()
