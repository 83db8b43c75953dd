"""The one-host shared-memory data plane of the ``faircast`` backend (issue 32 item 2): both ends.

**Engine** (:class:`SegmentHost`, in the vLLM worker): the staging copy of the served weights is one
``memfd`` segment (no path, nothing on disk, gone with the last process that holds it), laid out by
:class:`~faircast_ds.export.plane.Layout`; the engine's staging tensors are views of it and vLLM's
``reload_weights`` reads them in place. The host listens on an abstract AF_UNIX socket (no file
either) and serves each trainer rank on its own connection: first the channel's mutual
challenge-response handshake (:mod:`faircast_ds.export.channel`) over the shared secret, then the rank's
hello (its parameter list, rank, world and declared slices). Where neither end holds a secret, each end
takes the other only if the kernel says it runs as the same user (``SO_PEERCRED``: a process that can
read this one's memory anyway); the handshake then checks integrity only. The segment's descriptor is
handed over (``SCM_RIGHTS``) only on a connection that passed, in answer to a ``begin`` of a write,
and only after the :class:`~faircast_ds.export.plane.Ledger` accepted that write.

**Trainer rank** (:class:`SegmentWriter`): per update, ``begin`` → the descriptor → map it, copy its own
served slices of the carried parameters to their offsets, unmap and close → ``written`` with the byte
count and the digest of what it meant to write. Rank 0 then ``commit``\\ s; the engine answers once
every rank reported and the ledger checked the whole write. A rank holds the mapping only while it
writes, so no trainer process keeps a segment alive after the engine that made it is gone.

Messages are the channel's JSON frames (authenticated, sequenced); the bulk bytes never cross a
socket and carry no MAC: on one host the descriptor is the capability.

**Across hosts** (``plane="net"``, issue 32 item 3): the same host, ledger and commit, but the host
listens on a TCP address, the segment is the engine's own memory, and each trainer rank sends its own
slices on its own authenticated connection — a ``piece`` message naming one of its declared slices,
then the slice's bytes as authenticated frames of at most :data:`CHUNK_BYTES`, read by the engine
straight into the segment at the slice's offset (no copy, no gather to rank 0; the ranks send in
parallel). A piece that is not one of the rank's declared slices is refused and ends its connection.

**Through a collective library** (``plane="group"``, issue 32 item 7): the same host, ledger and commit
over the authenticated connections, but the bytes go by point-to-point sends in a process group of the
trainer ranks and the engine (:mod:`faircast_ds.export.send_group`: NCCL on GPUs, gloo on CPUs). Its
rendezvous is handed to each rank in the answer to its hello, on its authenticated connection; per
write, a ``sends`` message names the carried parameters, the engine posts a receive straight into the
segment for each of the rank's declared slices of them (in declared order), and the rank sends them.
The sends carry no MAC: the digest in the commit and the check after the load vouch for the content.

**One class per plane on each end.** :class:`SegmentHost` and :class:`SegmentWriter` hold what every plane
shares (the handshake, the hello, the ledger's begin / written / commit / same); :class:`ShmHost` /
:class:`ShmWriter`, :class:`NetHost` / :class:`NetWriter` and :class:`GroupHost` / :class:`GroupWriter` say
where the segment lives, how a rank reaches the engine and how its bytes cross. The push path picks them by
the plane's name in one place, :mod:`faircast_ds.vllm.transfer.planes`.
"""
from __future__ import annotations

import gc
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import torch

from faircast_ds.export import delta as delta_encoding
from faircast_ds.export.channel import (SECRET_ENV, SECRET_FILE_ENV, Channel, Limits, WeightSyncError,
                                        client_handshake, resolve_secret, serve_handshake)
from faircast_ds.export import send_group
from faircast_ds.export.plane import HostSegment, Layout, Ledger, PlaneError, TensorSegment, element_size, write_digest
from faircast_ds.export.served import ParamSpec

logger = logging.getLogger("faircast_ds.vllm")
PROTOCOL = 1
MEMFD_NAME = "faircast-ds-staging"
IDLE = 365 * 86400.0  # how long a connection waits for the trainer's next update (between pushes)
CHUNK_BYTES = 8 << 20  # the net plane's frames: a slice's bytes in authenticated chunks of at most this


def socket_name() -> str:
    """A fresh abstract AF_UNIX socket name (no file; ``\\0`` is prepended when binding)."""
    return f"faircast-ds-{os.getpid()}-{secrets.token_hex(8)}"


def _address(name: str) -> str:
    return "\0" + name


def _require_secret(secret: str | bytes | None, transport: str, one_host: bool) -> bytes | None:
    """The shared secret; None only on a plane of one host (``one_host``), whose ends then accept no peer
    but a process of their own user (:func:`_same_user`)."""
    key = resolve_secret(secret)
    if key is None and not one_host:
        raise WeightSyncError(f"the {transport} weight plane needs a shared secret on both ends: set {SECRET_ENV} "
                              f"(or {SECRET_FILE_ENV}) for the engine and the trainer")
    return key


