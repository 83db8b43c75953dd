"""The engine push of ``python3 -m faircast_bench --model`` on the ranks of a ``deepspeed`` launch (started by
:mod:`faircast_bench.model`, not by hand): the real architecture under ZeRO-3 with one Fair Cast mode
pushes into a ``vllm serve`` process (the ``faircast`` weight-transfer backend, vLLM's HTTP endpoints,
verification in the engine's finish: its kernels read back) started on rank 0 from the model's own export.

Arguments (after the script): STEM MODEL LAYERS MODE LR [PLANE] (``shm``, the default, ``net``, ``group``, or
``netns``/``group-netns``: the net/group plane to a ``vllm serve`` in another network namespace, :func:`faircast_bench.model._launch_push`).
The pushes, each with its own version:

1. dense, verified (the engine's first update, checked whole; includes the first-use costs),
2. dense, not verified (the push alone),
3. dense, verified whole (after an unverified push; against 2: what a whole check costs),
4. dense, verified by the default later check (every matrix on sampled columns),
5. one optimizer step at LR, then a verified delta; 6. the same again;
7., 8. dense, verified by a sampled check of 32 and then 16 input columns per matrix (the default's 64 is
   push 4): what the width of the sample costs;
9.-12. one optimizer step before each of a dense push, a delta, a dense push, a delta (sampled checks): a
   delta against a dense push that, like it, follows a step (a step moves the engine's reload too).

The optimizer steps only move the weights between pushes (none is timed): the model's bf16 linear layers
multiply in fp32 and round once (:func:`faircast_ds.models.gemm.use_fp32_accumulation`), which on a CPU
without AVX-512 makes a step of Qwen3-0.6B about ten times cheaper than PyTorch's bf16 fallback; the push
reads the same served weights either way.

For each: the trainer's report (seconds, bytes on the channel, parameters walked = ZeRO-3 gathers,
changed elements, verification seconds) and the engine's (seconds receiving, seconds inside vLLM's
own ``reload_weights`` of the tensors it loaded). Then a memcpy floor: the same number of bf16 bytes
copied in 128 MiB pieces on rank 0. Rank 0 writes STEM.json.
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from typing import Any

PIECE = 64 << 20  # elements per memcpy piece (128 MiB of bf16)
# the cross-host row (PLANE "netns"): the engine's network namespace and its address there, set by the launch
ENGINE_NETNS, ENGINE_HOST = "FAIRCAST_DS_BENCH_ENGINE_NETNS", "FAIRCAST_DS_BENCH_ENGINE_HOST"
ENGINE_PORTS = (29771, 29772)  # vllm serve's HTTP port, the net plane's port: in a fresh namespace, nothing else listens


def memcpy_floor(elements: int, repeats: int = 3) -> float:
    """Seconds to copy ``elements`` bf16 values once, through two preallocated 128 MiB buffers."""
    import torch

    src = torch.ones(min(PIECE, elements), dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        t, left = time.perf_counter(), elements
        while left > 0:
            n = min(left, src.numel())
            dst[:n].copy_(src[:n])
            left -= n
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str]) -> None:
    args = [a for a in argv if not a.startswith("--local_rank")]
    stem, model_name, layers, mode, lr = args[:5]
    plane = args[5] if len(args) > 5 else "shm"
    layers, lr = int(layers), float(lr)
    import deepspeed
    import deepspeed.comm as dist
    import torch

    from faircast_bench.zero_init import real_causal_lm
    from faircast_ds.export import save_hf
    from faircast_bench.builders import real_config
    from faircast_ds.models.gemm import use_fp32_accumulation
    from faircast_bench.model_worker import (
        SEQUENCE,
        bench_config,
        finish,
        write_json,
    )
    from faircast_ds.vllm.transfer import ServedPush, VllmServer

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    if "FAIRCAST_DS_SYNC_SECRET" not in os.environ:  # one secret for every rank (the shm plane's ranks all prove it)
        from faircast_ds._util.dist import from_rank0

        os.environ["FAIRCAST_DS_SYNC_SECRET"] = from_rank0("faircast_bench push secret " + os.urandom(16).hex())
    cfg = bench_config(3, mode)
    model = real_causal_lm(model_name, layers=layers, seed=0, ds_config=cfg)
    use_fp32_accumulation(model)  # the steps between pushes only move weights: not timed, not pushed differently
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    vocab = real_config(model_name).vocab_size
    export = f"{stem}-export"
    where: dict[str, dict[str, Any]] = {"server": {}, "push": {"plane": plane}}
    if plane in ("netns", "group-netns"):  # vllm serve on the other host, the plane across the veth
        host = os.environ[ENGINE_HOST]
        where = {"server": {"host": host, "port": ENGINE_PORTS[0], "launcher": ["ip", "netns", "exec",
                                                                               os.environ[ENGINE_NETNS]]},
                 "push": {"plane": "net" if plane == "netns" else "group", "host": host, "port": ENGINE_PORTS[1]}}
    t = time.perf_counter()
    exported = save_hf(engine, export, version=0)
    export_s = time.perf_counter() - t
    out: dict[str, Any] = {"model": model_name, "layers": layers, "mode": mode, "lr": lr, "plane": plane,
                           "export_s": export_s,
                           "export_bytes": getattr(exported, "bytes", None), "pushes": []}
    server = None
    if rank == 0:
        t = time.perf_counter()
        server = VllmServer(export, max_model_len=SEQUENCE, kv_cache_gib=1 / 8, log_path=f"{stem}-server.log",
                            worker_extension=True, **where["server"])
        out["server_start_s"] = time.perf_counter() - t
    try:
        push = ServedPush(engine, server, **where["push"])
        default = push.check_columns
        plan = [("dense", True, 0, default), ("dense", False, 0, default), ("dense", True, 0, default),
                ("dense", True, 0, default), ("delta", True, 1, default), ("delta", True, 1, default),
                ("dense", True, 0, 32), ("dense", True, 0, 16), ("dense", True, 1, default), ("delta", True, 1, default),
                ("dense", True, 1, default), ("delta", True, 1, default)]
        for version, (kind, verify, steps, columns) in enumerate(plan):
            push.check_columns = columns
            for _ in range(steps):
                x = torch.randint(0, vocab, (1, SEQUENCE),
                                  generator=torch.Generator().manual_seed(1000 * version + rank))
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()
            check = ("full" if version in (0, 2) else True) if verify else False  # the first and third: whole
            r = push.push(version=version, verify=check, kind=kind)
            if rank == 0:
                row = {k: getattr(r, k) for k in ("version", "kind", "params", "params_total", "changed", "numel",
                                                  "elements", "bytes", "seconds", "gathers", "verify_seconds",
                                                  "verified", "stages", "http_calls", "collectives")}
                row["engine"] = server.engine_report()
                row["check"] = push.last_check
                row["check_columns"] = columns
                row["steps_before"] = steps
                out["pushes"].append(row)
                print(f"[bench] push {mode} v{version} {kind}{' ' + push.last_check + ' check' if verify else ' (unverified)'}: {r.seconds:.2f} s, "
                      f"{r.bytes / 2**20:.0f} MiB, {r.changed / r.numel:.2%} changed, engine load "
                      f"{row['engine'].get('load_seconds', float('nan')):.2f} s", flush=True)
        push.close()
    finally:
        if server is not None:
            out["server_exit"] = server.close()
    if rank == 0:
        numel = out["pushes"][0]["numel"]
        out["memcpy_s"] = memcpy_floor(numel)
        shutil.rmtree(export, ignore_errors=True)
        write_json(stem + ".json", out)
    finish()


if __name__ == "__main__":
    main(sys.argv[1:])
