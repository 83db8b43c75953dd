"""The data plane's transports side by side, without vLLM: how fast two trainer ranks put their served
slices into the engine's staging segment, against a plain copy of the same bytes.

    python benchmarks/data_plane.py [--mib 1137] [--repeats 3] [--transports shm net netns group] [--changed 0.005 0.04 0.2]

One engine-end process (:class:`~faircast_ds.vllm.transfer.segment.SegmentHost`) and two trainer-rank
processes (:class:`~faircast_ds.vllm.transfer.segment.SegmentWriter`), each rank holding half of every
parameter of a model of ``--mib`` MiB of bf16 (default: Qwen3-0.6B's served copy, in 8 parameters).
Per repeat: both ranks write a dense update, rank 0 commits; the time is rank 0's, from its ``begin``
until the engine confirmed the commit (so it covers the slower rank). Transports:

- ``shm``: one host, the memfd segment (each rank maps it and copies in);
- ``net``: the TCP transport on loopback (each rank sends its slices in authenticated 8 MiB frames);
- ``netns``: the same, the engine's end in one network namespace and the ranks in another, over a veth
  pair (needs root and iproute2; skipped otherwise);
- ``group``: each rank sends its slices by point-to-point sends in a gloo process group of the ranks
  and the engine, on loopback (no MAC over the bytes; :mod:`faircast_ds.export.send_group`; its deltas
  carry whole changed slices).

Then deltas that touch every parameter, a share of each rank's elements changed (``--changed``, evenly
spread): carried as whole changed slices, and (net plane) as each slice's changed elements (indices or
a bitmap, and values), side by side, with the bytes each sent.

Printed: the median seconds, GB/s and the ratio to ``memcpy`` (one ``copy_`` of the whole payload in this
process, median of the same repeats). Only the ratios are meant to be compared; the load average is
printed. Every process and namespace it makes is removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARAMS = 8

_COMMON = textwrap.dedent("""
    import json, sys, time, torch
    sys.path.insert(0, {root!r})
    from pathlib import Path
    from faircast_ds.export.served import ParamSpec
    out = Path({out!r})
    n = {numel}
    specs = [ParamSpec(f"p{{i}}.weight", (n,), torch.bfloat16) for i in range({params})]

    def wait(name, limit=600):
        deadline = time.monotonic() + limit
        while not (out / name).exists():
            assert time.monotonic() < deadline, name
            time.sleep(0.005)
""")

_HOST = _COMMON + textwrap.dedent("""
    from faircast_ds.vllm.transfer.segment import SegmentHost
    kw = dict(address=({addr!r}, {port}), group="gloo" if {group} else None) if {net} else dict(name={name!r})
    host = SegmentHost(specs, timeout=600, **kw)
    (out / "ready").write_text("1")
    for version in range(1, {versions} + 1):
        while host.ledger.commits < version:
            time.sleep(0.002)
        host.ledger.take(version)
        (out / f"seen{{version}}").write_text("1")
    wait("done")
    host.close()
""")

_RANK = _COMMON + textwrap.dedent("""
    from faircast_ds.casting import marks as M
    from faircast_ds.export import delta
    from faircast_ds.vllm.transfer.segment import SegmentWriter
    rank = {rank}
    half = n // 2
    g = torch.Generator().manual_seed(rank)
    shard = torch.randn({params} * half, generator=g).to(torch.bfloat16)
    slices = [(i, rank * half, shard[i * half:(i + 1) * half]) for i in range({params})]
    kw = dict(address=({addr!r}, {port}), group={group}) if {net} else {{}}
    wait("ready")
    w = SegmentWriter(None if {net} else {name!r}, specs, slices, rank=rank, world=2, session="bench",
                      timeout=600, **kw)
    w.connect()
    times = {{"dense": []}}
    sent = {{}}
    for version in range(1, {repeats} + 1):
        t = time.perf_counter()
        w.write(version, "dense", None, set(range({params})), {{}})
        if rank == 0:
            w.commit(version, None, {{}})
            times["dense"].append(time.perf_counter() - t)
        wait(f"seen{{version}}")
    # deltas: a share of each rank's elements changed (evenly spread), carried as whole changed slices
    # ("whole") or, on the net plane, as each slice's changed elements ("changes")
    bits = shard.view(torch.int16)
    for share in {shares}:
        for variant in ("whole", "changes"):
            key = f"{{variant}} {{share:g}}"
            times[key] = []
            for _ in range({repeats}):
                version += 1
                base = bits.clone()
                step = max(1, round(1 / share))
                bits[(version * 7 + rank) % step::step] += 1
                # the cast's change marks (1 bit per element), as Fair Cast leaves them between pushes
                marks = M.new_bitmap(bits.numel(), fill=False)
                M.or_mask(marks, 0, bits != base)
                counts = [M.count_range(marks, i * half, half) for i in range({params})]
                t = time.perf_counter()
                lists = {{}}  # as ServedPush builds them: where a change list is the smallest encoding
                if variant == "changes":
                    for k, (_, _, v) in enumerate(slices):
                        if delta.best(half, counts[k], 2) == delta.COO:
                            where = M.read_indices(marks, k * half, half)
                            lists[k] = (where.to(delta.index_dtype(half)), v.view(torch.int16)[where])
                w.write(version, "delta", version - 1, set(range({params})), {{}}, changes=lists)
                if rank == 0:
                    reply = w.commit(version, set(range({params})), {{}})
                    times[key].append(time.perf_counter() - t)
                    sent[key] = reply.get("sent")
                del base, marks
                wait(f"seen{{version}}")
    w.close()
    if rank == 0:
        (out / "times.json").write_text(json.dumps({{"times": times, "sent": sent}}))