def _same_user(conn: socket.socket, who: str) -> str | None:
    """Without a shared secret, the one-host plane's only check: the process at the other end of this local
    socket runs as this process's user (the kernel's word, ``SO_PEERCRED``). The problem, or None."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.getuid():
        return (f"{who} (pid {pid}) runs as user {uid}, not this process's {os.getuid()}, and no shared secret is set: "
                f"set {SECRET_ENV} (or {SECRET_FILE_ENV}) to the same value on both ends")
    return None


@contextmanager
def _timed(seconds: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's wall seconds to ``seconds[name]`` (a writer's stages: the caller's report reads them)."""
    began = time.perf_counter()
    try:
        yield
    finally:
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - began


def _spec_list(specs: Sequence[ParamSpec]) -> list[list[Any]]:
    return [[s.name, list(s.shape), str(s.dtype)] for s in specs]


def _limits(specs: Sequence[ParamSpec], chunks: bool = False) -> Limits:
    import json

    bound = 2 * len(json.dumps(_spec_list(specs))) + 64 * len(specs) * 8 + (1 << 20)
    return Limits(max_json=bound, max_frame=max(bound, CHUNK_BYTES) if chunks else bound)


class SegmentHost:
    """The engine's end of a plane: a staging segment for ``specs`` and the socket the trainer ranks write
    through; one subclass per plane (:class:`ShmHost`, :class:`NetHost`, :class:`GroupHost`), which says
    where the segment lives, where the host listens and how a rank's bytes arrive. The handshake, the hello,
    the ledger and the commit are this class's, the same on every plane.

    ``name``: the local socket (one host: :class:`ShmHost`, a memfd segment whose descriptor the ranks map);
    ``address``: the TCP ``(host, port)`` (any host: the segment is this process's memory and the ranks
    send their slices over the network; port 0 picks one, :attr:`address` says which). ``group``: with an
    address, the bytes come by sends in a process group of that backend (``"gloo"``, or ``"nccl"`` with
    the segment in CUDA memory) instead of authenticated frames (:class:`GroupHost`).
    ``SegmentHost(...)`` itself builds the subclass these arguments describe; the push path builds the
    plane it names (:mod:`faircast_ds.vllm.transfer.planes`). ``timeout`` bounds the commit's wait for
    the ranks' reports."""

    transport = ""  # the plane's name, in stage names and log lines
    one_host = False  # the ranks reach it on a local socket: without a secret, processes of this user only
    chunks = False  # the ranks send bytes as authenticated frames (the channel's limits allow a chunk)
    peer = "a trainer process"  # who connects, in a refusal
    receives: dict[str, str] = {}  # the plane's own write messages -> the method that reads their bytes
    listing = False  # a delta's changed elements are listed by the ranks (the ledger keeps the lists)

    def __new__(cls, specs: Sequence[ParamSpec], name: str | None = None, *, address: tuple[str, int] | None = None,
                group: str | None = None, **kw: Any) -> SegmentHost:
        if cls is SegmentHost:
            if (name is None) == (address is None):
                raise ValueError("SegmentHost listens on a local socket name (one host) or a TCP address, not both")
            cls = ShmHost if name is not None else GroupHost if group is not None else NetHost
        return super().__new__(cls)

    def __init__(self, specs: Sequence[ParamSpec], name: str | None = None, *,
                 address: tuple[str, int] | None = None, timeout: float = 120.0,
                 secret: str | bytes | None = None, handshake_timeout: float = 10.0,
                 group: str | None = None) -> None:
        self._check_place(name, address, group)
        self._key = _require_secret(secret, self.transport, self.one_host)
        self.specs = list(specs)
        self.layout = Layout.of(self.specs)
        self.timeout, self.handshake_timeout = float(timeout), float(handshake_timeout)
        self.limits = _limits(self.specs, chunks=self.chunks)
        self.name = name
        self.fd: int | None = None
        self._map: mmap.mmap | None = None
        self._allocate(group)
        self.segment = (HostSegment(self._map, self.layout.nbytes) if self._map is not None else
                        TensorSegment(torch.empty(self.layout.nbytes, dtype=torch.uint8, device="cuda")))
        self.ledger = Ledger(self.layout, self.segment)
        self.ledger.listing = self.listing  # the ranks' change lists pass through here
        self.refused = 0  # connections refused at the handshake or the hello
        self._closed = False
        self.address: tuple[str, int] | None = None
        self._listen(name, address)
        self.rendezvous: send_group.Rendezvous | None = None
        self._generation: dict[int, send_group.Generation] = {}  # rank -> the send group it joined
        self._open_group(address, group)
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="faircast-ds shm host")
        self._thread.start()

    # -- what a plane says (the defaults: an address, the engine's own memory) -------------------------
    @classmethod
    def backend(cls, device: torch.device | str) -> str | None:
        """The collective library a host of this plane receives through, for a model on ``device``."""
        return None

    def _check_place(self, name: str | None, address: tuple[str, int] | None, group: str | None) -> None:
        if name is not None or address is None:
            raise ValueError(f"the {self.transport} plane's host listens on a TCP address, not a local socket name")
        if group is not None:
            raise ValueError(f"the {self.transport} plane's host receives no sends of a process group")

    def _allocate(self, group: str | None) -> None:
        """The segment's memory: here the engine's own (nobody else maps it)."""
        self._map = mmap.mmap(-1, self.layout.nbytes)

    def _listen(self, name: str | None, address: tuple[str, int] | None) -> None:
        host, port = address
        try:
            self._sock = socket.create_server((host, int(port)), backlog=64)
        except OSError as exc:
            self.segment.close()
            if self._map is not None:
                self._map.close()
            raise WeightSyncError(f"the faircast weight plane cannot listen on {host}:{port}: {exc}") from None
        self.address = (host, self._sock.getsockname()[1])

    def _open_group(self, address: tuple[str, int] | None, group: str | None) -> None:
        """Where the plane's ranks meet besides their connections (the group plane's rendezvous)."""

    def _welcome(self, rank: int, world: int, conn: socket.socket, reply: dict[str, Any]) -> Any:
        """A rank the ledger accepted: what the plane adds to its hello's answer; returns what
        :meth:`_farewell` needs when the rank leaves."""
        return None

    def _farewell(self, rank: int | None, generation: Any) -> None:
        """A connection ended (its rank accepted or not)."""

    def _began(self, conn: socket.socket) -> None:
        """A rank's write was accepted: what the plane hands it on its authenticated connection."""

    def where(self) -> str:
        """Where the trainer ranks reach this host, for a log line."""
        return "on %s:%d" % self.address

    def views(self) -> dict[str, torch.Tensor]:
        """Every parameter as a tensor over the segment (the engine's staging copy; no copy)."""
        return {s.name: self.segment.tensor(self.layout, i) for i, s in enumerate(self.specs)}

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)
                continue
            self._conns.add(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True, name=f"faircast-ds {self.transport} rank")
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        rank = session = generation = None
        ch: Channel | None = None
        try:
            problem = _same_user(conn, self.peer) if self._key is None else None
            if problem is not None:  # before a byte is read: no hello, no descriptor
                raise WeightSyncError(f"refused {problem}")
            ch = serve_handshake(conn, self._key, timeout=self.timeout, peer=self.peer,
                                 limits=self.limits, handshake_timeout=self.handshake_timeout)
            hello = ch.recv_json(timeout=self.handshake_timeout)
            problem = self._check_hello(hello)
            if problem is None:
                try:
                    self.ledger.join(hello["session"], hello["rank"], hello["world"], hello["slices"])
                except PlaneError as exc:
                    problem = str(exc)
            if problem is not None:
                self.refused += 1
                ch.send_json({"ok": False, "error": problem})
                logger.warning("faircast %s plane: refused a trainer rank: %s", self.transport, problem)
                return
            rank, session = hello["rank"], hello["session"]
            reply = {"ok": True, "nbytes": self.layout.nbytes, "offsets": list(self.layout.offsets)}
            generation = self._welcome(rank, hello["world"], conn, reply)
            ch.send_json(reply)
            while not self._closed:
                msg = ch.recv_json(timeout=IDLE)
                if not self._handle(ch, conn, rank, msg):
                    return
        except WeightSyncError as exc:
            if rank is None:
                self.refused += 1
            logger.warning("faircast %s plane: %s", self.transport, exc)
        except Exception as exc:  # noqa: BLE001 - a connection's thread never takes the engine down
            logger.exception("faircast %s plane: rank %s's connection failed: %s", self.transport, rank, exc)
        finally:
            if rank is not None:
                self.ledger.leave(rank, session)
            self._farewell(rank, generation)
            if ch is not None:
                ch.close()
            else:
                conn.close()
            self._conns.discard(conn)

    def _check_hello(self, hello: dict[str, Any]) -> str | None:
        if hello.get("type") != "hello" or hello.get("protocol") != PROTOCOL:
            return f"protocol mismatch: this engine speaks faircast shm protocol {PROTOCOL}"
        if hello.get("params") != _spec_list(self.specs):
            return "model mismatch: the trainer's parameter list differs from the engine's"
        if not isinstance(hello.get("session"), str) or not isinstance(hello.get("slices"), list):
            return "malformed hello"
        return None

    def _handle(self, ch: Channel, conn: socket.socket, rank: int, msg: dict[str, Any]) -> bool:
        kind = msg.get("type")
        if kind == "begin":
            try:
                self.ledger.begin(rank, msg.get("version"), msg.get("kind"), msg.get("base"))
            except PlaneError as exc:
                ch.send_json({"ok": False, "error": str(exc)})
                return True
            ch.send_json({"ok": True})
            self._began(conn)
        elif kind in self.receives:
            problem = getattr(self, self.receives[kind])(ch, rank, msg)
            if problem is not None:  # its bytes were not (all) read: the write cannot commit, the connection ends
                self.ledger.fail(problem)
                ch.close(reason=problem)
                return False
        elif kind == "written":
            try:
                self.ledger.written(rank, msg)
            except PlaneError as exc:
                self.ledger.fail(str(exc))
        elif kind == "abort":
            self.ledger.fail(f"rank {rank} gave up its write: {str(msg.get('reason'))[:500]}")
        elif kind == "commit" and rank == 0:
            try:
                done = self.ledger.commit(msg.get("version"), msg.get("world"), msg.get("params"), self.timeout)
                ch.send_json({"ok": True, "bytes": done.bytes, "sent": done.sent, "stages": done.stages})
            except PlaneError as exc:
                ch.send_json({"ok": False, "error": str(exc)})
        elif kind == "same" and rank == 0:
            try:
                self.ledger.same(msg.get("version"), msg.get("base"))
                ch.send_json({"ok": True})
            except PlaneError as exc:
                ch.send_json({"ok": False, "error": str(exc)})
        elif kind == "bye":
            return False
        else:
            ch.close(reason=f"unexpected message {str(kind)[:40]!r} from rank {rank}")
            return False
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._thread.join(timeout=2.0)
        self._sock.close()
        if self.rendezvous is not None:
            self.rendezvous.close()
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.segment.close()
        gc.collect()
        try:
            if self._map is not None:
                self._map.close()
        except BufferError:  # staging views still referenced elsewhere: the mapping goes with them
            pass
        if self.fd is not None:
            os.close(self.fd)


