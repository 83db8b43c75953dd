"""A trainer rank for the shared-memory plane's fault tests (tests/vllm_tests/transfer/test_vllm_faults.py), as its own
process so that it can be killed: ``python shm_trainer.py URL DIR VERSION... [--pause-rank R --pause-at N]``
with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (gloo; the ranks of a plain bf16 module, each
writing its even share of every parameter, as in tests/dist/fault_trainer.py).

Pushes each VERSION in turn through ``ServedPush(plane=PLANE)`` (:class:`~faircast_ds.vllm.transfer.served_push.ServedPush`;
``--plane``, default shm); rank 0 writes DIR/pushed-<v> (the report's kind and how many parameters it
carried) after each. ``--unchanged K`` then pushes K more versions with the bits left as they are. With ``--pause-rank R --pause-at N`` rank R stops inside the last
version's write after N slices (the others finish theirs and rank 0 commits), writes DIR/paused and
waits to be killed. A push that fails writes DIR/error-rank<r> with the message and exits 3.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fault_trainer as ft  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("dir", type=Path)
    parser.add_argument("versions", type=int, nargs="+")
    parser.add_argument("--pause-rank", type=int, default=None)
    parser.add_argument("--pause-at", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--plane", default="shm")
    parser.add_argument("--unchanged", type=int, default=0)
    args = parser.parse_args()
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    from faircast_ds.vllm.transfer import ServedPush

    model = ft.build_model()
    push = ServedPush(model, args.url if rank == 0 else None, plane=args.plane, timeout=args.timeout, verify=False)
    last = args.versions[-1]
    versions = [*args.versions, *range(last + 1, last + 1 + args.unchanged)]
    for i, version in enumerate(versions):
        if version <= last:
            ft.set_version(model, version)
        if i == len(versions) - 1 and rank == args.pause_rank:
            def hold(k: int) -> None:
                if k == args.pause_at:
                    (args.dir / "paused").write_text(str(version))
                    while True:  # until killed, holding the mapping mid-write
                        time.sleep(1)

            push.pause = hold
        try:
            report = push.push(version)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            (args.dir / f"error-rank{rank}").write_text(f"{type(exc).__name__}: {exc}")
            os._exit(3)
        if rank == 0:
            (args.dir / f"pushed-{version}").write_text(f"{report.kind} {report.params}")
    push.close()
    os._exit(0)


if __name__ == "__main__":
    main()