""")


def run_transport(transport: str, args: argparse.Namespace, numel: int, hosts) -> dict | None:
    from faircast_ds.vllm.transfer.segment import socket_name

    out = Path(tempfile.mkdtemp(prefix=f"data-plane-{transport}-"))
    net = transport != "shm"
    addr = hosts.addr["worker-1"] if transport == "netns" else "127.0.0.1"
    port = 29741 if transport == "netns" else _free_port()
    fmt = dict(root=str(ROOT), out=str(out), numel=numel, params=PARAMS, repeats=args.repeats, net=net,
               group=transport == "group",
               addr=addr, port=port, name=socket_name(), shares=list(args.changed),
               versions=args.repeats * (1 + 2 * len(args.changed)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("FAIRCAST_DS_SYNC_SECRET", secrets.token_hex(16))

    def start(code: str, ns: str | None) -> subprocess.Popen:
        cmd = [sys.executable, "-c", code]
        if ns is not None:
            cmd = ["ip", "netns", "exec", ns] + cmd
        return subprocess.Popen(cmd, env=env, start_new_session=True)

    ns_host = hosts.netns["worker-1"] if transport == "netns" else None
    ns_rank = hosts.netns["worker-2"] if transport == "netns" else None
    procs = [start(_HOST.format(**fmt), ns_host)] + [start(_RANK.format(rank=r, **fmt), ns_rank) for r in (0, 1)]
    try:
        for p in procs[1:]:
            p.wait(timeout=1800)
        (out / "done").write_text("1")
        procs[0].wait(timeout=60)
        if any(p.returncode != 0 for p in procs):
            print(f"  {transport}: a process failed ({[p.returncode for p in procs]})", flush=True)
            return None
        return json.loads((out / "times.json").read_text())
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memcpy_times(nbytes: int, repeats: int) -> list[float]:
    import torch

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=1137.0, help="bf16 payload in MiB (default: Qwen3-0.6B's served copy)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transports", nargs="+", default=["shm", "net", "netns", "group"],
                    choices=["shm", "net", "netns", "group"])
    ap.add_argument("--changed", nargs="*", type=float, default=[0.005, 0.04, 0.2],
                    help="shares of elements a delta changes (default: 0.5%%, 4%%, 20%%; none: dense only)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    numel = int(args.mib * 2**20 / 2 / PARAMS) // 2 * 2  # elements per parameter (even: two halves)
    nbytes = numel * 2 * PARAMS
    print(f"{nbytes / 2**20:,.0f} MiB of bf16 in {PARAMS} parameters, 2 trainer-rank processes, median of "
          f"{args.repeats}; load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    copy = statistics.median(memcpy_times(nbytes, args.repeats))
    rows = [("memcpy (one copy_ in this process)", copy, nbytes)]
    deltas = []
    for transport in args.transports:
        hosts = None
        if transport == "netns":
            from faircast_bench.hosts import TwoHosts, available

            if not available():
                print("  netns: skipped (needs root and iproute2)")
                continue

            hosts = TwoHosts().__enter__()
        try:
            times = run_transport(transport, args, numel, hosts)
        finally:
            if hosts is not None:
                hosts.remove()
        if times:
            rows.append((transport, statistics.median(times["times"]["dense"]), nbytes))
            for share in args.changed:
                whole, changes = (statistics.median(times["times"][f"{v} {share:g}"]) for v in ("whole", "changes"))
                deltas.append((transport, share, whole, changes, times["sent"].get(f"{'whole'} {share:g}"),
                               times["sent"].get(f"changes {share:g}")))
    print(f"\ndense write + commit\n{'transport':<40}{'seconds':>10}{'GB/s':>10}{'x memcpy':>10}")
    for name, seconds, n in rows:
        print(f"{name:<40}{seconds:>10.3f}{n / seconds / 1e9:>10.2f}{seconds / copy:>10.1f}")
    if deltas:
        dense = {name: seconds for name, seconds, _ in rows}
        print("\ndelta write + commit, every parameter touched (a share of each rank's elements changed)\n"
              f"{'transport':<10}{'changed':>9}{'whole s':>10}{'changes s':>11}{'changes/whole':>15}"
              f"{'whole/dense':>13}{'MB whole':>10}{'MB changes':>12}")
        for transport, share, whole, changes, sent_whole, sent_changes in deltas:
            print(f"{transport:<10}{share:>9.1%}{whole:>10.3f}{changes:>11.3f}{changes / whole:>15.2f}"
                  f"{whole / dense[transport]:>13.2f}{(sent_whole or 0) / 1e6:>10.1f}{(sent_changes or 0) / 1e6:>12.1f}")
        print("(shm always copies whole changed slices: its 'changes' column is the same write)")
    print(f"\nload average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