class ShmHost(SegmentHost):
    """The shm plane's engine end (one host): the segment is a memfd, the host listens on the abstract local
    socket ``name``, and each rank gets the segment's descriptor in answer to its ``begin``."""

    transport = "shm"
    one_host = True
    peer = "a local trainer process"

    def _check_place(self, name: str | None, address: tuple[str, int] | None, group: str | None) -> None:
        if name is None or address is not None:
            raise ValueError("the shm plane's host listens on a local socket name, not a TCP address")
        if group is not None:
            raise ValueError(f"SegmentHost's group is one of {send_group.BACKENDS}, with an address, not {group!r}")

    def _allocate(self, group: str | None) -> None:
        self.fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.layout.nbytes)
            self._map = mmap.mmap(self.fd, self.layout.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise

    def _listen(self, name: str | None, address: tuple[str, int] | None) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(_address(name))

    def _began(self, conn: socket.socket) -> None:
        socket.send_fds(conn, [b"F"], [self.fd])  # the capability, on this authenticated connection only

    def where(self) -> str:
        return f"@{self.name}"


class NetHost(SegmentHost):
    """The net plane's engine end (any host): the host listens on a TCP address, the segment is the engine's
    own memory, and each rank's slices arrive as ``piece`` (or, in a delta, ``changes``) messages followed by
    their bytes in authenticated chunks, read straight into the segment."""

    transport = "net"
    chunks = True
    listing = True
    receives = {"piece": "_receive_piece", "changes": "_receive_changes"}

    def _declared(self, rank: int, msg: dict[str, Any]) -> tuple[tuple[int, int, int] | None, str | None]:
        """The slice a ``piece`` / ``changes`` message names, if it is one of ``rank``'s declared slices
        and a write is open; else why not."""
        entry = (msg.get("index"), msg.get("start"), msg.get("numel"))
        with self.ledger.cond:
            state, writing = self.ledger.ranks.get(rank), self.ledger.writing
        if state is None or writing is None or state.report is not None:
            return None, f"rank {rank} sent a slice outside an open write"
        if not all(type(v) is int for v in entry) or entry not in state.slices:
            return None, f"rank {rank} sent a slice {list(entry)!r} that is not one of the slices it declared"
        return entry, None

    def _receive_piece(self, ch: Channel, rank: int, msg: dict[str, Any]) -> str | None:
        """The net plane: one of ``rank``'s declared slices, its bytes read straight into the segment.
        Returns why the piece was refused (its bytes are then not read), or None."""
        entry, problem = self._declared(rank, msg)
        if problem is not None:
            return problem
        offset, nbytes = self.layout.span(*entry)
        # a bad tag leaves the segment dirty: no commit follows
        _recv_chunked(ch, memoryview(self.segment.bytes_at(offset, nbytes).numpy()))
        self.ledger.list_changes(entry[0], None)  # a delta's slice sent whole: its elements are not listed
        return None

    def _receive_changes(self, ch: Channel, rank: int, msg: dict[str, Any]) -> str | None:
        """The net plane, a delta: the changed elements of one of ``rank``'s declared slices (their sorted
        indices, then their values), written over the bits the segment holds at the write's base.
        Refused (and the segment left dirty) unless the write is a delta, the list is smaller than the
        slice, and the indices are strictly increasing inside it. The scratch is at most the slice's size."""
        entry, problem = self._declared(rank, msg)
        if problem is not None:
            return problem
        with self.ledger.cond:
            writing = self.ledger.writing
        if writing is None or writing[1] != "delta":
            return f"rank {rank} sent changed elements in a write that is not a delta"
        index, start, numel = entry
        encoding = {v: k for k, v in delta_encoding.ENCODINGS.items()}.get(msg.get("encoding"))
        count = msg.get("count")
        size = element_size(self.specs[index].dtype)
        if encoding != delta_encoding.COO or type(count) is not int \
                or not 0 <= count <= numel \
                or delta_encoding.encoded_bytes(encoding, numel, count, size) >= numel * size:
            return (f"rank {rank} sent a malformed change list for {self.specs[index].name} [{start}, "
                    f"{start + numel}): encoding {str(msg.get('encoding'))[:20]!r}, count {str(count)[:20]!r}")
        first = torch.empty(count, dtype=delta_encoding.index_dtype(numel))
        values = torch.empty(count, dtype=delta_encoding.bits_dtype(self.specs[index].dtype))
        _recv_chunked(ch, memoryview(first.view(torch.uint8).numpy()))
        _recv_chunked(ch, memoryview(values.view(torch.uint8).numpy()))
        offset, nbytes = self.layout.span(*entry)
        target = self.segment.bytes_at(offset, nbytes).view(self.specs[index].dtype)
        try:
            delta_encoding.check_indices(first, numel)
            delta_encoding.apply(target, first, values)
        except ValueError as exc:
            return f"rank {rank}'s changes to {self.specs[index].name} refused: {exc}"
        self.ledger.list_changes(index, first.to(torch.int64) + start)
        return None



class GroupHost(SegmentHost):
    """The group plane's engine end (any host, a network you trust): the net plane's address and control
    messages, the bytes by point-to-point sends in a process group of the ranks and the engine (``group``:
    ``"gloo"``, or ``"nccl"`` with the segment in CUDA memory), whose rendezvous each rank is told in the
    answer to its hello."""

    transport = "group"
    receives = {"sends": "_receive_sends"}

    @classmethod
    def backend(cls, device: torch.device | str) -> str | None:
        return send_group.backend_for(device)

    def _check_place(self, name: str | None, address: tuple[str, int] | None, group: str | None) -> None:
        if group is None or address is None or name is not None or group not in send_group.BACKENDS:
            raise ValueError(f"SegmentHost's group is one of {send_group.BACKENDS}, with an address, not {group!r}")

    def _allocate(self, group: str | None) -> None:
        if group != "nccl":
            super()._allocate(group)
        # NCCL: device memory the receives land in (the segment is a tensor)

    def _open_group(self, address: tuple[str, int] | None, group: str | None) -> None:
        try:
            self.rendezvous = send_group.Rendezvous(address[0], group, self.timeout)
        except Exception:
            self._sock.close()
            self.segment.close()
            raise

    def _welcome(self, rank: int, world: int, conn: socket.socket, reply: dict[str, Any]) -> Any:
        # told on this authenticated connection only
        generation, reply["group"] = self.rendezvous.join(rank, world, conn.getsockname()[0])
        self._generation[rank] = generation
        return generation

    def _farewell(self, rank: int | None, generation: Any) -> None:
        self.rendezvous.end(generation, f"trainer rank {rank} left")

    def _receive_sends(self, ch: Channel, rank: int, msg: dict[str, Any]) -> str | None:
        """The group plane: ``rank``'s declared slices of the parameters ``msg`` names, received in declared
        order through the send group straight into the segment. Returns why not (the segment is then
        dirty), or None."""
        params = msg.get("params")
        with self.ledger.cond:
            state, writing = self.ledger.ranks.get(rank), self.ledger.writing
        if state is None or writing is None or state.report is not None:
            return f"rank {rank} announced sends outside an open write"
        if not isinstance(params, list) or not all(type(i) is int and 0 <= i < len(self.specs) for i in params):
            return f"rank {rank} announced sends of malformed parameters {str(params)[:80]}"
        try:
            group = self.rendezvous.ready(self._generation_of(rank))
        except PlaneError as exc:
            ch.send_json({"ok": False, "error": str(exc)})
            return str(exc)
        ch.send_json({"ok": True})
        wanted = set(params)
        for index, start, numel in state.slices:
            if index not in wanted:
                continue
            offset, nbytes = self.layout.span(index, start, numel)
            try:
                send_group.recv(group, self.segment.bytes_at(offset, nbytes), rank, self.timeout)
            except Exception as exc:  # noqa: BLE001 - the library's error, named; the segment is dirty
                return (f"receiving rank {rank}'s slice of {self.specs[index].name} through the send group failed: "
                        f"{type(exc).__name__}: {str(exc)[:300]}")
        return None

    def _generation_of(self, rank: int) -> send_group.Generation:
        gen = self._generation.get(rank)
        if gen is None:
            raise PlaneError(f"rank {rank} joined no send group")
        return gen


class SegmentWriter:
    """One trainer rank's end of a plane; one subclass per plane (:class:`ShmWriter`, :class:`NetWriter`,
    :class:`GroupWriter`), which says how the rank reaches the engine and how its bytes cross. The handshake,
    the hello, the reports and the commit are this class's, the same on every plane.

    ``slices``: this rank's ``(param index, start, values)`` (values a 1-D view of its served shard), the
    same every update. ``name``: the engine's local socket (one host: the rank maps the segment and copies
    its slices in); ``address``: the engine's TCP ``(host, port)`` (any host: the rank sends its slices as
    authenticated frames, or, ``group=True``, by sends in the process group the engine describes when the
    rank joins). ``SegmentWriter(...)`` itself builds the subclass these arguments describe; the push path
    builds the plane it names (:mod:`faircast_ds.vllm.transfer.planes`)."""

    transport = ""  # the plane's name, in stage names
    one_host = False  # it reaches the engine on a local socket: without a secret, the engine of this user only
    chunks = False  # the rank sends bytes as authenticated frames (the channel's limits allow a chunk)
    sparse = False  # a delta may carry each slice's changed elements only

    def __new__(cls, name: str | None, specs: Sequence[ParamSpec], slices: Sequence[tuple[int, int, torch.Tensor]],
                *, address: tuple[str, int] | None = None, group: bool = False, **kw: Any) -> SegmentWriter:
        if cls is SegmentWriter:
            if (name is None) == (address is None):
                raise ValueError("SegmentWriter writes through a local socket name (one host) or a TCP address, "
                                 "not both")
            cls = ShmWriter if address is None else GroupWriter if group else NetWriter
        return super().__new__(cls)

    def __init__(self, name: str | None, specs: Sequence[ParamSpec], slices: Sequence[tuple[int, int, torch.Tensor]], *,
                 rank: int, world: int, session: str, timeout: float = 120.0,
                 secret: str | bytes | None = None, address: tuple[str, int] | None = None,
                 group: bool = False) -> None:
        self._check_place(name, address, group)
        self.address = address
        self.group: Any = None  # the group plane: this rank's end of the send group
        self.backend: str | None = None
        self.name, self.specs, self.slices = name, list(specs), list(slices)
        self.rank, self.world, self.session, self.timeout = rank, world, session, float(timeout)
        self._secret = secret
        self.layout = Layout.of(self.specs)
        self.channel: Channel | None = None
        self._sock: socket.socket | None = None
        self.offset_error = 0  # elements (tests only: a deliberate misplacement)

    @property
    def connected(self) -> bool:
        return self.channel is not None and not self.channel.closed

    # -- what a plane says (the defaults: the engine's TCP address) --------------------------------------
    def _check_place(self, name: str | None, address: tuple[str, int] | None, group: bool) -> None:
        if name is not None or address is None:
            raise ValueError(f"the {self.transport} plane's rank writes to the engine's TCP address, not a local "
                             "socket name")

    def _open(self) -> tuple[socket.socket, str]:
        """A connection to the engine's plane, and where it is (for messages)."""
        host, port = self.address
        where = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, int(port)), timeout=self.timeout)
        except OSError as exc:
            raise WeightSyncError(f"no faircast weight plane at {where}: {exc}") from None
        return sock, where

    def _joined(self, reply: dict[str, Any]) -> None:
        """The engine accepted this rank's hello (``reply``): what the plane sets up before the first write."""

    def _begun(self) -> int | None:
        """The engine accepted a write: what it hands over on the connection (the shm plane's descriptor)."""
        return None

    def _move(self, ch: Channel, positions: list[int], pieces: list[tuple[int, int, torch.Tensor]], params: set[int],
              seconds: dict[str, float], pause: Any, handed: int | None,
              changes: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None) -> int:
        """This rank's slices at ``positions`` of :attr:`slices` (``pieces``; ``params`` their parameters)
        into the engine's segment; returns the bytes that crossed."""
        raise NotImplementedError

    def failed(self) -> None:
        """A push failed on some rank: what this rank's end does before the next one."""

    # -- every plane -----------------------------------------------------------------------------------
    def connect(self) -> None:
        key = _require_secret(self._secret, self.transport, self.one_host)
        sock, where = self._open()
        self._sock = sock
        problem = _same_user(sock, f"the engine's plane at {where}") if key is None else None
        if problem is not None:
            sock.close()
            raise WeightSyncError(problem)
        self.channel = client_handshake(sock, key, timeout=self.timeout, peer=f"the engine's plane at {where}",
                                        limits=_limits(self.specs, chunks=self.chunks))
        self.channel.send_json({"type": "hello", "protocol": PROTOCOL, "session": self.session, "rank": self.rank,
                                "world": self.world, "params": _spec_list(self.specs),
                                "slices": [[i, s, v.numel()] for i, s, v in self.slices]})
        reply = self.channel.recv_json()
        if reply.get("ok") is not True:
            self.close()
            raise WeightSyncError(f"the engine's plane refused rank {self.rank}: {reply.get('error')}")
        if reply.get("nbytes") != self.layout.nbytes or reply.get("offsets") != list(self.layout.offsets):
            self.close()
            raise WeightSyncError("the engine lays the staging segment out differently from this trainer")
        self._joined(reply)

    def write(self, version: int, kind: str, base: int | None, params: set[int], seconds: dict[str, float],
              pause: Any = None, *, changes: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> int:
        """Write this rank's slices of ``params`` for ``version`` and report them; returns the bytes that
        crossed to the engine. Seconds per stage are added to ``seconds`` (``<plane>.begin``, ...).
        ``pause(k)`` (tests) is called after the k-th slice written.

        A delta on the net plane may carry a slice's changed elements only: ``changes[k]`` for slice ``k``
        (of this writer's ``slices``) is its change list, ``(indices, bits)``: the changed elements' sorted
        indices into the slice (:func:`faircast_ds.export.delta.index_dtype`) and their new bits, which the
        engine writes over the bits the segment holds at ``base``; a slice without one travels whole."""
        ch = self.channel
        if ch is None or ch.closed:
            raise WeightSyncError(f"rank {self.rank} has no connection to the engine's plane")
        positions = [k for k, (i, _, _) in enumerate(self.slices) if i in params]
        pieces = [self.slices[k] for k in positions]
        sparse = changes if changes and kind == "delta" and self.sparse else None
        with _timed(seconds, f"{self.transport}.begin"):
            ch.send_json({"type": "begin", "version": int(version), "kind": kind, "base": base})
            reply = ch.recv_json()
            if reply.get("ok") is not True:
                raise PlaneError(f"the engine refused the write of version {version}: {reply.get('error')}")
            handed = self._begun()
        try:
            written = self._move(ch, positions, pieces, params, seconds, pause, handed, sparse)
            with _timed(seconds, f"{self.transport}.digest"):
                digest = write_digest(pieces)
        except BaseException as exc:
            if ch is not None and not ch.closed:
                try:
                    ch.send_json({"type": "abort", "reason": f"{type(exc).__name__}: {exc}"})
                except WeightSyncError:
                    pass
            raise
        covered = sum(v.numel() * v.element_size() for _, _, v in pieces)  # what this rank brought up to date
        ch.send_json({"type": "written", "version": int(version), "params": sorted(params), "bytes": covered,
                      "sent": written, "digest": digest})
        return written

    def commit(self, version: int, params: set[int] | None, seconds: dict[str, float]) -> dict[str, Any]:
        """Rank 0: commit ``version`` (``params``: a delta's carried parameters; None: dense)."""
        with _timed(seconds, f"{self.transport}.commit"):
            self.channel.send_json({"type": "commit", "version": int(version), "world": self.world,
                                    "params": None if params is None else sorted(params)})
            reply = self.channel.recv_json(timeout=self.timeout + 30.0)
        if reply.get("ok") is not True:
            raise PlaneError(f"the engine did not commit version {version}: {reply.get('error')}")
        for k, v in (reply.get("stages") or {}).items():
            if isinstance(v, (int, float)):
                seconds[f"engine.{k}"] = seconds.get(f"engine.{k}", 0.0) + float(v)
        return reply

    def same(self, version: int, base: int) -> None:
        self.channel.send_json({"type": "same", "version": int(version), "base": int(base)})
        reply = self.channel.recv_json()
        if reply.get("ok") is not True:
            raise PlaneError(f"the engine refused the no-change update {version}: {reply.get('error')}")

    def close(self) -> None:
        if self.channel is not None and not self.channel.closed:
            try:
                self.channel.send_json({"type": "bye"})
            except WeightSyncError:
                pass
            self.channel.close()
        self.channel = None
        self._sock = None
        self.group = None  # this rank's end of the send group goes with its connection


class ShmWriter(SegmentWriter):
    """The shm plane's rank end (one host): it connects to the engine's abstract local socket, receives the
    segment's descriptor in answer to each ``begin``, maps it and copies its slices to their offsets."""

    transport = "shm"
    one_host = True

    def _check_place(self, name: str | None, address: tuple[str, int] | None, group: bool) -> None:
        if name is None or address is not None:
            raise ValueError("the shm plane's rank writes through the engine's local socket name, not an address")
        if group:
            raise ValueError("SegmentWriter's send group needs the engine's address")

    def _open(self) -> tuple[socket.socket, str]:
        where = f"@{self.name}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(_address(self.name))
        except OSError as exc:
            sock.close()
            raise WeightSyncError(f"no faircast shared-memory plane at {where}: {exc}") from None
        return sock, where

    def _begun(self) -> int | None:
        return self._receive_segment()

    def _move(self, ch: Channel, positions: list[int], pieces: list[tuple[int, int, torch.Tensor]], params: set[int],
              seconds: dict[str, float], pause: Any, handed: int | None,
              changes: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None) -> int:
        return self._copy_into_segment(handed, pieces, seconds, pause)

    def _receive_segment(self) -> int:
        """The shm plane: the segment's descriptor, sent on this authenticated connection after ``begin``."""
        try:
            _, fds, _, _ = socket.recv_fds(self._sock, 1, 1)
        except OSError as exc:
            self.channel.close()
            raise WeightSyncError(f"rank {self.rank}: receiving the staging segment failed: {exc}") from None
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            self.channel.close()
            raise WeightSyncError(f"rank {self.rank}: the engine sent {len(fds)} descriptors for the staging segment")
        return fds[0]

    def _copy_into_segment(self, fd: int, pieces: list[tuple[int, int, torch.Tensor]], seconds: dict[str, float],
                           pause: Any) -> int:
        """The shm plane: map the segment, copy each piece to its offset, unmap. Bytes written."""
        written = 0
        with _timed(seconds, "shm.map"):
            try:
                mapped = mmap.mmap(fd, self.layout.nbytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                   mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)  # the mapping keeps the segment until it is unmapped below
        segment = HostSegment(mapped, self.layout.nbytes)
        try:
            with _timed(seconds, "shm.write"):
                for k, (index, start, values) in enumerate(pieces, start=1):
                    offset, nbytes = self.layout.span(index, start, values.numel())
                    size = nbytes // max(1, values.numel())
                    segment.bytes_at(offset + self.offset_error * size, nbytes).copy_(
                        values.detach().reshape(-1).view(torch.uint8))
                    written += nbytes
                    if pause is not None:
                        pause(k)
        finally:
            segment.close()
            del segment
            try:
                mapped.close()
            except BufferError:  # a view outlived the write (a cycle): collect it, then unmap
                gc.collect()
                mapped.close()
        return written


class NetWriter(SegmentWriter):
    """The net plane's rank end (any host): its slices cross its own authenticated TCP connection to the
    engine's address, in chunks the engine reads straight into the segment; a delta may carry each slice's
    changed elements only."""

    transport = "net"
    chunks = True
    sparse = True

    def _move(self, ch: Channel, positions: list[int], pieces: list[tuple[int, int, torch.Tensor]], params: set[int],
              seconds: dict[str, float], pause: Any, handed: int | None,
              changes: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None) -> int:
        return self._send_pieces(ch, positions, seconds, pause, changes)

    def _send_pieces(self, ch: Channel, positions: list[int], seconds: dict[str, float], pause: Any,
                     changes: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None) -> int:
        """The net plane: each slice as ``piece`` + its bytes in authenticated chunks, or (a delta's slice
        with a change list) as ``changes`` + its changed elements' indices + their bits. Bytes sent."""
        written = 0
        for k, position in enumerate(positions, start=1):
            index, start, values = self.slices[position]
            listed = changes.get(position) if changes else None
            with _timed(seconds, "net.send"):
                if listed is None:
                    raw = values.detach().reshape(-1).view(torch.uint8)
                    ch.send_json({"type": "piece", "index": index, "start": start + self.offset_error,
                                  "numel": values.numel()})
                    written += _send_chunked(ch, raw)
                else:
                    first, new = listed
                    ch.send_json({"type": "changes", "index": index, "start": start + self.offset_error,
                                  "numel": values.numel(), "encoding": delta_encoding.ENCODINGS[delta_encoding.COO],
                                  "count": int(new.numel())})
                    written += _send_chunked(ch, first.view(torch.uint8)) + _send_chunked(ch, new.view(torch.uint8))
            if pause is not None:
                pause(k)
        return written


class GroupWriter(SegmentWriter):
    """The group plane's rank end (any host, a network you trust): the net plane's connection for the control
    messages; its slices by point-to-point sends in the process group the engine describes when the rank
    joins. After a failed push the rank leaves the group, and the next push forms a new one."""

    transport = "group"

    def _joined(self, reply: dict[str, Any]) -> None:  # blocks until every rank and the engine joined
        info = reply.get("group")
        try:
            self.group = send_group.build(info, self.rank, self._sock.getsockname()[0])
        except PlaneError as exc:
            self.close()
            raise WeightSyncError(f"rank {self.rank}: {exc}") from None
        self.backend = info["backend"]

    def _move(self, ch: Channel, positions: list[int], pieces: list[tuple[int, int, torch.Tensor]], params: set[int],
              seconds: dict[str, float], pause: Any, handed: int | None,
              changes: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None) -> int:
        return self._send_group(ch, pieces, params, seconds, pause)

    def failed(self) -> None:
        self.close()

    def _send_group(self, ch: Channel, pieces: list[tuple[int, int, torch.Tensor]], params: set[int],
                    seconds: dict[str, float], pause: Any) -> int:
        """The group plane: name the carried parameters, then send each piece (in declared order, as the
        engine receives them) to the engine, the group's last member. Bytes sent. Every piece is checked
        (its memory for the library, its dtype against the layout) before the engine is told to receive."""
        for index, start, values in pieces:
            where = values.device.type
            if self.backend == "nccl" and where != "cuda":
                raise PlaneError(f"rank {self.rank}: the engine's send group is NCCL, this rank's served slices "
                                 f"are in {where} memory")
            if values.dtype != self.specs[index].dtype:  # then its bytes are the layout's too
                raise PlaneError(f"rank {self.rank}: its slice of {self.specs[index].name} is {values.dtype}, the "
                                 f"engine's layout says {self.specs[index].dtype}")
        ch.send_json({"type": "sends", "params": sorted(params)})
        reply = ch.recv_json()
        if reply.get("ok") is not True:
            raise PlaneError(f"the engine refused rank {self.rank}'s sends: {reply.get('error')}")
        written = 0
        with _timed(seconds, "group.send"):
            for k, (_, _, values) in enumerate(pieces, start=1):
                raw = values.detach().reshape(-1).view(torch.uint8)
                if self.offset_error:  # tests: the bytes a slice over, as a misplaced write would leave them
                    raw = raw.roll(self.offset_error * values.element_size())
                if self.backend == "gloo" and raw.device.type != "cpu":
                    raw = raw.cpu()  # gloo sends host memory
                send_group.send(self.group, raw, self.world, self.timeout)
                written += raw.numel()
                if pause is not None:
                    pause(k)
        return written


def find_segments(name: str = MEMFD_NAME) -> list[str]:
    """Every process of this machine's ``/proc`` that holds a descriptor or a mapping of a memfd named
    ``name`` (``"PID fd N"`` / ``"PID map"``): what must be empty once the engine that made it is gone."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:{name}"):
                        found.append(f"{pid} fd {fd}")
                except OSError:
                    continue
            with open(f"/proc/{pid}/maps") as f:
                if f"/memfd:{name}" in f.read():
                    found.append(f"{pid} map")
        except OSError:
            continue
    return found


def _send_chunked(ch: Channel, raw: torch.Tensor) -> int:
    """``raw`` (uint8) as authenticated frames of at most :data:`CHUNK_BYTES`; the receiver reads the
    same chunking (:func:`_recv_chunked`). Bytes sent."""
    for at in range(0, raw.numel(), CHUNK_BYTES):
        ch.send_tensor(raw[at:at + CHUNK_BYTES])
    return raw.numel()


def _recv_chunked(ch: Channel, into: memoryview) -> None:
    for at in range(0, into.nbytes, CHUNK_BYTES):
        ch.recv_into(into[at:at + min(CHUNK_BYTES, into.nbytes - at)])
