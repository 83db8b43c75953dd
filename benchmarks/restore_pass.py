"""The error-feedback restore's pass over a saved piece, timed side by side (issue 33 item 2).

A synthetic rank file of N elements (fp32 residual, int16 served bits, as ``faircast-ds/2`` stores
them) is memory-mapped in a fresh process, and the restore's pass (``_copy_verified``: CRC of each
chunk, the residual copied, the served bits compared and copied) is timed against its parts, and the
old compare (``(a != b).sum()``) against the one the pass uses (XOR, then a nonzero count).

    python benchmarks/restore_pass.py [--elements 85657216] [--threads 1]

Prints seconds per pass and ratios; the ranks of a real load run one thread each.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import zlib

import torch

from timing import best


def child(path: str, n: int, threads: int, repeat: int) -> None:
    from faircast_ds.shard import state

    torch.set_num_threads(threads)
    record = torch.load(path, mmap=True, weights_only=True)
    piece = state._Piece(0, n, record, 0, record["slices"][0], path)
    residual, served = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)
    first = time.perf_counter()
    state._copy_verified(piece, residual, served)  # the first touch of the mapped file, as in a load
    first = time.perf_counter() - first
    chunk = state._COPY_CHUNK
    res_all, bits_all = record["residual"], record["served"]
    out_bits = served.view(torch.int16)

    def parts(compare):
        def run():
            for at in range(0, n, chunk):
                k = min(chunk, n - at)
                compare(out_bits.narrow(0, at, k), bits_all.narrow(0, at, k))
        return run

    def crcs():
        for at in range(0, n, chunk):
            k = min(chunk, n - at)
            zlib.crc32(res_all.narrow(0, at, k).view(torch.uint8).numpy())
            zlib.crc32(bits_all.narrow(0, at, k).view(torch.uint8).numpy())

    timings = {
        "whole pass (first, fresh mapping)": first,
        "whole pass (again)": best(lambda: state._copy_verified(piece, residual, served), repeat),
        "CRC of both arrays": best(crcs, repeat),
        "compare: (a != b).sum()": best(parts(lambda a, b: int(torch.ne(a, b).sum())), repeat),
        "compare: count_nonzero(a ^ b)": best(parts(state._differing), repeat),
    }
    for what, s in timings.items():
        print(f"  {what:<36} {s:7.3f} s")
    old, new = timings["compare: (a != b).sum()"], timings["compare: count_nonzero(a ^ b)"]
    print(f"compare: the XOR count takes {new / old:.2f}x the old sum ({old - new:.3f} s less per pass of {n:,} "
          f"elements); the pass again: {timings['whole pass (again)']:.3f} s, CRC {timings['CRC of both arrays']:.3f} s of it")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=85_657_216, help="shard elements (default: Qwen3-0.6B, 1 layer, ZeRO-3 rank)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.elements, a.threads, a.repeat)
        return
    n = a.elements
    g = torch.Generator().manual_seed(0)
    residual = torch.randn(n, generator=g) * 1e-3
    bits = torch.randn(n, generator=g).to(torch.bfloat16).view(torch.int16)
    record = {"residual": residual, "served": bits,
              "slices": [{"name": "w", "start": 0, "numel": n,
                          "crc_residual": zlib.crc32(residual.view(torch.uint8).numpy()),
                          "crc_served": zlib.crc32(bits.view(torch.uint8).numpy())}]}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rank00000-of-00001.pt")
        torch.save(record, path)
        del residual, bits, record
        print(f"restore pass over {n:,} elements ({n * 6 / 2**20:,.0f} MiB of residual and served bits), "
              f"{a.threads} thread(s), best of {a.repeat}; load average {os.getloadavg()[0]:.2f}")
        subprocess.run([sys.executable, __file__, "--child", path, "--elements", str(n), "--threads",
                        str(a.threads), "--repeat", str(a.repeat)], check=True)


if __name__ == "__main__":
    main()
