"""vLLM's CPU engine sampling with its own bf16 GEMM against faircast's fp32-summed one (faircast_ds/vllm/cpu_gemm.py),
side by side in one run: for each setting an in-process ``LLM`` on SmolLM2-135M-Instruct's cached bf16 folder
generates 16 greedy answers of 16 tokens through the chat template, ``--batches`` times; the settings alternate
process by process (``--rounds``), so both see the same machine. Prints each batch's seconds, the medians and
their ratio, and whether the two settings' answers agree token for token (they need not: see docs/vllm.md).

    python benchmarks/engine_gemm.py [--rounds 1] [--batches 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [f"What is {a} + {b}?" for a, b in [(3, 4), (2, 5), (6, 1), (8, 9), (7, 7), (1, 2), (9, 3), (4, 5),
                                                  (5, 8), (2, 2), (6, 6), (3, 9), (8, 1), (4, 7), (1, 1), (9, 9)]]


def child(gemm: str, folder: str, batches: int) -> None:
    os.environ["FAIRCAST_VLLM_CPU_GEMM"] = gemm
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import time

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(folder)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    prompts = [{"prompt_token_ids": tok(t, add_special_tokens=False)["input_ids"]} for t in texts]
    llm = LLM(model=folder, dtype="bfloat16", enforce_eager=True, seed=0, kv_cache_memory_bytes=1 << 26,
              max_model_len=256, skip_tokenizer_init=True)
    params = SamplingParams(max_tokens=16, temperature=0, detokenize=False)
    seconds, tokens = [], None
    for _ in range(batches):
        began = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - began)
        tokens = [list(o.outputs[0].token_ids) for o in out]
    print("RESULT " + json.dumps({"gemm": gemm, "seconds": seconds, "tokens": tokens}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--child", choices=("native", "fp32"), help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from faircast_ds.models.pretrained import checkpoint

    folder = str(checkpoint("smollm2-135m-instruct"))
    if args.child:
        child(args.child, folder, args.batches)
        return
    runs: dict[str, list] = {"native": [], "fp32": []}
    tokens: dict[str, list] = {}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    for r in range(args.rounds):
        for gemm in ("native", "fp32") if r % 2 == 0 else ("fp32", "native"):
            out = subprocess.run([sys.executable, __file__, "--batches", str(args.batches), "--child", gemm],
                                 env=env, capture_output=True, text=True, cwd=ROOT)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if out.returncode or line is None:
                sys.exit(f"the {gemm} engine failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
            result = json.loads(line[len("RESULT "):])
            runs[gemm] += result["seconds"]
            tokens[gemm] = result["tokens"]
            print(f"round {r} {gemm:6}: " + ", ".join(f"{s:.2f} s" for s in result["seconds"]), flush=True)
    med = {g: statistics.median(v) for g, v in runs.items()}
    same = sum(a == b for a, b in zip(tokens["native"], tokens["fp32"]))
    print(f"16 greedy answers x 16 tokens, SmolLM2-135M-Instruct, {args.threads} threads: median native "
          f"{med['native']:.2f} s, fp32 {med['fp32']:.2f} s, fp32/native {med['fp32'] / med['native']:.2f}; "
          f"answers equal token for token: {same} of {len(QUESTIONS)}")


if __name__ == "__main__":
    main()
