"""An authenticated, framed TCP channel between trainer rank 0 and one inference process.

The inference side (:class:`Listener`) listens on ``host:port`` (default 127.0.0.1) and accepts one
sender at a time; the trainer side (:func:`connect`) dials it. Neither touches the training job's
process group. Every byte is parsed here, in Python, with bounds known before anything is
allocated: no C++ transport sits between a hostile peer and the receiver. (The channel used to be a
two-rank gloo process group, whose transport aborts the whole process when a peer sends more bytes
than the receiver posted for; see docs/security.md.)

**Frames.** Each frame is a 24-byte header ``magic "FCWS" | wire version (u8) | type (u8) |
reserved (u16, 0) | sequence number (u64) | body length (u64)``, the body, and a 32-byte
HMAC-SHA256 tag over header and body. Types: ``HELLO``, ``CHALLENGE``, ``PROOF`` (the handshake),
``JSON`` (one UTF-8 JSON object), ``TENSOR`` (raw little-endian element bytes), ``REFUSE`` (a
reason, then the connection closes). The reader knows the type and the exact length (tensors) or an
upper bound (JSON) it expects before reading a body; anything else is refused before allocating.

**Handshake** (mutual challenge-response, both nonces fresh from :mod:`secrets`)::

    sender   -> HELLO      nonce_s (32 B), holds-a-secret flag
    receiver -> CHALLENGE  nonce_r (32 B), requires-a-secret flag, HMAC(secret, "receiver" | T)
    sender   -> PROOF      HMAC(secret, "sender" | T)        T = label | nonce_s | flag | nonce_r | flag

Each end checks the other's proof with a constant-time compare. From then on each direction has its
own key, ``HMAC(HMAC(secret, "session" | T), direction)``, and every frame's tag covers its sequence
number, which must be exactly the next one: a recorded frame replayed (in this session or another,
whose keys differ), reordered, dropped or altered is refused. The secret comes from
``FAIRCAST_DS_SYNC_SECRET`` (the secret itself), ``FAIRCAST_DS_SYNC_SECRET_FILE`` (a file holding
it) or an explicit ``secret=``; there is no default. Without a secret the same frames run with an
empty key: integrity against accidents, no authentication; allowed on loopback addresses only.

**Not provided:** confidentiality (weights travel in clear) and protection against denial of
service (anyone who reaches the port can hold a handshake slot for ``handshake_timeout``).

Every wait is bounded: a timeout or a vanished peer raises :class:`ChannelError`; a frame that
breaks the protocol raises :class:`ProtocolError`; a peer that does not prove the secret raises
:class:`AuthenticationError`. Either way the session is over and the channel closed.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import socket
import stat
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

logger = logging.getLogger("faircast_ds.export")

DEFAULT_HOST = "127.0.0.1"
SECRET_ENV = "FAIRCAST_DS_SYNC_SECRET"
SECRET_FILE_ENV = "FAIRCAST_DS_SYNC_SECRET_FILE"
MIN_SECRET_BYTES = 16
_SECRET_FILE_MAX = 1 << 16

MAGIC = b"FCWS"
WIRE_VERSION = 1
HELLO, CHALLENGE, PROOF, REFUSE, JSON, TENSOR = range(1, 7)
FRAME_TYPES = {HELLO: "HELLO", CHALLENGE: "CHALLENGE", PROOF: "PROOF", REFUSE: "REFUSE", JSON: "JSON",
               TENSOR: "TENSOR"}
_HEADER = struct.Struct("!4sBBHQQ")
HEADER_BYTES = _HEADER.size
TAG_BYTES = 32
NONCE_BYTES = 32
FRAME_OVERHEAD = HEADER_BYTES + TAG_BYTES
_HELLO_BYTES = NONCE_BYTES + 1
_CHALLENGE_BYTES = NONCE_BYTES + 1 + TAG_BYTES
REFUSE_MAX = 4096
_PUBLIC_KEY = b"faircast-ds weight sync: handshake and refusal frames (integrity only)"
_LABEL = b"faircast-ds weight sync, wire version 1\x00"
_SMALL_WRITE = 1 << 16  # frames up to this size go out in one write
_DRAIN_SECONDS = 0.5  # after a refusal, how long the peer's unread bytes are read (so it sees the reason)


def free_port(host: str = DEFAULT_HOST) -> int:
    """A port of ``host`` that nothing listens on now (for an engine on this host to listen on)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class WeightSyncError(RuntimeError):
    """A weight sync was refused or failed; the message says why."""


