"""Confirm that Fair Cast is active on every node of a job, before the real run.

Launch it exactly as you will launch training (same launcher, hostfile and DeepSpeed config):

    deepspeed --hostfile configs/hostfile.example launch/preflight.py --deepspeed_config configs/zero3_stochastic.json

It builds a small bf16 model under that config, runs one step, and every node's local rank 0
prints one line; rank 0 then prints a summary and the job exits non-zero if any rank lacks Fair
Cast. A training script can call ``report_nodes(engine)`` itself to print the same lines.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from datetime import timedelta
from typing import Any


def describe(engine: Any) -> dict[str, Any]:
    """This rank's view of a built engine: where it runs and what Fair Cast it has."""
    from faircast_ds import get_fair_cast

    fc = get_fair_cast(engine)
    return _where() | {
        "active": fc is not None,
        "mode": fc.config.mode if fc else None,
        "seed": fc.config.seed if fc else None,
        "zero_stage": fc.adapter.zero_stage if fc else None,
        "local_shard_elements": fc.adapter.local_numel() if fc else 0,
    }


def describe_before_initialize(config: dict[str, Any]) -> dict[str, Any]:
    """This rank's view before any engine exists: is Fair Cast loaded (the interpreter-start hook has
    wrapped DeepSpeed's engine), and which section would the engine get. Needs no collective of
    Fair Cast's, so a node without the package is named instead of hanging the job."""
    try:
        from faircast_ds.deepspeed.attachment import installed
    except ImportError:  # the package is missing on this node
        loaded = False
    else:
        loaded = installed()
    section, error = None, None
    if loaded:
        from faircast_ds.config import origin as config_origin
        from faircast_ds.config.section import FairCastConfigError

        try:  # a malformed section (or FAIRCAST_DS_CONFIG on this node) is reported, not raised past the gather
            resolved = config_origin.resolve(config)
        except FairCastConfigError as exc:
            error = " ".join(line.strip() for line in str(exc).splitlines())
        else:
            section = resolved.config if resolved is not None and resolved.config.enabled else None
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    return _where() | {
        "active": section is not None,
        "error": error if loaded else "Fair Cast is not loaded (faircast-ds missing, or FAIRCAST_DS_AUTOLOAD=0)",
        "mode": section.mode if section else None,
        "seed": section.seed if section else None,
        "zero_stage": zero.get("stage", 0),  # as written: HF configs may say "auto"
        "local_shard_elements": 0,
    }


def _where() -> dict[str, Any]:
    import deepspeed.comm as dist

    return {
        "host": socket.gethostname(),
        "node_rank": os.environ.get("CROSS_RANK"),  # set by DeepSpeed's per-node launcher; absent under MPI
        "rank": dist.get_rank(),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
    }


def report_nodes(engine: Any) -> list[dict[str, Any]]:
    """Print one ``[fair_cast] node ...`` line per node (from its local rank 0) and, on rank 0, a
    summary. A collective: call it on every rank. Returns every rank's description."""
    mine = describe(engine)
    everyone = _gather(mine)
    _print_nodes(mine, everyone)
    return everyone


def _gather(mine: dict[str, Any]) -> list[dict[str, Any]]:
    import deepspeed.comm as dist

    everyone: list[dict[str, Any]] = [{}] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _print_nodes(mine: dict[str, Any], everyone: list[dict[str, Any]]) -> None:
    if mine["local_rank"] == 0:
        here = [d for d in everyone if (d["host"], d["node_rank"]) == (mine["host"], mine["node_rank"])]
        inactive = [d["rank"] for d in here if not d["active"]]
        if inactive:
            why = sorted({d.get("error") or "no enabled fair_cast section" for d in here if not d["active"]})
            state = f"NOT active on ranks {inactive} ({'; '.join(why)})"
        else:
            state = f"active: mode={mine['mode']} zero_stage={mine['zero_stage']} seed={mine['seed']}"
        node = mine["host"] + (f" node_rank={mine['node_rank']}" if mine["node_rank"] is not None else "")
        print(f"[fair_cast] node {node} ranks {sorted(d['rank'] for d in here)}: {state}", flush=True)
    if mine["rank"] == 0:
        nodes = {(d["host"], d["node_rank"]) for d in everyone}
        n_active = sum(d["active"] for d in everyone)
        modes = sorted({str(d["mode"]) for d in everyone})
        print(f"[fair_cast] summary: active on {n_active}/{len(everyone)} ranks across {len(nodes)} nodes; "
              f"modes {modes}", flush=True)


def exit_without_finalizing(code: int) -> None:
    """Exit right away, after the process group is destroyed. Gloo's worker threads are still
    running after destroy_process_group() (the groups stay referenced, gc.collect() does not end
    them); one still releasing the last collective's tensors while Python finalizes aborts the
    process (SIGABRT after a clean run, seen under Open MPI). Finalizes MPI if mpi4py started it."""
    sys.stdout.flush()
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    os._exit(code)


def _tiny_model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(torch.bfloat16)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed_config", required=True, help="the DeepSpeed JSON of the real run")
    parser.add_argument("--timeout_s", type=int, default=300, help="bound on every collective and the rendezvous")
    parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    args = parser.parse_args()

    import deepspeed
    import deepspeed.comm as dist
    import torch

    deepspeed.init_distributed(timeout=timedelta(seconds=args.timeout_s),
                               distributed_port=int(os.environ.get("MASTER_PORT", 29500)))
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    # first without an engine: a rank without Fair Cast would not take part in its attach, so a
    # mixed job is reported here, before DeepSpeed builds anything
    mine = describe_before_initialize(config)
    everyone = _gather(mine)
    if not all(d["active"] for d in everyone):
        _print_nodes(mine, everyone)
        dist.barrier()
        torch.distributed.destroy_process_group()
        return 1
    model = _tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    x = torch.randn(int(config.get("train_micro_batch_size_per_gpu", 1)), 64, dtype=torch.bfloat16)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    everyone = report_nodes(engine)
    ok = all(d["active"] for d in everyone)
    dist.barrier()
    torch.distributed.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    exit_without_finalizing(main())
