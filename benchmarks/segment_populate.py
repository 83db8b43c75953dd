"""How a trainer rank should map the shared-memory staging segment before writing its pieces (issue 32: the
shm plane's ``shm.map`` stage), three ways side by side on one memfd of a model's served size:

- ``whole``: ``MAP_POPULATE`` the whole segment (what the writer does), then write this rank's share;
- ``own``: map without populating, ``madvise(MADV_POPULATE_WRITE)`` only this rank's share, then write it;
- ``lazy``: map without populating and let the write fault the pages in.

Each row gives the map (and populate) seconds, the write seconds and their sum: the best of ``--repeat``.
The segment's pages exist before (the engine made and filled it), as they do after the first push.
``--ranks 2``: that many processes at once, each writing its own share at its own offset (ZeRO-3 on two
ranks: every rank holds part of every parameter); the slower rank's seconds.
Needs Linux 5.14+ for ``MADV_POPULATE_WRITE`` (23; Python 3.11's ``mmap`` does not name it).

    python benchmarks/segment_populate.py [--mib 1137] [--ranks 2] [--repeat 5]
"""
from __future__ import annotations

import argparse
import mmap
import multiprocessing
import os
import time

import torch

MADV_POPULATE_WRITE = 23


def once(fd: int, nbytes: int, share: int, how: str, src: torch.Tensor, at: int = 0) -> tuple[float, float]:
    began = time.perf_counter()
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if how == "whole" else 0)
    mapped = mmap.mmap(fd, nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    if how == "own":
        mapped.madvise(MADV_POPULATE_WRITE, at, share)
    mapped_s = time.perf_counter() - began
    view = torch.frombuffer(mapped, dtype=torch.uint8)
    view[at:at + share].copy_(src)
    write_s = time.perf_counter() - began - mapped_s
    del view
    mapped.close()
    return mapped_s, write_s


def rank_worker(fd: int, nbytes: int, share: int, rank: int, hows: list[str], barrier, out) -> None:
    torch.set_num_threads(1)
    src = torch.full((share,), 7, dtype=torch.uint8)
    for how in hows:
        barrier.wait()
        out.put((rank, how, once(fd, nbytes, share, how, src, at=rank * share)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1137, help="segment size (default: Qwen3-0.6B's bf16 copy)")
    ap.add_argument("--ranks", type=int, default=2, help="writers at once, each its own 1/ranks of the bytes")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    nbytes = args.mib << 20
    share = nbytes // args.ranks // mmap.PAGESIZE * mmap.PAGESIZE
    fd = os.memfd_create("faircast-ds-populate-bench")
    try:
        os.ftruncate(fd, nbytes)
        engine = mmap.mmap(fd, nbytes)  # the engine's own mapping: every page made and written once
        torch.frombuffer(engine, dtype=torch.uint8).fill_(1)
        hows = ["whole", "own", "lazy"] * args.repeat  # interleaved, so drift touches every way alike
        ctx = multiprocessing.get_context("fork")
        barrier, out = ctx.Barrier(args.ranks), ctx.Queue()
        procs = [ctx.Process(target=rank_worker, args=(fd, nbytes, share, r, hows, barrier, out))
                 for r in range(args.ranks)]
        for proc in procs:
            proc.start()
        got = [out.get() for _ in range(args.ranks * len(hows))]
        for proc in procs:
            proc.join()
        rows: dict[str, list[tuple[float, float]]] = {how: [] for how in ("whole", "own", "lazy")}
        for how in rows:  # per repeat, the slower rank's map and write
            per_rank = [[t for r, h, t in got if r == rank and h == how] for rank in range(args.ranks)]
            rows[how] = [(max(ts[i][0] for ts in per_rank), max(ts[i][1] for ts in per_rank))
                         for i in range(args.repeat)]
        print(f"segment {args.mib} MiB, {args.ranks} writers at once, each {share / 2**20:.0f} MiB of it; "
              f"the slower writer's seconds, best of {args.repeat}, interleaved")
        print(f"{'mapping':<8} {'map s':>7} {'write s':>8} {'sum s':>7}")
        for how, runs in rows.items():
            m, w = min(r[0] for r in runs), min(r[1] for r in runs)
            s = min(r[0] + r[1] for r in runs)
            print(f"{how:<8} {m:7.3f} {w:8.3f} {s:7.3f}")
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
