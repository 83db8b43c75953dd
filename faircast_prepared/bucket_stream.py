"""Streaming a rank's served slices through bucket slots the engine lends (issue 32 item 7): the control
plane on the authenticated channel, the bytes in shared buffers, and the one small interface behind which
the GPU-only calls sit.

**Prepared GPU code, out of the push path.** No push imports this module (``tests/test_layout.py`` checks
that no module of ``faircast_ds/vllm/`` does, nor any module a push loads): it is the shape a GPU transport
would take, run today only by ``benchmarks/gpu_buckets.py``, ``benchmarks/gpu_check.py`` and
``tests/export/test_buckets.py``. The pushes into ``vllm serve`` stage the whole model instead
(:mod:`faircast_ds.vllm.transfer.planes`).

**Slots.** The engine allocates a few bucket buffers (two by default: one is filled while the other is
drained) and describes each to an authenticated trainer rank (:meth:`SlotSharing.export`, a JSON-able
dict sent as a channel message, never pickled); the rank opens them (:meth:`SlotSharing.open`). Holding
a slot is the capability, as holding the segment's descriptor is on the shared-memory plane, so a slot is
described only on a channel whose handshake succeeded.

- :class:`CudaIpcSharing`: device memory shared by CUDA IPC (one node). The description carries the
  fields of torch's own IPC reduction, bytes hex-encoded; opening rebuilds the tensor from them.
  ``fence`` synchronizes the current stream, so the peer never reads a bucket the copy is still writing.
  It needs a GPU; no GPU was lent while it was written, so it is exercised only by
  ``benchmarks/gpu_check.py --ipc`` on a device (docs/vllm.md says so).
- :class:`HostSharing`: the CPU stand-in the tests drive: each slot a ``memfd`` mapped by the engine,
  opened by the rank through ``/proc/<pid>/fd/<fd>`` (same host, same user). It is the tests' stand-in,
  not a transport: on a CPU engine the shared-memory plane stages the whole model instead.

**The stream.** Both ends hold the same :func:`~faircast_prepared.buckets.plan`. The rank packs bucket
``b`` into slot ``b mod slots`` (after the engine freed it), fences, and sends ``filled``; the engine
checks the bucket number and slot, hands the slot to its consumer (unpacking into a staging segment, or
loading the tensors it carries), fences, and sends ``free``. A message out of order, a slot other than
the plan's, or a bucket the plan does not have ends the stream with :class:`PlaneError`; the engine's
consumer has then seen only whole buckets, and the model changes only at a commit (the ledger's rule).
"""
from __future__ import annotations

import mmap
import os
from typing import Any, Callable, Protocol, Sequence

import torch

from faircast_prepared.buckets import Bucket, check_values, pack, unpack
from faircast_ds.export.channel import Channel
from faircast_ds.export.plane import Layout, PlaneError, Segment

SLOTS = 2  # bucket buffers per rank: one filled while the other is drained
MEMFD_NAME = "faircast-ds-bucket"  # the stand-in's slots (a rank opens nothing else)
IPC_HANDLE_BYTES = 64  # a CUDA IPC memory or event handle (cudaIpcMemHandle_t, cudaIpcEventHandle_t)


class SlotSharing(Protocol):
    """The GPU-only calls of a bucket transport (and their CPU stand-in)."""

    kind: str

    def allocate(self, nbytes: int) -> torch.Tensor:
        """The engine's side: a uint8 slot of ``nbytes``."""

    def export(self, slot: torch.Tensor) -> dict[str, Any]:
        """The engine's side: a JSON-able description of ``slot``, for an authenticated peer only."""

    def open(self, desc: dict[str, Any]) -> torch.Tensor:
        """The rank's side: the engine's slot as a writable uint8 tensor."""

    def fence(self) -> None:
        """Everything this process queued on its slots is done (before telling the peer)."""

    def release(self, slot: torch.Tensor) -> None:
        """Drop this process's hold on a slot."""


