"""dist.post_and_gather: the store-based exchange that the attach pipeline agrees on the section with.
Two real gloo processes on loopback; one of them, in the second case, never posts (as a rank
without Fair Cast would not), and the other must name it after the bounded wait, not hang.

The store the two processes rendezvous through is served by the test process on a port the OS chose
(bound with port 0 and handed over): no free port is picked, released and raced for."""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch.distributed as tdist
import torch.multiprocessing as mp


def _worker(rank: int, port: int, out: str, silent_rank: int | None) -> None:
    from faircast_ds._util import dist

    # a client of the store the test process serves (on the port the OS gave it)
    store = tdist.TCPStore("127.0.0.1", port, world_size=2, is_master=False, timeout=timedelta(seconds=120))
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    from torch.distributed import distributed_c10d

    distributed_c10d._get_default_store().set_timeout(timedelta(seconds=4))  # what bounds the wait
    result: dict = {}
    try:
        if rank != silent_rank:
            result["first"] = {str(k): v for k, v in dist.post_and_gather("t", {"rank": rank}).items()}
            result["second"] = {str(k): v for k, v in dist.post_and_gather("t", [rank, "again"]).items()}
    except dist.RanksMissingError as exc:
        result["missing"], result["message"] = exc.missing, str(exc)
    if silent_rank is not None and rank != silent_rank:  # allow_missing: the ranks that posted, after wait_s
        result["allowed"] = {str(k): v for k, v in dist.post_and_gather("u", rank, wait_s=1, allow_missing=True).items()}
    if rank == 0:  # no store to post to: the MPI backend, and a placeholder store (what torch keeps for MPI)
        result["no_store"] = []
        for patch in ("backend", "placeholder"):
            saved = tdist.get_backend, distributed_c10d._get_default_store
            if patch == "backend":
                tdist.get_backend = lambda group=None: "mpi"
            else:
                distributed_c10d._get_default_store = lambda: tdist.Store()
            try:
                dist.post_and_gather("v", 1)
                result["no_store"].append(None)
            except dist.NoStoreError as exc:
                result["no_store"].append(str(exc))
            finally:
                tdist.get_backend, distributed_c10d._get_default_store = saved
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    tdist.barrier()  # the silent rank is alive and connected all along
    sys.stdout.flush()
    os._exit(0)


def _run(tmp_path, silent_rank):
    ctx = mp.get_context("spawn")
    store = tdist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=120))
    procs = [ctx.Process(target=_worker, args=(r, store.port, str(tmp_path), silent_rank)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(600)  # a liveness limit only (a hang ends here, not at the suite's timeout)
            assert p.exitcode == 0, f"a rank exited {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    del store
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_every_rank_gets_every_post_in_order(tmp_path):
    got = _run(tmp_path, None)
    for r in (0, 1):
        assert got[r]["first"] == {"0": {"rank": 0}, "1": {"rank": 1}}
        assert got[r]["second"] == {"0": [0, "again"], "1": [1, "again"]}  # a second post is a new exchange
    backend, placeholder = got[0]["no_store"]
    assert "the MPI backend has no store to post 'v' to" in backend
    assert "the default process group's store cannot hold 'v'" in placeholder


def test_a_rank_that_never_posts_is_named_after_the_bounded_wait(tmp_path):
    posting = _run(tmp_path, silent_rank=1)[0]
    assert posting["missing"] == [1], posting
    assert "ranks [1] posted no 't' within 4s" in posting["message"]  # the store's timeout (4 s) ended the wait
    assert posting["allowed"] == {"0": 0}  # allow_missing: after wait_s, the ranks that posted, no error
