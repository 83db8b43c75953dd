"""Served slices moved between two processes through lent bucket slots (issue 32 item 7), for
``benchmarks/gpu_check.py --ipc``: a trainer-rank process packs its slices into the engine process's two
slots (CUDA IPC on a GPU; the memfd stand-in with ``--device cpu``), the engine unpacks each bucket into its
staging buffer, and the control messages cross an authenticated channel (the same handshake and frames
as the weight planes). Timed against one device memcpy of the same bytes, and the staging buffer's bits
checked against a direct write of the same values.

    python benchmarks/gpu_check.py --ipc [--ipc-mib 1137] [--bucket-mib 256] [--device cuda|cpu]

One GPU is enough (both processes use device 0). NCCL sends between trainer and engine ranks need one GPU
per rank and are not in this part.
"""
from __future__ import annotations

import hashlib
import os
import socket
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from faircast_prepared import bucket_stream, buckets  # noqa: E402
from faircast_ds.export.channel import client_handshake, serve_handshake  # noqa: E402
from faircast_ds.export.plane import Layout, TensorSegment  # noqa: E402
from faircast_ds.export.served import ParamSpec  # noqa: E402

PARAMS = 64  # bf16 parameters the served bytes are split into
ROUNDS = 3  # streams timed after one warm-up stream


def layout_of(total_bytes: int) -> tuple[Layout, list[tuple[int, int, int]]]:
    """``PARAMS`` bf16 parameters of about ``total_bytes`` in all; this rank holds the second half of each
    (as a ZeRO-3 rank of two holds part of every parameter)."""
    per = max(2, total_bytes // PARAMS // 2)
    specs = [ParamSpec(f"layers.{i}.w", (per,), torch.bfloat16) for i in range(PARAMS)]
    return Layout.of(specs), [(i, per // 2, per - per // 2) for i in range(PARAMS)]


def values_of(pieces, device: str) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(7)
    return [torch.randn(n, generator=g, device=device).to(torch.bfloat16) for _, _, n in pieces]


def sharing_for(device: str) -> bucket_stream.SlotSharing:
    return bucket_stream.CudaIpcSharing(0) if device == "cuda" else bucket_stream.HostSharing()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def trainer(address: str, secret: bytes, total_bytes: int, bucket_bytes: int, device: str) -> None:
    """The trainer rank's process: open the slots, stream ROUNDS + 1 times, report its send seconds."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + address)
    ch = client_handshake(sock, secret, timeout=120.0, peer="engine")
    sharing = sharing_for(device)
    slots = bucket_stream.accept_slots(ch, sharing)
    layout, pieces = layout_of(total_bytes)
    values = values_of(pieces, device)
    plan = buckets.plan(layout, pieces, bucket_bytes)
    seconds = []
    for _ in range(ROUNDS + 1):
        ch.recv_json()  # "go"
        began = time.perf_counter()
        bucket_stream.send_buckets(ch, sharing, plan, values, slots, layout=layout, pieces=pieces)
        seconds.append(time.perf_counter() - began)
    ch.send_json({"type": "times", "seconds": seconds[1:]})
    ch.recv_json()
    for slot in slots:
        sharing.release(slot)
    ch.close()


def run(total_bytes: int, bucket_bytes: int, device: str) -> tuple[list[str], dict]:
    import multiprocessing

    secret = os.urandom(32)
    address = f"faircast-ds-gpu-buckets-{os.getpid()}-{os.urandom(4).hex()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + address)
    listener.listen(1)
    proc = multiprocessing.get_context("spawn").Process(
        target=trainer, args=(address, secret, total_bytes, bucket_bytes, device))
    proc.start()
    sharing = sharing_for(device)
    slots = [sharing.allocate(bucket_bytes) for _ in range(bucket_stream.SLOTS)]
    try:
        listener.settimeout(120.0)
        conn, _ = listener.accept()
        ch = serve_handshake(conn, secret, timeout=120.0, peer="trainer rank")
        bucket_stream.offer_slots(ch, sharing, slots)
        layout, pieces = layout_of(total_bytes)
        plan = buckets.plan(layout, pieces, bucket_bytes)
        staging = TensorSegment(torch.zeros(layout.nbytes, dtype=torch.uint8, device=device))
        seconds = []
        for _ in range(ROUNDS + 1):
            sync(device)
            ch.send_json({"type": "go"})
            began = time.perf_counter()
            moved = bucket_stream.receive_buckets(ch, sharing, plan, slots, segment=staging)
            sync(device)
            seconds.append(time.perf_counter() - began)
        sent = ch.recv_json()["seconds"]
        ch.send_json({"type": "done"})
        # the oracle: the same values written straight to their offsets, compared bit for bit
        want = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
        for (index, start, numel), v in zip(pieces, values_of(pieces, device)):
            at, nbytes = layout.span(index, start, numel)
            want.narrow(0, at, nbytes).copy_(v.view(torch.uint8))
        equal = bool(torch.equal(staging.flat, want))
        src = torch.empty(moved, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        memcpy = []
        for _ in range(ROUNDS + 1):
            sync(device)
            began = time.perf_counter()
            dst.copy_(src)
            sync(device)
            memcpy.append(time.perf_counter() - began)
        digest = hashlib.sha256(staging.flat.cpu().numpy().tobytes()).hexdigest()[:16]
    finally:
        proc.join(30)
        if proc.is_alive():  # a stream that failed on this side: the channel told the rank; do not wait on it
            proc.kill()
            proc.join(5)
        for slot in slots:
            sharing.release(slot)
        listener.close()
    best, floor = min(seconds[1:]), min(memcpy[1:])
    row = {"device": device, "sharing": sharing.kind, "bytes": moved, "bucket_bytes": bucket_bytes,
           "buckets": len(plan), "receive_s": best, "send_s": min(sent), "memcpy_s": floor,
           "gb_per_s": moved / best / 1e9, "memcpy_gb_per_s": moved / floor / 1e9, "bits_equal": equal,
           "staging_sha256_16": digest, "trainer_exit": proc.exitcode}
    lines = [f"bucket stream ({sharing.kind}, {device}): {moved / 2**20:.0f} MiB of served slices in {len(plan)} "
             f"buckets of {bucket_bytes / 2**20:.0f} MiB through {bucket_stream.SLOTS} lent slots, best of {ROUNDS}",
             f"  engine side {best * 1e3:.1f} ms = {row['gb_per_s']:.2f} GB/s; trainer side {min(sent) * 1e3:.1f} ms; "
             f"device memcpy of the same bytes {floor * 1e3:.1f} ms = {row['memcpy_gb_per_s']:.2f} GB/s; "
             f"stream / memcpy {best / floor:.2f}x",
             f"  staging bits equal to a direct write of the same values: {'yes' if equal else 'NO'}; trainer "
             f"process exit code {proc.exitcode}"]
    return lines, row