class HostSharing:
    """CPU stand-in for the tests: a memfd per slot, opened through ``/proc/<pid>/fd/<fd>``."""

    kind = "host"

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # id(slot) -> the engine's descriptor

    def allocate(self, nbytes: int) -> torch.Tensor:
        fd = os.memfd_create(MEMFD_NAME)
        try:
            os.ftruncate(fd, nbytes)
            return self._map(fd, nbytes, own=True)
        except BaseException:
            os.close(fd)
            raise

    def _map(self, fd: int, nbytes: int, *, own: bool) -> torch.Tensor:
        try:
            mapped = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            if not own:
                os.close(fd)  # the mapping keeps the memory
        # the tensor holds the mmap object: the mapping lives as long as any view of the slot (never closed
        # by hand, which would unmap memory a live view still points at)
        slot = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes)
        if own:
            self._fds[id(slot)] = fd
        return slot

    def export(self, slot: torch.Tensor) -> dict[str, Any]:
        return {"kind": self.kind, "pid": os.getpid(), "fd": self._fds[id(slot)], "nbytes": slot.numel()}

    def open(self, desc: dict[str, Any]) -> torch.Tensor:
        _expect(desc, self.kind, {"pid": int, "fd": int, "nbytes": int})
        if desc["nbytes"] == 0:
            raise PlaneError("bucket slot description: 'nbytes' must be positive")
        path = f"/proc/{desc['pid']}/fd/{desc['fd']}"
        try:
            target = os.readlink(path)
            if not target.startswith(f"/memfd:{MEMFD_NAME}"):  # only ever a slot, never another open file
                raise PlaneError(f"the engine's bucket slot {path} is not a bucket memfd ({target})")
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise PlaneError(f"cannot open the engine's bucket slot: {exc}") from None
        if os.fstat(fd).st_size < desc["nbytes"]:
            os.close(fd)
            raise PlaneError(f"the engine's bucket slot holds fewer than the {desc['nbytes']} bytes it declared")
        return self._map(fd, desc["nbytes"], own=False)

    def fence(self) -> None:
        pass  # a CPU copy is done when it returns

    def release(self, slot: torch.Tensor) -> None:
        fd = self._fds.pop(id(slot), None)
        if fd is not None:
            os.close(fd)  # the memory goes when the last mapping (the last view of the slot) does


