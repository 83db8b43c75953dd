"""Flattened buckets (faircast_prepared.buckets) and the bucket stream's control plane with its CPU stand-in
(faircast_prepared.bucket_stream.HostSharing): what a GPU transport shares with the CPU path, driven here.

The oracle is a direct write: each piece's bytes copied to ``Layout.span`` of its parameter by this file's
own loop; streaming through buckets must leave the same bytes, and the plan must carry every element of every
piece exactly once, in order, inside its bucket's bounds and on its alignment.
"""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import re
import socket

import pytest
import torch

from faircast_prepared import bucket_stream, buckets
from faircast_ds.export.channel import client_handshake, serve_handshake
from faircast_ds.export.plane import HostSegment, Layout, PlaneError
from faircast_ds.export.served import ParamSpec

SECRET = b"bucket-test-secret-0123456789abcdef"
SPECS = [ParamSpec("embed.weight", (50, 16), torch.bfloat16), ParamSpec("norm.weight", (16,), torch.float32),
         ParamSpec("layers.0.w", (24, 16), torch.bfloat16), ParamSpec("head.b", (7,), torch.float32)]
# one rank's pieces: a part of the embedding, a whole vector, two parts of a matrix, a whole odd vector
PIECES = [(0, 100, 500), (1, 0, 16), (2, 0, 77), (2, 200, 184), (3, 0, 7)]


def values_for(layout: Layout, pieces, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(layout.specs[i].dtype) for i, _, n in pieces]


def direct(layout: Layout, pieces, values) -> bytes:
    """The oracle: each piece's raw bytes at its parameter's offset, by hand."""
    out = bytearray(layout.nbytes)
    for (index, start, numel), v in zip(pieces, values):
        size = v.element_size()
        at = layout.offsets[index] + start * size
        out[at:at + numel * size] = v.contiguous().view(torch.uint8).numpy().tobytes()
    return bytes(out)


@pytest.mark.parametrize("bucket_bytes", (4, 64, 100, 1000, 1 << 20))
@pytest.mark.parametrize("align", (1, 64))
def test_the_plan_carries_every_element_once_within_bounds(bucket_bytes, align):
    layout = Layout.of(SPECS)
    plan = buckets.plan(layout, PIECES, bucket_bytes, align)
    carried = {k: [] for k in range(len(PIECES))}
    for b in plan:
        assert 0 < b.nbytes <= bucket_bytes
        ends = 0
        for c in b.copies:
            assert c.bucket_offset % align == 0 and c.bucket_offset >= ends  # aligned, no overlap, in order
            ends = c.bucket_offset + c.nbytes
            index, start, _ = PIECES[c.piece]
            size = 2 if SPECS[index].dtype == torch.bfloat16 else 4
            assert c.nbytes == c.numel * size
            assert c.segment_offset == layout.offsets[index] + (start + c.element) * size
            carried[c.piece].append((c.element, c.numel))
        assert ends == b.nbytes
    for k, (_, _, numel) in enumerate(PIECES):  # each piece's elements, in order, exactly once
        at = 0
        for element, n in carried[k]:
            assert element == at and n > 0
            at += n
        assert at == numel
    if bucket_bytes >= 1 << 20:
        assert len(plan) == 1  # everything fits one bucket


@pytest.mark.parametrize("bucket_bytes", (4, 100, 1000, 1 << 20))
def test_packing_and_unpacking_every_bucket_writes_what_a_direct_write_does(bucket_bytes):
    layout = Layout.of(SPECS)
    values = values_for(layout, PIECES)
    segment = HostSegment(bytearray(layout.nbytes), layout.nbytes)
    slot = torch.full((bucket_bytes,), 0xAB, dtype=torch.uint8)  # stale bytes from an earlier bucket
    written = 0
    for b in buckets.plan(layout, PIECES, bucket_bytes):
        buckets.pack(b, values, slot)
        written += buckets.unpack(b, slot, segment)
    assert bytes(segment.flat.numpy().tobytes()) == direct(layout, PIECES, values)
    assert written == sum(v.numel() * v.element_size() for v in values)