class ChannelError(WeightSyncError):
    """The peer vanished, closed the connection, or stopped answering within the timeout; the session is
    over."""


class AcceptTimeout(ChannelError):
    """No sender connected within the accept's timeout (not a refusal: nobody came)."""


class Refused(ChannelError):
    """The peer ended the session with a reason (a REFUSE frame: unauthenticated, informative only)."""

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"{peer} ended the session: {reason}")
        self.reason = reason


class ProtocolError(WeightSyncError):
    """A frame broke the protocol (magic, version, type, sequence, length or authentication tag); the
    session is closed."""


class AuthenticationError(WeightSyncError):
    """The peer did not prove the shared secret; the session is closed."""


# ---------------------------------------------------------------- the shared secret

def resolve_secret(secret: str | bytes | None = None) -> bytes | None:
    """The shared secret: ``secret`` if given, else ``FAIRCAST_DS_SYNC_SECRET`` (the secret itself), else
    the contents of the file ``FAIRCAST_DS_SYNC_SECRET_FILE`` names (one trailing newline stripped);
    None when none is set. Raises WeightSyncError for an empty or short secret (under 16 bytes), an
    unreadable file, or both variables set."""
    if secret is not None:
        if not isinstance(secret, (str, bytes, bytearray)):
            raise WeightSyncError(f"secret must be str or bytes, not {type(secret).__name__}")
        raw, source = (secret.encode() if isinstance(secret, str) else bytes(secret)), "the secret= argument"
    else:
        value, path = os.environ.get(SECRET_ENV), os.environ.get(SECRET_FILE_ENV)
        if value is not None and path is not None:
            raise WeightSyncError(f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set; set one of them")
        if value is not None:
            raw, source = value.encode(), SECRET_ENV
        elif path is not None:
            raw, source = _read_secret_file(path), f"{SECRET_FILE_ENV}={path}"
        else:
            return None
    if len(raw) < MIN_SECRET_BYTES:
        raise WeightSyncError(
            f"the weight-sync secret from {source} is {len(raw)} bytes; at least {MIN_SECRET_BYTES} are required "
            "(make one with: python3 -c 'import secrets; print(secrets.token_hex(32))')")
    return raw


def _read_secret_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            raw = f.read(_SECRET_FILE_MAX + 1)
            mode = os.fstat(f.fileno()).st_mode
    except OSError as exc:
        raise WeightSyncError(f"{SECRET_FILE_ENV}={path}: cannot read the secret file: {exc}") from None
    if len(raw) > _SECRET_FILE_MAX:
        raise WeightSyncError(f"{SECRET_FILE_ENV}={path}: more than {_SECRET_FILE_MAX} bytes; not a secret file?")
    if stat.S_IMODE(mode) & 0o077:
        logger.warning("faircast-ds: the weight-sync secret file %s is readable by other users (mode %o); "
                       "chmod 600 it", path, stat.S_IMODE(mode))
    return raw[:-2] if raw.endswith(b"\r\n") else raw[:-1] if raw.endswith(b"\n") else raw


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_secret_off_loopback(host: str, secret: bytes | None, what: str) -> None:
    """Refuse to use a non-loopback address without a shared secret."""
    if secret is None and not is_loopback(host):
        raise WeightSyncError(
            f"refusing to {what} {host} without a shared secret: anyone who reaches it could push weights. Set "
            f"{SECRET_ENV} (or {SECRET_FILE_ENV}, or pass secret=) to the same value on both ends, or use 127.0.0.1")


def _mac(key: bytes, *parts: Any) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


@dataclass
class Limits:
    """What one end accepts: the largest JSON body and the largest frame body of any kind, in bytes.
    ``largest`` records the largest body this end allocated (the bounded-memory tests read it)."""

    max_json: int = 1 << 20
    max_frame: int = 1 << 20
    largest: int = 0


# ---------------------------------------------------------------- one session

class Channel:
    """One session over a connected socket: framed, sequenced, authenticated messages to and from the
    peer. ``peer`` names it in messages; ``timeout`` bounds every wait for the peer's next bytes."""

    def __init__(self, sock: socket.socket, *, timeout: float, peer: str, limits: Limits | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        self.sock = sock
        self.timeout = float(timeout)
        self.peer = peer
        self.limits = limits if limits is not None else Limits()
        self.sent_bytes = 0
        self.received_bytes = 0
        self.mac_seconds = 0.0  # computing and checking HMAC tags (issue 32 item 1's stage timing)
        self.io_seconds = 0.0  # in socket calls
        self._send_seq = 0
        self._recv_seq = 0
        self._send_key = _PUBLIC_KEY
        self._recv_key = _PUBLIC_KEY
        self.authenticated = False  # both ends proved a shared secret (False on an unauthenticated loopback)
        self._on_close = on_close
        self.closed = False
        self._closing = False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small request/response frames
        except OSError:
            pass

    # -------- writing

    def _send_frame(self, ftype: int, body: Any, key: bytes | None = None) -> None:
        if self.closed:
            raise ChannelError("the session is closed")
        body = memoryview(body).cast("B")
        header = _HEADER.pack(MAGIC, WIRE_VERSION, ftype, 0, self._send_seq, body.nbytes)
        t0 = time.perf_counter()
        tag = _mac(self._send_key if key is None else key, header, body)
        t1 = time.perf_counter()
        self.mac_seconds += t1 - t0
        self._send_seq += 1
        try:
            self.sock.settimeout(self.timeout)
            if body.nbytes <= _SMALL_WRITE:
                self.sock.sendall(header + bytes(body) + tag)
            else:
                self.sock.sendall(header)
                self.sock.sendall(body)
                self.sock.sendall(tag)
        except OSError as exc:  # includes socket.timeout
            self.close()
            raise ChannelError(f"sending to {self.peer} failed: {_why(exc)}") from None
        self.io_seconds += time.perf_counter() - t1
        self.sent_bytes += body.nbytes + FRAME_OVERHEAD

    def send_tensor(self, t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous().view(-1)
        raw = t.view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)
        self._send_frame(TENSOR, raw.numpy())

    def send_json(self, obj: Any) -> None:
        self._send_frame(JSON, json.dumps(obj, separators=(",", ":")).encode())

    # -------- reading

    def _read_into(self, view: memoryview, wait: float, deadline: float | None, what: str,
                   first_wait: float | None = None) -> None:
        """Fill ``view`` from the socket; each wait at most ``wait`` seconds (the first ``first_wait``), all of
        it before ``deadline``."""
        got, n = 0, view.nbytes
        while got < n:
            step = first_wait if got == 0 and first_wait is not None else wait
            limit = step if deadline is None else min(step, deadline - time.monotonic())
            if limit <= 0:
                raise ChannelError(f"{self.peer} sent nothing more within the handshake's time limit ({what})")
            try:
                self.sock.settimeout(limit)
                k = self.sock.recv_into(view[got:], n - got)
            except socket.timeout:
                raise ChannelError(f"{self.peer} went silent for {limit:.1f}s ({what})") from None
            except OSError as exc:
                raise ChannelError(f"receiving from {self.peer} failed: {_why(exc)}") from None
            if k == 0:
                if what == "frame header" and got == 0:
                    raise ChannelError(f"{self.peer} closed the connection")
                raise ChannelError(f"{self.peer} closed the connection inside a frame: a truncated {what} "
                                   f"({got} of {n} bytes)")
            got += k

    def _recv_frame(self, expect: int, *, exact: int | None = None, limit: int | None = None,
                    alloc: Callable[[int], memoryview] | None = None, timeout: float | None = None,
                    deadline: float | None = None) -> memoryview:
        """The body of the next frame, which must be of type ``expect`` with the next sequence number and
        ``exact`` bytes (or at most ``limit``). ``alloc(n)`` gives the buffer to read ``n`` bytes into."""
        if self.closed:
            raise ChannelError("the session is closed")
        try:
            return self._recv_checked(expect, exact, limit, alloc, timeout, deadline)
        except ProtocolError as exc:
            self.close(reason=str(exc))
            raise
        except WeightSyncError:
            self.close()
            raise

    def _recv_checked(self, expect: int, exact: int | None, limit: int | None,
                      alloc: Callable[[int], memoryview] | None, timeout: float | None,
                      deadline: float | None) -> memoryview:
        header = bytearray(HEADER_BYTES)
        first_wait = self.timeout if timeout is None else float(timeout)
        self._read_into(memoryview(header), self.timeout, deadline, "frame header", first_wait=first_wait)
        magic, version, ftype, reserved, seq, length = _HEADER.unpack(header)
        if magic != MAGIC:
            raise ProtocolError(f"{self.peer} sent bytes that are not a faircast-ds weight-sync frame (they begin "
                                f"{bytes(header[:8])!r}): another program, or a faircast-ds from before the framed "
                                "channel?")
        if version != WIRE_VERSION:
            raise ProtocolError(f"{self.peer} speaks weight-sync wire version {version}; this end speaks "
                                f"{WIRE_VERSION}")
        if reserved != 0:
            raise ProtocolError(f"{self.peer} sent a frame header with reserved bits set ({reserved:#x})")
        name = FRAME_TYPES.get(ftype, f"type {ftype}")
        if ftype == REFUSE:
            if length > REFUSE_MAX:
                raise ProtocolError(f"{self.peer} sent a refusal of {length} bytes (at most {REFUSE_MAX})")
            body = bytearray(length)
            tag = bytearray(TAG_BYTES)
            self._read_into(memoryview(body), self.timeout, deadline, "refusal")
            self._read_into(memoryview(tag), self.timeout, deadline, "refusal's tag")
            if not hmac.compare_digest(bytes(tag), _mac(_PUBLIC_KEY, header, body)):
                raise ProtocolError(f"{self.peer} sent a refusal frame that fails its checksum")
            self.close()
            raise Refused(self.peer, bytes(body).decode("utf-8", "replace")[:1000])
        if ftype != expect:
            raise ProtocolError(f"{self.peer} sent a {name} frame where a {FRAME_TYPES[expect]} frame belongs")
        if seq != self._recv_seq:
            raise ProtocolError(f"{self.peer} sent frame number {seq} where number {self._recv_seq} belongs: a "
                                "replayed, reordered or dropped frame")
        if exact is not None and length != exact:
            raise ProtocolError(f"{self.peer} sent a {name} frame of {length} bytes where exactly {exact} belong")
        bound = min(self.limits.max_frame, limit) if limit is not None else self.limits.max_frame
        if length > bound:
            raise ProtocolError(f"{self.peer} sent a {name} frame of {length} bytes; at most {bound} are accepted "
                                "here")
        body_view = alloc(length) if alloc is not None else memoryview(bytearray(length))
        self.limits.largest = max(self.limits.largest, length)
        tag = bytearray(TAG_BYTES)
        t0 = time.perf_counter()
        self._read_into(body_view, self.timeout, deadline, f"{name} frame body")
        self._read_into(memoryview(tag), self.timeout, deadline, f"{name} frame's tag")
        t1 = time.perf_counter()
        self.io_seconds += t1 - t0
        ok = hmac.compare_digest(bytes(tag), _mac(self._recv_key, header, body_view))
        self.mac_seconds += time.perf_counter() - t1
        if not ok:
            raise ProtocolError(f"{self.peer} sent frame number {seq} ({name}) that fails its authentication tag: "
                                "forged, corrupted, or from another session")
        self._recv_seq += 1
        self.received_bytes += length + FRAME_OVERHEAD
        return body_view

    def recv_tensor(self, numel: int, dtype: torch.dtype, timeout: float | None = None) -> torch.Tensor:
        """A TENSOR frame of exactly ``numel`` elements of ``dtype`` (bounded by the channel's limits before
        any allocation)."""
        nbytes = int(numel) * torch.empty((), dtype=dtype).element_size()
        if not 0 <= nbytes <= self.limits.max_frame:
            error = ProtocolError(f"a tensor of {numel} {dtype} elements is larger than anything this end accepts")
            self.close(reason=str(error))
            raise error
        out: list[torch.Tensor] = []

        def alloc(n: int) -> memoryview:
            t = torch.empty(int(numel), dtype=dtype)
            out.append(t)
            return memoryview(t.view(torch.uint8).numpy()) if n else memoryview(bytearray(0))

        self._recv_frame(TENSOR, exact=nbytes, alloc=alloc, timeout=timeout)
        return out[0]

    def recv_into(self, view: memoryview, timeout: float | None = None) -> None:
        """A TENSOR frame of exactly ``view.nbytes`` bytes, read straight into ``view`` (no allocation:
        e.g. a staging segment's bytes). Its tag is checked after the bytes land: on a forged or cut
        frame ``view`` holds unauthenticated bytes and the caller must treat it as dirty."""
        if view.nbytes > self.limits.max_frame:
            error = ProtocolError(f"a frame of {view.nbytes} bytes is larger than anything this end accepts")
            self.close(reason=str(error))
            raise error
        self._recv_frame(TENSOR, exact=view.nbytes, alloc=lambda n: view, timeout=timeout)

    def recv_json(self, timeout: float | None = None, limit: int | None = None) -> dict[str, Any]:
        """The next JSON frame, which must hold one JSON object."""
        body = self._recv_frame(JSON, limit=self.limits.max_json if limit is None else limit, timeout=timeout)
        try:
            obj = json.loads(bytes(body).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            error = ProtocolError(f"{self.peer} sent a JSON frame that does not parse: {type(exc).__name__}: "
                                  f"{str(exc)[:200]}")
            self.close(reason=str(error))
            raise error from None
        if not isinstance(obj, dict):
            error = ProtocolError(f"{self.peer} sent a JSON {type(obj).__name__} where an object belongs")
            self.close(reason=str(error))
            raise error
        return obj

    # -------- keys and the end

    def _start_session(self, key: bytes, transcript: bytes, role: str) -> None:
        session = _mac(key, b"session\x00", transcript)
        to_receiver, to_sender = _mac(session, b"sender to receiver"), _mac(session, b"receiver to sender")
        self._send_key, self._recv_key = (to_receiver, to_sender) if role == "sender" else (to_sender, to_receiver)

    def close(self, reason: str | None = None) -> None:
        """End the session. With a ``reason``, first tell the peer why (a REFUSE frame, best effort)."""
        if self.closed or self._closing:
            return
        self._closing = True  # a failed send of the reason below must not close twice
        try:
            if reason is not None:
                self._send_frame(REFUSE, reason.encode("utf-8", "replace")[:REFUSE_MAX], key=_PUBLIC_KEY)
                self.sock.shutdown(socket.SHUT_WR)
                _drain(self.sock)
        except (OSError, WeightSyncError):
            pass
        finally:
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes a read blocked in another thread
            except OSError:
                pass
            try:
                self.sock.close()
            except OSError:
                pass
            if self._on_close is not None:
                self._on_close()


def _drain(sock: socket.socket) -> None:
    """Read what the peer still sends for a moment, so closing does not reset the connection before the peer
    read our last frame."""
    end = time.monotonic() + _DRAIN_SECONDS
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(1 << 16):
                return
        except OSError:
            return


def _why(exc: BaseException) -> str:
    return "timed out" if isinstance(exc, socket.timeout) else f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- the handshake

def _transcript(nonce_s: bytes, flag_s: bytes, nonce_r: bytes, flag_r: bytes) -> bytes:
    return _LABEL + nonce_s + flag_s + nonce_r + flag_r


def _sender_handshake(ch: Channel, secret: bytes | None) -> None:
    nonce_s, flag_s = secrets.token_bytes(NONCE_BYTES), b"\x01" if secret else b"\x00"
    ch._send_frame(HELLO, nonce_s + flag_s)
    body = bytes(ch._recv_frame(CHALLENGE, exact=_CHALLENGE_BYTES))
    nonce_r, flag_r, proof_r = body[:NONCE_BYTES], body[NONCE_BYTES:NONCE_BYTES + 1], body[NONCE_BYTES + 1:]
    transcript = _transcript(nonce_s, flag_s, nonce_r, flag_r)
    key = secret or b""
    problem = None
    if flag_r not in (b"\x00", b"\x01"):
        problem = "the receiver's challenge is malformed"
    elif secret is not None and flag_r == b"\x00":
        problem = ("the receiver holds no shared secret and this sender does: it sends weights only to a receiver "
                   f"that proves the secret (set {SECRET_ENV} on the receiver too)")
    elif secret is None and flag_r == b"\x01":
        problem = (f"the receiver requires the shared secret and this sender has none: set {SECRET_ENV} (or "
                   f"{SECRET_FILE_ENV}, or pass secret=) to the receiver's secret")
    elif not hmac.compare_digest(proof_r, _mac(key, b"receiver\x00", transcript)):
        problem = ("the receiver did not prove the shared secret: the two ends hold different secrets, or this is "
                   "not the receiver you meant")
    if problem is not None:
        ch.close(reason=f"the sender refused: {problem}")
        raise AuthenticationError(f"the weight receiver at {ch.peer}: {problem}")
    ch._send_frame(PROOF, _mac(key, b"sender\x00", transcript))
    ch._start_session(key, transcript, "sender")
    ch.authenticated = secret is not None


def _receiver_handshake(ch: Channel, secret: bytes | None, deadline: float) -> None:
    body = bytes(ch._recv_frame(HELLO, exact=_HELLO_BYTES, deadline=deadline))
    nonce_s, flag_s = body[:NONCE_BYTES], body[NONCE_BYTES:]
    if flag_s not in (b"\x00", b"\x01"):
        error = ProtocolError(f"{ch.peer} sent a malformed hello (flag {flag_s!r})")
        ch.close(reason=str(error))
        raise error
    nonce_r, flag_r = secrets.token_bytes(NONCE_BYTES), b"\x01" if secret else b"\x00"
    transcript = _transcript(nonce_s, flag_s, nonce_r, flag_r)
    key = secret or b""
    ch._send_frame(CHALLENGE, nonce_r + flag_r + _mac(key, b"receiver\x00", transcript))
    try:
        proof = bytes(ch._recv_frame(PROOF, exact=TAG_BYTES, deadline=deadline))
    except Refused as exc:
        raise AuthenticationError(f"{ch.peer} ended the handshake: {exc.reason}") from None
    if not hmac.compare_digest(proof, _mac(key, b"sender\x00", transcript)):
        why = ("holds no shared secret and this receiver requires one" if flag_s == b"\x00" else
               "did not prove the shared secret (a different secret, or a recorded handshake replayed)")
        ch.close(reason="authentication failed")
        raise AuthenticationError(f"{ch.peer} {why}")
    ch._start_session(key, transcript, "receiver")
    ch.authenticated = secret is not None


# ---------------------------------------------------------------- the two ends

def _address(addr: Any) -> str:
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Listener:
    """The inference process's end: listens on ``host:port`` and accepts one authenticated sender at a
    time. A connection waits (up to ``pending`` of them) for the next :meth:`accept`; one that has
    waited ``busy_grace`` seconds while a session is open is refused ("already serving another
    sender"), so a sender that reconnects right after its previous session ended is not refused by
    that race. A connection's handshake must complete within ``handshake_timeout`` seconds."""

    def __init__(self, host: str = DEFAULT_HOST, port: int = 0, timeout: float = 60.0, *,
                 secret: bytes | None = None, limits: Limits | None = None, handshake_timeout: float | None = None,
                 pending: int = 16, busy_grace: float = 2.0) -> None:
        require_secret_off_loopback(host, secret, "listen on")
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(64)
        except OSError:
            sock.close()
            raise
        sock.settimeout(0.2)  # the accept thread wakes to refuse stale waiters and to notice close()
        self._sock = sock
        self.host, self.port = host, sock.getsockname()[1]
        self.timeout = float(timeout)
        self.handshake_timeout = min(self.timeout, 10.0) if handshake_timeout is None else float(handshake_timeout)
        self.secret = secret
        self.limits = limits if limits is not None else Limits()
        self.busy_grace = float(busy_grace)
        self._max_waiting = pending
        self._waiting: deque[tuple[socket.socket, str, float]] = deque()
        self._cond = threading.Condition()
        self._serving = False
        self._closed = False
        self._refusers = threading.BoundedSemaphore(16)
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"faircast-ds weight receiver {self.host}:{self.port}")
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
                arrival: tuple[socket.socket, str, float] | None = (conn, _address(addr), time.monotonic())
            except socket.timeout:
                arrival = None
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)
                continue
            refuse = []
            with self._cond:
                if arrival is not None:
                    if len(self._waiting) >= self._max_waiting:
                        refuse.append((arrival[0], arrival[1], "too many senders are waiting to connect"))
                    else:
                        self._waiting.append(arrival)
                        self._cond.notify_all()
                if self._serving:
                    now = time.monotonic()
                    while self._waiting and now - self._waiting[0][2] >= self.busy_grace:
                        conn, peer, _ = self._waiting.popleft()
                        refuse.append((conn, peer, "already serving another sender"))
            for conn, peer, reason in refuse:
                self._refuse(conn, peer, reason)

    def _refuse(self, conn: socket.socket, peer: str, reason: str) -> None:
        logger.warning("faircast-ds weight receiver %s:%d refused a connection from %s: %s", self.host, self.port,
                       peer, reason)
        if not self._refusers.acquire(blocking=False):  # a flood: just close
            conn.close()
            return

        def run() -> None:
            try:
                Channel(conn, timeout=1.0, peer=peer).close(reason=reason)
            finally:
                self._refusers.release()

        threading.Thread(target=run, daemon=True, name="faircast-ds refusal").start()

    def accept(self, timeout: float) -> Channel:
        """Wait up to ``timeout`` seconds for a sender and run the handshake; returns the session's channel.
        Raises AcceptTimeout when none connected in time, ChannelError when it vanished,
        AuthenticationError or ProtocolError when it was refused (its connection closed; the listener
        goes on)."""
        deadline = time.monotonic() + max(float(timeout), 0.0)
        with self._cond:
            while not self._waiting or self._serving:
                if self._closed:
                    raise ChannelError("the weight receiver's listener is closed")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AcceptTimeout(f"no sender connected to {self.host}:{self.port} within {timeout:.0f}s")
                self._cond.wait(remaining)
            conn, peer, _ = self._waiting.popleft()
        ch = Channel(conn, timeout=self.timeout, peer=peer, limits=self.limits, on_close=self._session_over)
        _receiver_handshake(ch, self.secret, time.monotonic() + self.handshake_timeout)
        with self._cond:
            self._serving = not ch.closed
        return ch

    def _session_over(self) -> None:
        with self._cond:
            self._serving = False
            self._cond.notify_all()

    def close(self) -> None:
        """Stop listening; connections waiting for an accept are closed."""
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=2.0)
        self._sock.close()
        with self._cond:
            while self._waiting:
                self._waiting.popleft()[0].close()