class CudaIpcSharing:
    """Device memory shared by CUDA IPC between processes of one node. Needs a GPU (not run in CI)."""

    kind = "cuda_ipc"
    _FIELDS = {"device": int, "handle": str, "storage_size_bytes": int, "storage_offset_bytes": int,
               "ref_counter_handle": str, "ref_counter_offset": int, "event_handle": str,
               "event_sync_required": bool, "nbytes": int}

    def __init__(self, device: int | None = None) -> None:
        self.device = torch.cuda.current_device() if device is None else int(device)
        self._pools: dict[int, Any] = {}

    def allocate(self, nbytes: int) -> torch.Tensor:
        # A CUDA IPC handle names the whole allocation a tensor sits in, not the tensor: a slot carved out of
        # the caching allocator's shared segments would hand the rank its neighbours too. Each slot gets a
        # private pool, so its allocation holds nothing else; export refuses a slot not at its start.
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool, device=self.device):
            slot = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{self.device}")
        self._pools[id(slot)] = pool
        return slot

    def export(self, slot: torch.Tensor) -> dict[str, Any]:
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(slot)
        # torch's rebuild_cuda_tensor arguments: (cls, size, stride, offset, storage_cls, dtype, device, handle,
        # storage_size_bytes, storage_offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset,
        # event_handle, event_sync_required); only the device-memory fields travel, the rest is fixed here
        (_, size, stride, offset, _, dtype, device, handle, storage_size, storage_offset, _, ref_handle,
         ref_offset, event_handle, event_sync) = args
        if dtype != torch.uint8 or tuple(size) != (slot.numel(),) or tuple(stride) != (1,) or offset != 0 \
                or storage_offset != 0 or storage_size != slot.numel():
            raise PlaneError("a bucket slot must be a whole 1-D uint8 allocation of its own")
        return {"kind": self.kind, "device": int(device), "handle": bytes(handle).hex(),
                "storage_size_bytes": int(storage_size), "storage_offset_bytes": int(storage_offset),
                "ref_counter_handle": bytes(ref_handle).hex(), "ref_counter_offset": int(ref_offset),
                "event_handle": bytes(event_handle).hex(),
                "event_sync_required": bool(event_sync), "nbytes": slot.numel()}

    def open(self, desc: dict[str, Any]) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        _expect(desc, self.kind, self._FIELDS)
        handles = {}
        for name in ("handle", "ref_counter_handle", "event_handle"):
            try:
                handles[name] = bytes.fromhex(desc[name])
            except ValueError:
                raise PlaneError(f"bucket slot description: {name!r} is not hex") from None
        for name in ("handle", "event_handle"):
            if len(handles[name]) != IPC_HANDLE_BYTES:
                raise PlaneError(f"bucket slot description: {name!r} holds {len(handles[name])} bytes, a CUDA IPC "
                                 f"handle {IPC_HANDLE_BYTES}")
        if not handles["ref_counter_handle"]:
            raise PlaneError("bucket slot description: 'ref_counter_handle' is empty")
        if desc["device"] != self.device:
            raise PlaneError(f"bucket slot on cuda:{desc['device']}, this transport's device is cuda:{self.device}")
        if not 0 < desc["nbytes"] == desc["storage_size_bytes"] or desc["storage_offset_bytes"] != 0:
            raise PlaneError(f"bucket slot description: {desc['nbytes']} bytes at offset "
                             f"{desc['storage_offset_bytes']} of a {desc['storage_size_bytes']}-byte allocation; a "
                             "slot is a whole allocation of its own")
        return rebuild_cuda_tensor(
            torch.Tensor, (desc["nbytes"],), (1,), 0, torch.storage.TypedStorage, torch.uint8, desc["device"],
            handles["handle"], desc["storage_size_bytes"], desc["storage_offset_bytes"], False,
            handles["ref_counter_handle"], desc["ref_counter_offset"], handles["event_handle"],
            desc["event_sync_required"])

    def fence(self) -> None:
        torch.cuda.synchronize(self.device)  # every stream of the device: a loader may copy on its own

    def release(self, slot: torch.Tensor) -> None:
        self._pools.pop(id(slot), None)  # the pool goes with the slot's last reference


def _expect(desc: Any, kind: str, fields: dict[str, type]) -> None:
    """A slot description from the peer: its kind and every field's type, before any of it is used."""
    if not isinstance(desc, dict) or desc.get("kind") != kind:
        got = desc.get("kind") if isinstance(desc, dict) else type(desc).__name__
        raise PlaneError(f"a bucket slot of kind {got!r} offered to a {kind!r} transport")
    for name, t in fields.items():
        value = desc.get(name)
        if type(value) is not t or (t is int and value < 0):
            raise PlaneError(f"bucket slot description: {name!r} must be a {'non-negative ' if t is int else ''}"
                             f"{t.__name__}, got {value!r}")


def offer_slots(ch: Channel, sharing: SlotSharing, slots: Sequence[torch.Tensor]) -> None:
    """The engine's side: describe its slots to the rank on ``ch`` (an authenticated channel)."""
    ch.send_json({"type": "slots", "kind": sharing.kind, "slots": [sharing.export(s) for s in slots]})


def accept_slots(ch: Channel, sharing: SlotSharing, *, most: int = 8) -> list[torch.Tensor]:
    """The rank's side: open the slots the engine described (at most ``most``)."""
    msg = ch.recv_json()
    descs = msg.get("slots")
    if msg.get("type") != "slots" or msg.get("kind") != sharing.kind or not isinstance(descs, list) \
            or not 0 < len(descs) <= most:
        raise PlaneError(f"expected 1 to {most} bucket slots of kind {sharing.kind!r}, got {_brief(msg)}")
    opened: list[torch.Tensor] = []
    try:
        for desc in descs:
            opened.append(sharing.open(desc))
    except BaseException:
        for slot in opened:
            sharing.release(slot)
        raise
    return opened