def test_bad_plans_and_buffers_are_refused():
    layout = Layout.of(SPECS)
    for bad in (0, -8, 2.5, "64"):
        with pytest.raises(ValueError, match="bucket_bytes must be a positive integer"):
            buckets.plan(layout, PIECES, bad)
    with pytest.raises(ValueError, match="align must be a power of two"):
        buckets.plan(layout, PIECES, 64, align=48)
    with pytest.raises(ValueError, match="bucket_bytes 2 cannot hold one 4-byte element"):
        buckets.plan(layout, [(1, 0, 16)], 2)
    with pytest.raises(ValueError, match=r"head\.b: elements \[5, 9\) outside \[0, 7\)"):
        buckets.plan(layout, [(3, 5, 4)], 64)
    plan = buckets.plan(layout, PIECES, 256)
    with pytest.raises(ValueError, match="a bucket buffer is 1-D uint8 of at least"):
        buckets.pack(plan[0], values_for(layout, PIECES), torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(PlaneError, match=r"norm\.weight \[0, 16\): values are torch.bfloat16 x 16, the layout says "
                                         r"torch.float32 x 16"):
        buckets.check_values(layout, PIECES, [v.to(torch.bfloat16) if i == 1 else v
                                              for i, v in enumerate(values_for(layout, PIECES))])
    with pytest.raises(PlaneError, match="4 value tensors for 5 pieces"):
        buckets.check_values(layout, PIECES, values_for(layout, PIECES)[:4])


# ---- the stream between two processes, over an authenticated channel, through the CPU stand-in -------------

def _trainer(sock: socket.socket, bucket_bytes: int, misbehave: str | None) -> None:
    """A trainer rank in a child process: open the engine's slots, stream its pieces."""
    code = 0
    try:
        ch = client_handshake(sock, SECRET, timeout=30.0, peer="engine")
        sharing = bucket_stream.HostSharing()
        slots = bucket_stream.accept_slots(ch, sharing)
        layout = Layout.of(SPECS)
        values = values_for(layout, PIECES, seed=1)
        plan = buckets.plan(layout, PIECES, bucket_bytes)
        if misbehave == "out_of_order":
            buckets.pack(plan[1], values, slots[1])
            ch.send_json({"type": "filled", "bucket": 1, "slot": 1, "bytes": plan[1].nbytes})
        elif misbehave == "wrong_slot":
            buckets.pack(plan[0], values, slots[1])
            ch.send_json({"type": "filled", "bucket": 0, "slot": 1, "bytes": plan[0].nbytes})
        else:
            bucket_stream.send_buckets(ch, sharing, plan, values, slots, layout=layout, pieces=PIECES)
        ch.recv_json(timeout=30.0)  # the engine's verdict; then leave
    except Exception:  # noqa: BLE001 - the parent's assertions say what went wrong
        code = 1
    finally:
        os._exit(code)


def _engine(bucket_bytes: int, misbehave: str | None = None, slots: int = 2):
    """The engine in this process: lend slots, receive the stream into a host segment. Returns (bytes
    received or the engine's PlaneError, the segment's bytes, the trainer process's exit code)."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = multiprocessing.get_context("fork").Process(target=_trainer, args=(child, bucket_bytes, misbehave))
    proc.start()
    child.close()
    sharing = bucket_stream.HostSharing()
    lent = [sharing.allocate(bucket_bytes) for _ in range(slots)]
    try:
        ch = serve_handshake(parent, SECRET, timeout=30.0, peer="trainer rank 0")
        bucket_stream.offer_slots(ch, sharing, lent)
        layout = Layout.of(SPECS)
        segment = HostSegment(bytearray(layout.nbytes), layout.nbytes)
        try:
            got = bucket_stream.receive_buckets(ch, sharing, buckets.plan(layout, PIECES, bucket_bytes), lent,
                                                segment=segment)
            ch.send_json({"type": "done"})
        except PlaneError as exc:  # the channel is closed with the reason: the trainer stops waiting
            got = exc
        proc.join(30)
        return got, bytes(segment.flat.numpy().tobytes()), proc.exitcode
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        for slot in lent:
            sharing.release(slot)
        parent.close()


@pytest.mark.parametrize("bucket_bytes", (96, 4096))
def test_a_trainer_process_streams_its_pieces_through_two_lent_slots(bucket_bytes):
    layout = Layout.of(SPECS)
    values = values_for(layout, PIECES, seed=1)
    assert len(buckets.plan(layout, PIECES, bucket_bytes)) > 2 or bucket_bytes == 4096  # slots are reused
    got, segment, trainer_exit = _engine(bucket_bytes)
    assert trainer_exit == 0  # the trainer's side finished too: every slot freed back to it
    assert segment == direct(layout, PIECES, values)
    assert got == sum(v.numel() * v.element_size() for v in values)
    assert hashlib.sha256(segment).digest() != hashlib.sha256(bytes(layout.nbytes)).digest()


@pytest.mark.parametrize("misbehave, message", [
    ("out_of_order", r"expected bucket 0 filled in slot 0 \(\d+ bytes\), got \{'type': 'filled', 'bucket': 1"),
    ("wrong_slot", r"expected bucket 0 filled in slot 0 \(\d+ bytes\), got \{'type': 'filled', 'bucket': 0, 'slot': 1"),
])
def test_a_stream_out_of_plan_is_refused(misbehave, message):
    got, _, trainer_exit = _engine(96, misbehave)
    assert isinstance(got, PlaneError)
    assert re.search(message, str(got))
    assert trainer_exit == 1  # told by the closed channel, not left waiting for a free slot until its timeout


def test_slot_descriptions_are_checked_before_use():
    sharing = bucket_stream.HostSharing()
    slot = sharing.allocate(128)
    try:
        desc = sharing.export(slot)
        with pytest.raises(PlaneError, match="a bucket slot of kind 'cuda_ipc' offered to a 'host' transport"):
            sharing.open(dict(desc, kind="cuda_ipc"))
        with pytest.raises(PlaneError, match=r"'fd' must be a non-negative int, got '7'"):
            sharing.open(dict(desc, fd="7"))
        with pytest.raises(PlaneError, match="holds fewer than the 4096 bytes it declared"):
            sharing.open(dict(desc, nbytes=4096))
        opened = sharing.open(desc)  # the same memory, seen through the rank's own mapping
        opened[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert slot[:4].tolist() == [1, 2, 3, 4]
        sharing.release(opened)
    finally:
        sharing.release(slot)


def test_a_cuda_ipc_slot_description_is_checked_before_any_cuda_call():
    """The GPU transport's own checks run without a GPU: a description of another kind or with a field of the
    wrong type is refused before torch rebuilds anything from it."""
    sharing = bucket_stream.CudaIpcSharing(device=0)
    good = {"kind": "cuda_ipc", "device": 0, "handle": "00" * 64, "storage_size_bytes": 1 << 20,
            "storage_offset_bytes": 0, "ref_counter_handle": "ab", "ref_counter_offset": 0, "event_handle": "11" * 64,
            "event_sync_required": True, "nbytes": 1 << 20}
    with pytest.raises(PlaneError, match="a bucket slot of kind 'host' offered to a 'cuda_ipc' transport"):
        sharing.open(dict(good, kind="host"))
    with pytest.raises(PlaneError, match=r"'handle' must be a str, got b'\\x00'"):
        sharing.open(dict(good, handle=b"\0"))
    with pytest.raises(PlaneError, match=r"'nbytes' must be a non-negative int, got -1"):
        sharing.open(dict(good, nbytes=-1))
    with pytest.raises(PlaneError, match=r"'event_sync_required' must be a bool, got 1"):
        sharing.open(dict(good, event_sync_required=1))
    with pytest.raises(PlaneError, match=r"'handle' is not hex"):
        sharing.open(dict(good, handle="zz"))
    with pytest.raises(PlaneError, match=r"'event_handle' holds 0 bytes, a CUDA IPC handle 64"):
        sharing.open(dict(good, event_handle=""))
    with pytest.raises(PlaneError, match=r"bucket slot on cuda:1, this transport's device is cuda:0"):
        sharing.open(dict(good, device=1))
    with pytest.raises(PlaneError, match=r"1048576 bytes at offset 4096 of a 2097152-byte allocation; a slot is a "
                                         r"whole allocation of its own"):
        sharing.open(dict(good, storage_offset_bytes=4096, storage_size_bytes=2 << 20))  # its neighbours too
    with pytest.raises(PlaneError, match=r"0 bytes at offset 0"):
        sharing.open(dict(good, nbytes=0, storage_size_bytes=0))  # torch would build fresh private memory


def test_a_cuda_ipc_slot_round_trips_through_json_to_torchs_own_rebuild(monkeypatch):
    """export() takes torch's IPC reduction apart into JSON and open() hands rebuild_cuda_tensor the same
    fields in torch's order (both torch calls replaced by recorders: no GPU here)."""
    import json

    import torch.multiprocessing.reductions as reductions

    slot = torch.zeros(4096, dtype=torch.uint8)
    handle, ref, event = bytes(range(64)), b"refcounter-file", bytes(range(64, 128))
    torch_args = (torch.Tensor, slot.size(), slot.stride(), 0, torch.storage.TypedStorage, torch.uint8, 0, handle,
                  4096, 0, False, ref, 128, event, True)
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (reductions.rebuild_cuda_tensor, torch_args))
    seen = []
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *args: seen.append(args) or slot)
    sharing = bucket_stream.CudaIpcSharing(device=0)
    desc = json.loads(json.dumps(sharing.export(slot)))  # what crosses the channel
    assert sharing.open(desc) is slot
    assert seen == [(torch.Tensor, (4096,), (1,), 0, torch.storage.TypedStorage, torch.uint8, 0, handle, 4096, 0,
                     False, ref, 128, event, True)]
    shared = list(torch_args)
    shared[9] = 2048  # a slot carved out of a larger allocation: the handle would give away its neighbours
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (reductions.rebuild_cuda_tensor, tuple(shared)))
    with pytest.raises(PlaneError, match="a bucket slot must be a whole 1-D uint8 allocation of its own"):
        sharing.export(slot)