def connect(host: str, port: int, timeout: float = 60.0, bind: str | None = None, *,
            secret: str | bytes | None = None, limits: Limits | None = None) -> Channel:
    """The trainer's end: connect to the receiver at ``host:port`` (retrying until ``timeout`` while nothing
    listens there) and run the handshake. ``bind`` is the local address to connect from. ``secret``
    (default: from the environment, see :func:`resolve_secret`) must be the receiver's."""
    key = resolve_secret(secret)
    require_secret_off_loopback(host, key, "send weights to")
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()),
                                            source_address=(bind, 0) if bind else None)
            break
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ChannelError(f"no weight receiver accepting at {host}:{port} within {timeout:.0f}s: "
                                   f"{_why(exc)}") from None
            time.sleep(0.1)
    ch = Channel(sock, timeout=timeout, peer=f"{host}:{port}", limits=limits)
    try:
        _sender_handshake(ch, key)
    except Refused as exc:
        raise WeightSyncError(f"the weight receiver at {host}:{port} refused the connection: {exc.reason}") from None
    return ch


# ---------------------------------------------------------------- a connected socket of any family

def serve_handshake(sock: socket.socket, secret: bytes | None, *, timeout: float, peer: str,
                    limits: Limits | None = None, handshake_timeout: float = 10.0) -> Channel:
    """The receiver's end of the handshake on an already accepted socket (a local AF_UNIX one, say);
    returns the session's channel. Raises as :meth:`Listener.accept` does."""
    ch = Channel(sock, timeout=timeout, peer=peer, limits=limits)
    _receiver_handshake(ch, secret, time.monotonic() + handshake_timeout)
    return ch


def client_handshake(sock: socket.socket, secret: bytes | None, *, timeout: float, peer: str,
                     limits: Limits | None = None) -> Channel:
    """The sender's end of the handshake on an already connected socket; returns the session's channel."""
    ch = Channel(sock, timeout=timeout, peer=peer, limits=limits)
    try:
        _sender_handshake(ch, secret)
    except Refused as exc:
        raise WeightSyncError(f"{peer} refused the connection: {exc.reason}") from None
    return ch