def send_buckets(ch: Channel, sharing: SlotSharing, buckets: Sequence[Bucket], values: Sequence[torch.Tensor],
                 slots: Sequence[torch.Tensor], *, layout: Layout | None = None,
                 pieces: Sequence[tuple[int, int, int]] | None = None) -> int:
    """The rank's side: every bucket packed into the engine's slots in turn, announced on ``ch``, each slot
    reused only after the engine freed it. Returns the bytes sent. ``layout``/``pieces``: check ``values``
    against the write list first."""
    sent = 0
    try:
        if layout is not None and pieces is not None:
            check_values(layout, pieces, values)
        _check_slots(buckets, slots)
        for b, bucket in enumerate(buckets):
            slot = b % len(slots)
            if b >= len(slots):
                _expect_free(ch, b - len(slots), slot)
            pack(bucket, values, slots[slot])
            sharing.fence()
            ch.send_json({"type": "filled", "bucket": b, "slot": slot, "bytes": bucket.nbytes})
            sent += bucket.payload
        for b in range(max(0, len(buckets) - len(slots)), len(buckets)):
            _expect_free(ch, b, b % len(slots))
    except BaseException as exc:
        ch.close(reason=f"bucket stream stopped on the trainer's side: {exc}")  # the engine stops waiting
        raise
    return sent


def receive_buckets(ch: Channel, sharing: SlotSharing, buckets: Sequence[Bucket], slots: Sequence[torch.Tensor],
                    consume: Callable[[Bucket, torch.Tensor], Any] | None = None, *,
                    segment: Segment | None = None) -> int:
    """The engine's side: for each planned bucket, wait for the rank's ``filled``, hand the slot to
    ``consume(bucket, slot)`` (default: unpack it into ``segment``), fence and free the slot. Returns the
    bytes consumed."""
    if consume is None:
        if segment is None:
            raise ValueError("receive_buckets needs a consumer or a segment to unpack into")
        consume = lambda bucket, slot: unpack(bucket, slot, segment)  # noqa: E731
    done = 0
    try:
        _check_slots(buckets, slots)
        for b, bucket in enumerate(buckets):
            msg = ch.recv_json()
            slot = b % len(slots)
            if msg.get("type") != "filled" or msg.get("bucket") != b or msg.get("slot") != slot \
                    or msg.get("bytes") != bucket.nbytes:
                raise PlaneError(f"bucket stream: expected bucket {b} filled in slot {slot} ({bucket.nbytes} "
                                 f"bytes), got {_brief(msg)}")
            consume(bucket, slots[slot])
            sharing.fence()
            ch.send_json({"type": "free", "bucket": b, "slot": slot})
            done += bucket.payload
    except BaseException as exc:
        ch.close(reason=f"bucket stream stopped on the engine's side: {exc}")  # the rank stops waiting
        raise
    return done


def _check_slots(buckets: Sequence[Bucket], slots: Sequence[torch.Tensor]) -> None:
    if not slots:
        raise ValueError("a bucket stream needs at least one slot")
    need = max((b.nbytes for b in buckets), default=0)
    small = [s.numel() for s in slots if s.numel() < need]
    if small:
        raise ValueError(f"bucket slots of {small} bytes cannot hold the plan's largest bucket ({need} bytes)")


def _expect_free(ch: Channel, bucket: int, slot: int) -> None:
    msg = ch.recv_json()
    if msg.get("type") != "free" or msg.get("bucket") != bucket or msg.get("slot") != slot:
        raise PlaneError(f"bucket stream: expected slot {slot} freed after bucket {bucket}, got {_brief(msg)}")


def _brief(msg: Any) -> str:
    text = repr(msg)
    return text if len(text) <= 200 else text[:200] + "..."
