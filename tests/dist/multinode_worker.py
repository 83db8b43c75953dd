"""The multi-node checks' training script (driven by tests/system/test_multinode.py under every launcher).

It reads nothing from the environment that a remote node would not have: everything comes as
arguments, since pdsh and MPI forward only a few variables. Each run does what its flags ask:

  --bits           (--config) deterministic fp32 masters (a function of parameter and index), lr 0, two steps;
                   rank 0 saves the served bits, to compare across topologies
  --save DIR       ZeRO-3 + error_feedback (--ckpt-config): three steps, checkpoint tag step3, then
                   steps 4-5; rank 0 saves snapshots after steps 3, 4, 5
  --load DIR TAG   load that universal checkpoint (same config, load_universal) into this topology;
                   snapshot right after the load, then steps 4-5 (same batches per rank as --save)
  --fail kill|stop (--config) after one step, node 1 dies (SIGKILL) or freezes (SIGSTOP); the other nodes go
                   on and must fail within --timeout-s

Every run writes topology_rank{R}.json (where each rank ran, how it found its rank) into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "launch"))

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
import torch  # noqa: E402
from checkpoint_worker import replay_ok, snapshot  # noqa: E402
from common import deterministic_master, finish, full_served_bits, tiny_qwen3, train_step, write_json  # noqa: E402
from preflight import exit_without_finalizing, report_nodes  # noqa: E402

from faircast_ds import get_fair_cast  # noqa: E402
from faircast_ds.casting.noise import name_id  # noqa: E402


def build(config_path: str, lr: float, **extra):
    with open(config_path) as f:
        config = json.load(f)
    config.update(extra)
    model = tiny_qwen3(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine, get_fair_cast(engine)


def topology(rank_env_given: bool) -> dict:
    addresses = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                               timeout=10).stdout.split("\n")
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "local_rank": int(os.environ["LOCAL_RANK"]),
            "host": socket.gethostname(), "node_rank": os.environ.get("CROSS_RANK"),
            "master_addr": os.environ["MASTER_ADDR"], "master_port": os.environ["MASTER_PORT"],
            "rank_from_launcher": rank_env_given, "ompi_rank": os.environ.get("OMPI_COMM_WORLD_RANK"),
            "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            "ipv4": sorted(line.split()[3] for line in addresses if line.strip()), "pid": os.getpid()}


def bits(config: str, out: str) -> None:
    engine, fc = build(config, lr=0.0)
    for _, master, _, slices in fc.adapter.flat_groups():
        for s in (s for s in slices if not s.is_padding):
            master.data[s.offset:s.offset + s.numel] = deterministic_master(name_id(s.name), s.start, s.numel)
    served = []
    for step in (1, 2):
        train_step(engine, step, engine.global_rank)
        served.append(full_served_bits(engine))
    nodes = report_nodes(engine)  # every node's local rank 0 says whether Fair Cast is on there
    if dist.get_rank() == 0:
        torch.save({"served": served, "nodes": nodes, "mode": fc.config.mode}, os.path.join(out, "bits.pt"))


def save(ckpt_config: str, root: str, out: str) -> None:
    engine, fc = build(ckpt_config, lr=1e-5)
    snaps = {}
    for step in range(1, 6):
        train_step(engine, step, engine.global_rank)
        if step == 3:
            engine.save_checkpoint(root, tag="step3")
        if step >= 3:
            snaps[step] = snapshot(engine, fc)
    if dist.get_rank() == 0:
        torch.save(snaps, os.path.join(out, "saved.pt"))


def load(ckpt_config: str, root: str, tag: str, out: str) -> None:
    engine, fc = build(ckpt_config, lr=1e-5, checkpoint={"load_universal": True})
    engine.load_checkpoint(root, tag=tag)
    snaps = {3: snapshot(engine, fc)}
    replay = {k: r.clone() for k, r in fc.caster.residuals.items()}
    exact = []
    for step in (4, 5):
        train_step(engine, step, engine.global_rank)
        exact.append(replay_ok(fc, replay))
        snaps[step] = snapshot(engine, fc)
    snaps["continued_exact"] = all(exact)
    if dist.get_rank() == 0:
        torch.save(snaps, os.path.join(out, "loaded.pt"))


def fail(config: str, how: str, out: str) -> None:
    engine, _ = build(config, lr=1e-5)
    train_step(engine, 1, engine.global_rank)
    dist.barrier()  # every node is past rendezvous and one step
    if os.environ.get("CROSS_RANK") == "1":
        with open(os.path.join(out, f"failing_rank{dist.get_rank()}.pid"), "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    started = time.monotonic()
    try:
        for step in range(2, 6):
            train_step(engine, step, engine.global_rank)
    finally:
        print(f"[multinode_worker] rank {dist.get_rank()}: stopped training {time.monotonic() - started:.1f}s after "
              "the failure point", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout-s", type=int, default=120, help="rendezvous and every collective")
    parser.add_argument("--config", help="the fair_cast DeepSpeed config of --bits and --fail")
    parser.add_argument("--bits", action="store_true")
    parser.add_argument("--ckpt-config", help="the config of --save and --load")
    parser.add_argument("--save", metavar="DIR")
    parser.add_argument("--load", nargs=2, metavar=("DIR", "TAG"))
    parser.add_argument("--fail", choices=["kill", "stop"])
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    rank_env_given = "RANK" in os.environ  # absent under openmpi: init_distributed asks mpi4py
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=args.timeout_s),
                               distributed_port=int(os.environ.get("MASTER_PORT", 29500)))
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, f"topology_rank{dist.get_rank()}.json"), topology(rank_env_given))
    if args.fail:
        fail(args.config, args.fail, args.out)
    if args.bits:
        bits(args.config, args.out)
    if args.save:
        save(args.ckpt_config, args.save, args.out)
    if args.load:
        load(args.ckpt_config, *args.load, args.out)
    rank = dist.get_rank()
    finish()
    print(f"[multinode_worker] rank {rank} finished", flush=True)
    exit_without_finalizing(0)


if __name__ == "__main__":
    main()
