"""A 2-rank ZeRO-3 trainer (CPU ranks, Fair Cast dither) pushing into a `vllm serve` process through the
`faircast` weight-transfer backend: rank 0 starts the server (VllmServer), every rank pushes (ServedPush:
vLLM's HTTPVLLMWeightSyncClient, the authenticated channel, dense then delta). Records, through
DeepSpeed's and vLLM's own interfaces, what the oracle side (tests/vllm_tests/test_vllm.py) checks: the fp32
masters and served bits (served_record.snapshot), vLLM's /weight_checker checksums and /weight_info
version after each push, and generations before and after the delta.

Usage: deepspeed --num_gpus 2 tests/dist/vllm_serve_worker.py   (OUT_DIR in the environment)
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
from common import batch, ds_config, finish_and_exit  # noqa: E402
from served_record import snapshot  # noqa: E402
from vllm_worker import KV_CACHE_GIB, MODEL, build  # noqa: E402

OUT = Path(os.environ["OUT_DIR"])
MODE, SEED = "dither", 1234


def report(r) -> dict:
    return {k: getattr(r, k) for k in ("version", "kind", "params", "params_total", "changed", "elements", "bytes",
                                       "seconds", "verify_seconds", "verified")}


def main() -> None:
    from faircast_ds.export import save_hf
    from faircast_ds.vllm.transfer import ServedPush, VllmServer

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    os.environ.setdefault("FAIRCAST_DS_SYNC_SECRET", "faircast-ds vllm serve test secret 0123456789")
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(MODE, seed=SEED, stage="zero3"))
    export = OUT / "export"
    save_hf(engine, export, version=0)  # every rank (gathers under ZeRO-3)
    out: dict = {"world": dist.get_world_size()}
    server = None
    if rank == 0:
        t0 = time.perf_counter()
        server = VllmServer(export, max_model_len=64, kv_cache_gib=KV_CACHE_GIB, log_path=OUT / "server.log")
        out["start_seconds"] = time.perf_counter() - t0
        out["version_at_start"] = server.weight_version()
    prompts = torch.randint(0, MODEL["vocab_size"], (16, 4), generator=torch.Generator().manual_seed(3))
    seeds = list(range(16))
    try:
        push = ServedPush(engine, server)
        for step in (0, 1):
            if step:
                x = batch(step, rank, vocab=MODEL["vocab_size"])
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()
            r = push.push(verify="full" if step == 0 else None)  # version = engine.global_steps
            check = push.last_check  # the first push read back whole, the next on sampled columns
            snap = snapshot(engine.module, step=engine.global_steps)  # every rank
            if rank == 0:
                tokens, logps = server.generate(prompts, 8, seeds)
                out[f"push{step}"] = {"report": report(r), "check": check, "version": server.weight_version(),
                                      "checksums": server.checksums(), "snapshot": snap,
                                      "tokens": tokens, "logprobs": logps}
        out["prompts"] = prompts
        push.close()
    finally:
        if server is not None:
            out["server_exit"] = server.close()
    if rank == 0:
        torch.save(out, OUT / "serve.pt")
    finish_and_exit(0)


if __name__ == "__main__":
    main()
