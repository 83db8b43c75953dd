"""A two-process torch.distributed channel between trainer rank 0 and one inference process.

The inference side (:class:`Listener`) runs a ``TCPStore`` server and, per session, a two-rank gloo
process group of its own; the trainer side (:func:`connect`) joins it. Neither touches the training
job's process group. Both the store and gloo listen only on the configured host (default
127.0.0.1): ``TCPStore`` alone would listen on every interface, so the listening socket is made
here and handed to it.

The channel is NOT authenticated or encrypted: any process that can reach the port can connect
and push weights. Keep it on loopback or on a network you trust.

Messages are JSON headers and raw tensors, each a gloo send/recv pair with a per-direction
sequence number as the tag. Every wait is bounded; a timeout or a vanished peer raises
:class:`ChannelError` and the session is over (gloo closes the pair on a timeout).
"""
from __future__ import annotations

import datetime
import json
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist

DEFAULT_HOST = "127.0.0.1"
_OPEN = "open"  # store key: the session id the receiver is accepting, absent between sessions


class WeightSyncError(RuntimeError):
    """A weight sync was refused or failed; the message says why."""


class ChannelError(WeightSyncError):
    """The peer vanished or stopped answering within the timeout; the session is over."""


def _seconds(t: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(t))


def _gloo(store: dist.Store, rank: int, host: str, timeout: float) -> Any:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = _seconds(timeout)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]  # listen on `host` only
    return dist.ProcessGroupGloo(store, rank, 2, opts)


class Channel:
    """One session: framed messages to and from the peer."""

    def __init__(self, pg: Any, rank: int, timeout: float, on_close: Any = None) -> None:
        self.pg = pg
        self.peer = 1 - rank
        self.timeout = timeout
        self.sent_bytes = 0
        self.received_bytes = 0
        self._send_seq = 0
        self._recv_seq = 0
        self._on_close = on_close
        self.store: Any = None  # the trainer end keeps its store client here
        self.closed = False

    def _run(self, start: Callable[[], Any], timeout: float | None, what: str) -> None:
        """Start one gloo operation and wait for it, at most ``timeout`` (default: the channel's)."""
        try:
            start().wait(_seconds(self.timeout if timeout is None else timeout))
        except RuntimeError as exc:
            self.close()
            raise ChannelError(f"{what} failed: {exc}") from exc

    def send_tensor(self, t: torch.Tensor) -> None:
        if self.closed:
            raise ChannelError("the session is closed")
        t = t.detach().to("cpu").contiguous().view(-1)  # gloo sends from host memory
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.view(torch.int16)
        self._send_seq += 1
        self._run(lambda: self.pg.send([t], self.peer, self._send_seq), None, "send")
        self.sent_bytes += t.numel() * t.element_size()

    def recv_tensor(self, numel: int, dtype: torch.dtype, timeout: float | None = None) -> torch.Tensor:
        if self.closed:
            raise ChannelError("the session is closed")
        t = torch.empty(numel, dtype=dtype)
        view = t.view(torch.int16) if dtype in (torch.bfloat16, torch.float16) else t
        self._recv_seq += 1
        self._run(lambda: self.pg.recv([view], self.peer, self._recv_seq), timeout, "receive")
        self.received_bytes += t.numel() * t.element_size()
        return t

    def send_json(self, obj: Any) -> None:
        raw = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        self.send_tensor(torch.tensor([raw.numel()], dtype=torch.int64))
        self.send_tensor(raw)

    def recv_json(self, timeout: float | None = None) -> Any:
        n = int(self.recv_tensor(1, torch.int64, timeout)[0])
        if not 0 < n <= 1 << 26:
            self.close()
            raise ChannelError(f"malformed message header length {n}")
        return json.loads(bytes(self.recv_tensor(n, torch.uint8).numpy()).decode())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.pg.shutdown()
        except Exception:  # noqa: BLE001 - best effort on a pair that may be broken already
            pass
        if self._on_close is not None:
            self._on_close()


class Listener:
    """The inference process's end: listens on ``host:port`` and accepts one sender at a time."""

    def __init__(self, host: str = DEFAULT_HOST, port: int = 0, timeout: float = 60.0) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
        self.host, self.port = host, sock.getsockname()[1]
        self.timeout = timeout
        self.store = dist.TCPStore(host, self.port, None, True, timeout=_seconds(timeout), wait_for_workers=False,
                                   master_listen_fd=sock.detach())

    def accept(self, timeout: float) -> Channel:
        """Wait up to ``timeout`` seconds for a sender to join; returns the session's channel."""
        session = self.store.add("sessions", 1)
        self.store.set(_OPEN, str(session))
        try:
            # a client connection of its own: a blocked accept must not block close() or the next session
            client = dist.TCPStore(self.host, self.port, None, False, timeout=_seconds(timeout))
            pg = _gloo(dist.PrefixStore(f"session{session}/", client), 1, self.host, timeout)
        except RuntimeError as exc:
            self._end()
            raise ChannelError(f"no sender connected to {self.host}:{self.port} within {timeout:.0f}s: {exc}") from exc
        return Channel(pg, 1, self.timeout, on_close=self._end)

    def _end(self) -> None:
        """No session is open for joining (a sender arriving now waits for the next accept)."""
        if self.store is None:
            return
        try:
            self.store.delete_key(_OPEN)
        except RuntimeError:
            pass

    def close(self) -> None:
        """Stop listening."""
        self._end()
        self.store = None  # the TCPStore server shuts down with its last reference


def connect(host: str, port: int, timeout: float = 60.0, bind: str | None = None) -> Channel:
    """The trainer's end: join the session the receiver at ``host:port`` is accepting. gloo listens
    on ``bind`` (this machine's address the receiver can reach; default ``host``, right for
    loopback)."""
    try:
        store = dist.TCPStore(host, port, None, False, timeout=_seconds(timeout))
        session = int(store.get(_OPEN))
    except RuntimeError as exc:
        raise ChannelError(f"no weight receiver accepting at {host}:{port} within {timeout:.0f}s: {exc}") from exc
    if store.add(f"session{session}/claimed", 1) != 1:
        raise WeightSyncError(f"the weight receiver at {host}:{port} is already serving another sender")
    try:
        pg = _gloo(dist.PrefixStore(f"session{session}/", store), 0, bind or host, timeout)
    except RuntimeError as exc:
        raise ChannelError(f"joining the receiver's session at {host}:{port} failed: {exc}") from exc
    channel = Channel(pg, 0, timeout)
    channel.store = store  # keep the store connection for the session's lifetime
    return channel