def test_host_slots_outlive_their_release_while_a_view_is_alive_and_only_bucket_memfds_open(tmp_path):
    sharing = bucket_stream.HostSharing()
    slot = sharing.allocate(4096)
    desc = sharing.export(slot)
    view = sharing.open(desc)[:8]
    sharing.release(slot)
    del slot
    view[:] = 5  # the mapping is still there (it used to be unmapped under a live view: a crash)
    assert view.tolist() == [5] * 8
    with open(tmp_path / "other", "wb") as f:
        f.write(b"x" * 8192)
        f.flush()
        with pytest.raises(PlaneError, match=r"is not a bucket memfd \(.*other\)"):
            sharing.open(dict(desc, fd=f.fileno()))


def test_slots_smaller_than_the_plans_buckets_are_refused_before_anything_moves():
    layout = Layout.of(SPECS)
    plan = buckets.plan(layout, PIECES, 256)
    small = [torch.zeros(256, dtype=torch.uint8), torch.zeros(128, dtype=torch.uint8)]
    segment = HostSegment(bytearray(layout.nbytes), layout.nbytes)

    class Channel:  # records the reason the stream gives its peer
        reason = None

        def close(self, reason=None):
            self.reason = reason

    message = r"bucket slots of \[128\] bytes cannot hold the plan's largest bucket \(2\d\d bytes\)"
    sender, receiver = Channel(), Channel()
    with pytest.raises(ValueError, match=message):
        bucket_stream.send_buckets(sender, bucket_stream.HostSharing(), plan, values_for(layout, PIECES), small)
    with pytest.raises(ValueError, match=message):
        bucket_stream.receive_buckets(receiver, bucket_stream.HostSharing(), plan, small, segment=segment)
    assert sender.reason.startswith("bucket stream stopped on the trainer's side: bucket slots of [128] bytes")
    assert receiver.reason.startswith("bucket stream stopped on the engine's side: bucket slots of [128] bytes")
    assert not any(segment.flat.tolist())  # nothing written


def test_gpu_check_bucket_part_dry_run(tmp_path):
    """benchmarks/gpu_check.py --ipc on the CPU stand-in: two processes, the staging bits equal a direct write
    (the device run uses CUDA IPC slots through the same code)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--numel", "1e4",
                          "--repeats", "1", "--ipc", "--ipc-mib", "16", "--bucket-mib", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bucket stream (host, cpu): 8 MiB of served slices in 4 buckets of 2 MiB through 2 lent slots" in out.stdout
    assert "staging bits equal to a direct write of the same values: yes" in out.stdout
