"""The weight channel's security: who gets in, and what a hostile stream does to the receiver.

- the shared secret: where it comes from, what is refused (a sender without it or with another one,
  a recorded session replayed, binding off loopback without one);
- hostile input, case by case: truncated frames, wrong magic, version, type or sequence number,
  oversized length fields, bad tags, wrong names, shapes and dtypes, malformed messages and
  updates, duplicated, reordered and replayed frames, random bytes. After each, the receiver must have
  raised a WeightSyncError that says what happened, closed the session, kept its weights, and serve
  the next sender; no length field may make it allocate more than the parameter it is for;
- property-based (hypothesis, fixed example budget, no database): random bytes, one altered byte
  anywhere in an authenticated update, an update cut anywhere.

A receiver thread serves the whole time, as an inference process would. Figures for docs/security.md
are printed by the tests (``-s`` shows them).
"""
from __future__ import annotations

import json
import logging
import os
import queue
import re
import select
import socket
import subprocess
import sys
import threading
from typing import Any, Callable

import pytest
import torch
from conftest import DIST, ROOT, cpu_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from faircast_ds.export import WeightReceiver, WeightSender, WeightSyncError, delta
from faircast_ds.export import channel as wire
from faircast_ds.export.channel import (
    HELLO,
    JSON,
    MAGIC,
    PROOF,
    REFUSE,
    TENSOR,
    WIRE_VERSION,
    AcceptTimeout,
    connect,
    resolve_secret,
)
from faircast_ds.export.sync import PROTOCOL, SyncAborted, spec_list

sys.path.insert(0, str(DIST))
from export_common import digest, plain_model  # noqa: E402

SECRET = "faircast-ds test secret 0123456789abcdef"
OTHER = "another secret, also long enough"
ENV_VARS = (wire.SECRET_ENV, wire.SECRET_FILE_ENV)
# the hypothesis budget: fixed, no example database (CI stays bounded and reproducible in time)
EXAMPLES = {"random_bytes": 400, "altered_byte": 400, "cut": 200}
FUZZ = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def no_secret_in_env(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


# ---------------------------------------------------------------- a receiver that serves throughout

class Server:
    """accept/receive forever in a thread, as an inference process does; every outcome is queued.
    Anything but a WeightSyncError escaping is recorded as ESCAPED (and fails the tests)."""

    def __init__(self, rx: WeightReceiver) -> None:
        self.rx, self.events, self.stopped = rx, queue.Queue(), False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped:
            try:
                self.rx.accept(timeout=0.3)
            except AcceptTimeout:
                continue
            except WeightSyncError as exc:
                self.events.put(exc)
                continue
            except BaseException as exc:  # noqa: BLE001 - the very thing these tests look for
                self.events.put(("ESCAPED", exc))
                continue
            try:
                while (report := self.rx.receive(timeout=5)) is not None:
                    self.events.put(report)
                self.events.put("closed")
            except WeightSyncError as exc:
                self.events.put(exc)
            except BaseException as exc:  # noqa: BLE001
                self.events.put(("ESCAPED", exc))

    def outcome(self, timeout: float = 20) -> tuple[Any, list]:
        """The next session's end: (the exception or "closed", the updates applied before it)."""
        updates = []
        while True:
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError("the receiver reported nothing: hung?") from None
            if isinstance(event, tuple) and event[0] == "ESCAPED":
                raise AssertionError(f"a {type(event[1]).__name__} escaped the receiver: {event[1]!r}")
            if isinstance(event, (Exception, str)):
                return event, updates
            updates.append(event)

    def stop(self) -> None:
        self.stopped = True
        self.thread.join(timeout=10)


@pytest.fixture
def served():
    rx = WeightReceiver(plain_model(seed=99), port=0, timeout=2, handshake_timeout=1, secret=SECRET)
    server = Server(rx)
    yield rx, server
    server.stop()
    rx.close()


def deliver(rx: WeightReceiver, server: Server, version: int, seed: int = 0, *, sparse: bool = False) -> None:
    """A legitimate trainer syncs ``version`` (and with ``sparse`` a COO and a bitmap delta after it); the
    receiver must serve exactly its weights."""
    model = plain_model(seed=seed)
    sender = WeightSender(model, port=rx.port, timeout=10, secret=SECRET)
    kinds = [sender.sync(version=version).kind]
    if sparse:
        with torch.no_grad():
            params = list(model.parameters())
            params[0].view(-1)[:5] += 1  # 5 of 3232 elements: COO
            kinds.append(sender.sync(version=version + 1).kind)
            params[3].add_(torch.ones_like(params[3]))  # every element of one matrix: bitmap
            kinds.append(sender.sync(version=version + 2).kind)
    sender.close()
    end, updates = server.outcome()
    assert end == "closed", f"a legitimate sender was not served: {end!r}"
    assert [u.kind for u in updates] == kinds == ["dense"] + ["delta"] * (len(kinds) - 1)
    assert digest(rx.targets.items()) == digest(model.named_parameters())
    assert rx.version == version + len(kinds) - 1


# ---------------------------------------------------------------- crafting frames

def frame(ftype: int, body: bytes = b"", *, seq: int = 0, key: bytes = wire._PUBLIC_KEY, magic: bytes = MAGIC,
          version: int = WIRE_VERSION, reserved: int = 0, length: int | None = None, bad_tag: bool = False) -> bytes:
    header = wire._HEADER.pack(magic, version, ftype, reserved, seq, len(body) if length is None else length)
    tag = wire._mac(key, header, body)
    if bad_tag:
        tag = bytes([tag[0] ^ 1]) + tag[1:]
    return header + body + tag


def hello_frame(flag: int = 1, **kw: Any) -> bytes:
    return frame(HELLO, os.urandom(32) + bytes([flag]), **kw)


def other_bits(rx: WeightReceiver, name: str) -> torch.Tensor:
    """A valid payload for parameter ``name`` whose every element differs from what the receiver serves
    (the lowest mantissa bit flipped: still finite): a case that sends it and is refused shows, in the
    receiver's unchanged digest, that none of it was applied."""
    return delta.bits_view(rx.targets[name]).clone() ^ 1


def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().view(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def drain_and_close(sock: socket.socket, shut: bool = True) -> None:
    """Stop sending (unless ``shut`` is False: a silent peer), read until the receiver closes, close."""
    try:
        if shut:
            sock.shutdown(socket.SHUT_WR)
        sock.settimeout(15)
        while sock.recv(1 << 16):
            pass
    except OSError:
        pass
    finally:
        sock.close()


class Raw:
    """A peer without the secret: a plain socket."""

    def __init__(self, rx: WeightReceiver) -> None:
        self.sock = socket.create_connection(("127.0.0.1", rx.port), timeout=10)

    def send(self, *chunks: bytes) -> "Raw":
        try:
            self.sock.sendall(b"".join(chunks))
        except OSError:
            pass  # the receiver may have refused already
        return self

    def challenge(self) -> bytes:
        """Read the receiver's CHALLENGE frame (after our HELLO)."""
        got = b""
        self.sock.settimeout(10)
        while len(got) < wire.HEADER_BYTES + wire._CHALLENGE_BYTES + wire.TAG_BYTES:
            chunk = self.sock.recv(4096)
            assert chunk, "the receiver closed instead of answering a valid hello"
            got += chunk
        return got

    def end(self, shut: bool = True) -> None:
        drain_and_close(self.sock, shut)


class Authed:
    """A peer that holds the secret (a buggy or compromised trainer): a real handshake through
    :func:`connect`, then frames crafted with the session's key and sequence numbers."""

    def __init__(self, rx: WeightReceiver, hello: bool = True, secret: str = SECRET) -> None:
        self.rx = rx
        self.ch = connect("127.0.0.1", rx.port, timeout=10, secret=secret)
        self.sent: list[bytes] = []
        if hello:
            self.send(self.json({"type": "hello", "protocol": PROTOCOL, "params": spec_list(rx.specs)}))
            assert self.reply()["ok"]

    def frame(self, ftype: int, body: bytes, *, seq: int | None = None, **kw: Any) -> bytes:
        if seq is None:
            seq = self.ch._send_seq
            self.ch._send_seq += 1
        data = frame(ftype, body, seq=seq, key=kw.pop("key", self.ch._send_key), **kw)
        self.sent.append(data)
        return data

    def json(self, obj: Any, **kw: Any) -> bytes:
        return self.frame(JSON, obj if isinstance(obj, bytes) else json.dumps(obj).encode(), **kw)

    def tensor(self, t: torch.Tensor | list[int], **kw: Any) -> bytes:
        return self.frame(TENSOR, tensor_bytes(t if isinstance(t, torch.Tensor) else torch.tensor(t)), **kw)

    def send(self, *chunks: bytes) -> "Authed":
        try:
            self.ch.sock.sendall(b"".join(chunks))
        except OSError:
            pass
        return self

    def reply(self) -> dict:
        return self.ch.recv_json()

    def update(self, kind: str = "dense", base: int | None = None, version: int | None = None) -> "Authed":
        """Open an update the receiver accepts."""
        version = (self.rx.version or 0) + 1 if version is None else version
        self.send(self.json({"type": "update", "kind": kind, "version": version, "base": base}))
        assert self.reply()["ok"]
        return self

    def dense_frames(self, bits: dict[str, torch.Tensor] | None = None) -> bytes:
        """Every parameter (the receiver's own bits unless given) and the end marker."""
        out = []
        for i, (name, t) in enumerate(self.rx.targets.items()):
            out.append(self.tensor([i, delta.DENSE, t.numel()]))
            out.append(self.tensor(delta.bits_view(t).clone() if bits is None else bits[name]))
        out.append(self.tensor([-1, 0, len(self.rx.names)]))
        return b"".join(out)

    def dense(self) -> int:
        """A complete, valid dense update of the weights the receiver serves (so they stay the same);
        returns its version."""
        version = (self.rx.version or 0) + 1
        self.update("dense", version=version).send(self.dense_frames())
        assert self.reply()["ok"]
        return version

    def end(self, shut: bool = True) -> None:
        drain_and_close(self.ch.sock, shut)


# ---------------------------------------------------------------- the hostile cases

CASES: list[tuple[str, Callable[[WeightReceiver], int | None], str, str]] = []
_GROUP = [""]


def group(name: str) -> None:
    """The cases registered from here on belong to ``name`` (for the tally)."""
    _GROUP[0] = name


def case(pattern: str):
    """Register a hostile case; the receiver's error must match ``pattern``. A case returns the version
    the receiver serves afterwards when it first delivered a valid update, else None."""
    def register(fn):
        CASES.append((fn.__name__, fn, pattern, _GROUP[0]))
        return fn
    return register


# -- before the handshake: a peer without the secret

group("framing before the handshake")


@case(r"vanished during the handshake: .* closed the connection")
def connect_and_close(rx):
    Raw(rx).end()


@case(r"not a faircast-ds weight-sync frame")
def random_bytes(rx):
    Raw(rx).send(bytes(range(256)) * 4).end()


@case(r"truncated frame header \(7 of 24 bytes\)")
def a_few_random_bytes(rx):
    Raw(rx).send(b"\x00\xff" * 3 + b"!").end()


@case(r"truncated frame header \(10 of 24 bytes\)")
def truncated_header(rx):
    Raw(rx).send(hello_frame()[:10]).end()


@case(r"truncated HELLO frame body \(10 of 33 bytes\)")
def truncated_body(rx):
    Raw(rx).send(hello_frame()[:24 + 10]).end()


@case(r"truncated HELLO frame's tag \(5 of 32 bytes\)")
def truncated_tag(rx):
    Raw(rx).send(hello_frame()[:24 + 33 + 5]).end()


@case(r"not a faircast-ds weight-sync frame \(they begin b'XXXX")


def wrong_magic(rx):
    Raw(rx).send(hello_frame(magic=b"XXXX")).end()


@case(r"speaks weight-sync wire version 2; this end speaks 1")


def wrong_wire_version(rx):
    Raw(rx).send(hello_frame(version=2)).end()


@case(r"reserved bits set")


def reserved_bits(rx):
    Raw(rx).send(hello_frame(reserved=0x100)).end()


@case(r"a JSON frame where a HELLO frame belongs")


def wrong_first_frame(rx):
    Raw(rx).send(frame(JSON, b'{"type": "hello"}')).end()


@case(r"a type 99 frame where a HELLO frame belongs")


def unknown_frame_type(rx):
    Raw(rx).send(frame(99, b"x" * 33)).end()


@case(r"frame number 5 where number 0 belongs: a replayed, reordered or dropped frame")


def hello_out_of_sequence(rx):
    Raw(rx).send(hello_frame(seq=5)).end()


@case(r"HELLO frame of 9223372036854775807 bytes where exactly 33 belong")


def oversized_length_field(rx):
    Raw(rx).send(frame(HELLO, b"", length=2**63 - 1)).end()


@case(r"HELLO frame of 1099511627776 bytes where exactly 33 belong")


def large_length_field(rx):
    Raw(rx).send(frame(HELLO, b"", length=2**40)).end()


@case(r"HELLO frame of 5 bytes where exactly 33 belong")


def short_hello(rx):
    Raw(rx).send(frame(HELLO, b"hello")).end()


@case(r"frame number 0 \(HELLO\) that fails its authentication tag")


def corrupted_hello(rx):
    Raw(rx).send(hello_frame(bad_tag=True)).end()


@case(r"malformed hello \(flag b'\\x07'\)")


def bad_hello_flag(rx):
    Raw(rx).send(hello_frame(flag=7)).end()


@case(r"ended the session: go away")


def refusal_instead_of_hello(rx):
    Raw(rx).send(frame(REFUSE, b"go away")).end()


@case(r"sent a refusal of 99999 bytes")


def oversized_refusal(rx):
    Raw(rx).send(frame(REFUSE, b"", length=99999)).end()


@case(r"went silent|time limit")


def silent_peer(rx):
    Raw(rx).end(shut=False)  # connects and says nothing: the handshake's time limit ends it


@case(r"went silent|time limit")


def stalls_inside_a_frame(rx):
    Raw(rx).send(hello_frame()[:30]).end(shut=False)


@case(r"vanished during the handshake: .* closed the connection")


def hello_then_gone(rx):
    raw = Raw(rx).send(hello_frame())
    raw.challenge()
    raw.end()


group("authentication")


@case(r"did not prove the shared secret")


def forged_proof(rx):
    raw = Raw(rx).send(hello_frame())
    raw.challenge()
    raw.send(frame(PROOF, os.urandom(32), seq=1)).end()


@case(r"holds no shared secret and this receiver requires one")


def unauthenticated_proof(rx):
    nonce = os.urandom(32)
    raw = Raw(rx).send(frame(HELLO, nonce + b"\x00"))
    challenge = raw.challenge()[wire.HEADER_BYTES:wire.HEADER_BYTES + wire._CHALLENGE_BYTES]
    # the proof an end without a secret computes (the empty key): good only for a receiver without one
    transcript = wire._transcript(nonce, b"\x00", challenge[:32], challenge[32:33])
    raw.send(frame(PROOF, wire._mac(b"", b"sender\x00", transcript), seq=1)).end()


@case(r"CHALLENGE frame where a PROOF frame belongs")


def challenge_sent_back(rx):
    raw = Raw(rx).send(hello_frame())
    reply = raw.challenge()
    raw.send(reply[:wire.HEADER_BYTES + wire._CHALLENGE_BYTES + wire.TAG_BYTES]).end()


@case(r"ended the handshake: the sender refused: the receiver requires the shared secret and this sender has none")


def sender_without_the_secret(rx):
    with pytest.raises(WeightSyncError, match="requires the shared secret and this sender has none"):
        WeightSender(plain_model(), port=rx.port, timeout=10).sync(version=10**6)


@case(r"ended the handshake: the sender refused: the receiver did not prove the shared secret")


def sender_with_another_secret(rx):
    with pytest.raises(WeightSyncError, match="the receiver did not prove the shared secret"):
        WeightSender(plain_model(), port=rx.port, timeout=10, secret=OTHER).sync(version=10**6)


# -- after the handshake: a peer that holds the secret but sends what it should not

def hello_case(rx, params=None, protocol=PROTOCOL, raw: bytes | None = None, **kw):
    a = Authed(rx, hello=False)
    body = {"type": "hello", "protocol": protocol, "params": spec_list(rx.specs) if params is None else params}
    a.send(a.json(raw if raw is not None else body, **kw)).end()


group("hello: protocol and model")


@case(r"protocol mismatch: receiver speaks faircast-ds weight sync protocol 2, the sender sent 'hello' protocol 1")


def old_protocol(rx):
    hello_case(rx, protocol=1)


@case(r"protocol mismatch: .* protocol True")


def protocol_as_bool(rx):
    hello_case(rx, protocol=True)


@case(r"model mismatch: 1 parameter\(s\) the receiver has and the sender does not send, e.g. \['0.weight'\]; "
      r"1 parameter\(s\) the sender sends and the receiver does not have, e.g. \['embed.weight'\]")


def wrong_name(rx):
    params = spec_list(rx.specs)
    params[0][0] = "embed.weight"
    hello_case(rx, params)


@case(r"2.weight: sender \[64, 33\] torch.bfloat16, receiver \[64, 32\] torch.bfloat16")


def wrong_shape(rx):
    params = spec_list(rx.specs)
    params[3][1] = [64, 33]
    hello_case(rx, params)


@case(r"2.weight: sender \[64, 32\] torch.float16, receiver \[64, 32\] torch.bfloat16")


def wrong_dtype(rx):
    params = spec_list(rx.specs)
    params[3][2] = "torch.float16"
    hello_case(rx, params)


@case(r"the parameters are listed in a different order")


def parameters_reordered(rx):
    params = spec_list(rx.specs)
    hello_case(rx, params[1:] + params[:1])


@case(r"malformed hello: params is str, not a list")


def params_not_a_list(rx):
    hello_case(rx, "all of them")


@case(r"malformed hello: params\[0\] is \['0.weight', '101x32', 'torch.bfloat16'\], not \[name, \[dims...\], dtype\]")


def params_malformed(rx):
    params = spec_list(rx.specs)
    params[0][1] = "101x32"
    hello_case(rx, params)


@case(r"malformed hello: params\[0\] is .*, not \[name")


def params_negative_dims(rx):
    params = spec_list(rx.specs)
    params[0][1] = [-101, 32]
    hello_case(rx, params)


@case(r"malformed hello: parameter '0.weight' is listed twice")


def params_duplicated(rx):
    params = spec_list(rx.specs)
    hello_case(rx, params + params[:1])


group("JSON messages")


@case(r"JSON frame of 1099511627776 bytes; at most 5120 are accepted here")


def oversized_json_length(rx):
    a = Authed(rx, hello=False)
    a.send(a.frame(JSON, b"", length=2**40)).end()


@case(r"JSON frame of 5121 bytes; at most 5120 are accepted here")


def json_one_byte_too_long(rx):
    hello_case(rx, raw=b" " * 5121)


@case(r"sent a JSON list where an object belongs")


def json_not_an_object(rx):
    hello_case(rx, raw=b'["hello", 2]')


@case(r"JSON frame that does not parse: UnicodeDecodeError")


def json_not_utf8(rx):
    hello_case(rx, raw=b'{"type": "hello\xff\xfe"}')


@case(r"JSON frame that does not parse: JSONDecodeError")


def json_truncated_text(rx):
    hello_case(rx, raw=b'{"type": "hel')


@case(r"JSON frame that does not parse: RecursionError")


def json_nested_too_deep(rx):
    hello_case(rx, raw=b'{"a":' + b"[" * 2400 + b"]" * 2400 + b"}")


@case(r"does not parse: ValueError: Exceeds the limit")


def json_huge_integer(rx):
    hello_case(rx, raw=b'{"type": "hello", "protocol": ' + b"9" * 4400 + b"}")


group("frames in a session: altered, replayed, reordered, spliced")


@case(r"frame number 2 \(JSON\) that fails its authentication tag")


def hello_tampered(rx):
    a = Authed(rx, hello=False)
    data = bytearray(a.json({"type": "hello", "protocol": PROTOCOL, "params": spec_list(rx.specs)}))
    data[30] ^= 0x20  # one bit of the body
    a.send(bytes(data)).end()


@case(r"frame number 2 \(JSON\) that fails its authentication tag: forged, corrupted, or from another session")


def unauthenticated_tag_after_handshake(rx):
    a = Authed(rx, hello=False)  # the right sequence number, but tagged with the public handshake key
    a.send(a.json({"type": "hello", "protocol": PROTOCOL, "params": spec_list(rx.specs)},
                  key=wire._PUBLIC_KEY)).end()


@case(r"frame number 2 where number 3 belongs: a replayed, reordered or dropped frame")


def hello_replayed_in_its_session(rx):
    a = Authed(rx)  # its hello (frame 2) accepted
    a.send(a.sent[0]).end()


@case(r"frame number 4 where number 3 belongs")


def frames_reordered(rx):
    a = Authed(rx)
    first = a.json({"type": "update", "kind": "dense", "version": 99, "base": None})
    second = a.json({"type": "bye"})
    a.send(second, first).end()


@case(r"frame number 2 \(JSON\) that fails its authentication tag: forged, corrupted, or from another session")


def frame_from_another_session(rx):
    recorded = Authed(rx)
    old = recorded.sent[0]  # its hello, frame 2
    recorded.send(recorded.json({"type": "bye"})).end()
    a = Authed(rx, hello=False)  # a new session: the same sequence number, other keys
    a.send(old).end()


@case(r"refused the sender's message, session closed, still serving version \d+: .* not a faircast-ds")


def random_bytes_after_the_handshake(rx):
    a = Authed(rx)
    a.send(bytes(range(200, 256)) * 8).end()


group("update headers")


@case(r"refused update: unexpected message \{'type': 'update', 'kind': 'patch'")


def unknown_update_kind(rx):
    a = Authed(rx)
    a.send(a.json({"type": "update", "kind": "patch", "version": 5, "base": None})).end()


@case(r"refused update: unexpected message \{'type': 'bye', 'now': True\}")


def bye_with_extra_keys(rx):
    a = Authed(rx)
    a.send(a.json({"type": "bye", "now": True})).end()


@case(r"update without an integer version in \[0, 2\^63\): True")
def version_as_bool(rx):
    a = Authed(rx)
    a.send(a.json({"type": "update", "kind": "dense", "version": True, "base": None})).end()


@case(r"update without an integer version in \[0, 2\^63\): '7'")


def version_as_string(rx):
    a = Authed(rx)
    a.send(a.json({"type": "update", "kind": "dense", "version": "7", "base": None})).end()


@case(r"update without an integer version in \[0, 2\^63\): 1180591620717411303424")


def version_too_large(rx):
    a = Authed(rx)
    a.send(a.json({"type": "update", "kind": "dense", "version": 2**70, "base": None})).end()


@case(r"update version 0 is older than the weights served")


def version_older(rx):
    a = Authed(rx)
    a.send(a.json({"type": "update", "kind": "dense", "version": 0, "base": None})).end()


@case(r"delta against version .* but this receiver serves version \d+ from another session")


def delta_from_another_session(rx):
    a = Authed(rx)
    a.send(a.json({"type": "update", "kind": "delta", "version": rx.version + 1, "base": rx.version})).end()


group("parameter stream")


@case(r"a JSON frame where a TENSOR frame belongs")


def json_where_a_tensor_belongs(rx):
    a = Authed(rx).update()
    a.send(a.json({"index": 0})).end()


@case(r"TENSOR frame of 32 bytes where exactly 24 belong")


def parameter_header_too_long(rx):
    a = Authed(rx).update()
    a.send(a.tensor([0, delta.DENSE, 3232, 0])).end()


@case(r"parameter index 14 out of range \[0, 14\)")


def parameter_index_out_of_range(rx):
    a = Authed(rx).update()
    a.send(a.tensor([14, delta.DENSE, 1])).end()


@case(r"parameter index -7 out of range")


def parameter_index_negative(rx):
    a = Authed(rx).update()
    a.send(a.tensor([-7, delta.DENSE, 1])).end()


@case(r"parameter index 0 after 0: repeated or out of order")


def parameter_duplicated(rx):
    a = Authed(rx).update()
    t = other_bits(rx, "0.weight")
    a.send(a.tensor([0, delta.DENSE, t.numel()]), a.tensor(t), a.tensor([0, delta.DENSE, t.numel()])).end()


@case(r"parameter index 0 after 1: repeated or out of order")


def parameters_out_of_order(rx):
    a = Authed(rx).update()
    t = other_bits(rx, "1.weight")
    a.send(a.tensor([1, delta.DENSE, t.numel()]), a.tensor(t), a.tensor([0, delta.DENSE, 3232])).end()


@case(r"0.weight: dense payload of 3233 elements, expected 3232")


def dense_count_wrong(rx):
    a = Authed(rx).update()
    a.send(a.tensor([0, delta.DENSE, 3233])).end()


@case(r"TENSOR frame of 4611686018427387904 bytes where exactly 6464 belong")


def dense_payload_oversized_length(rx):
    a = Authed(rx).update()
    a.send(a.tensor([0, delta.DENSE, 3232]), a.frame(TENSOR, b"", length=2**62)).end()


@case(r"TENSOR frame of 6462 bytes where exactly 6464 belong")


def dense_payload_short(rx):
    a = Authed(rx).update()
    a.send(a.tensor([0, delta.DENSE, 3232]), a.tensor(torch.zeros(3231, dtype=torch.int16))).end()


@case(r"vanished mid-update .* truncated TENSOR frame body \(100 of 6464 bytes\)")


def dense_payload_truncated(rx):
    a = Authed(rx).update()
    header = a.tensor([0, delta.DENSE, 3232])
    data = a.tensor(torch.zeros(3232, dtype=torch.int16))
    a.send(header, data[:24 + 100]).end()


@case(r"vanished mid-update .* went silent")


def sender_stalls_mid_update(rx):
    a = Authed(rx).update()
    a.send(a.tensor([0, delta.DENSE, 3232])).end(shut=False)


@case(r"frame number 5 \(TENSOR\) that fails its authentication tag")


def payload_altered_in_flight(rx):
    a = Authed(rx).update()
    header = a.tensor([0, delta.DENSE, 3232])
    data = bytearray(a.tensor(torch.zeros(3232, dtype=torch.int16)))
    data[1000] ^= 1
    a.send(header, bytes(data)).end()


@case(r"end marker \[-1, 0, 5\] after 0 parameters")


def end_marker_miscounts(rx):
    a = Authed(rx).update()
    a.send(a.tensor([-1, 0, 5])).end()


@case(r"dense update \d+ is missing 13 parameter\(s\), e.g. \['1.weight'")


def dense_update_incomplete(rx):
    a = Authed(rx).update()
    t = other_bits(rx, "0.weight")
    a.send(a.tensor([0, delta.DENSE, t.numel()]), a.tensor(t), a.tensor([-1, 0, 1])).end()


@case(r"ended the session: stop")


def refusal_mid_update(rx):
    a = Authed(rx).update()
    a.send(a.tensor([0, delta.DENSE, 3232]), frame(REFUSE, b"stop")).end()


group("delta encodings")


def delta_case(rx, frames_of: Callable[[Authed], list[bytes]]) -> int:
    """A valid dense update first (so a delta is acceptable), then a delta with the given frames."""
    a = Authed(rx)
    version = a.dense()
    a.update("delta", base=version, version=version + 1)
    a.send(*frames_of(a)).end()
    return version


def values(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int16)


@case(r"0.weight: element index out of range \[0, 3232\)")


def coo_index_out_of_range(rx):
    return delta_case(rx, lambda a: [a.tensor([0, delta.COO, 2]), a.tensor(torch.tensor([5, 3232], dtype=torch.int32)),
                                     a.tensor(values(2))])


@case(r"0.weight: element index out of range")


def coo_index_negative(rx):
    return delta_case(rx, lambda a: [a.tensor([0, delta.COO, 2]), a.tensor(torch.tensor([-1, 3], dtype=torch.int32)),
                                     a.tensor(values(2))])


@case(r"element indices are not strictly increasing")


def coo_indices_repeated(rx):
    return delta_case(rx, lambda a: [a.tensor([0, delta.COO, 3]), a.tensor(torch.tensor([4, 9, 9], dtype=torch.int32)),
                                     a.tensor(values(3))])


@case(r"TENSOR frame of 16 bytes where exactly 8 belong")


def coo_indices_as_int64(rx):
    return delta_case(rx, lambda a: [a.tensor([0, delta.COO, 2]), a.tensor(torch.tensor([1, 2], dtype=torch.int64))])


@case(r"0.weight: coo for 3000 of 3232 elements, where the other encoding is smaller")


def coo_larger_than_the_bitmap(rx):
    return delta_case(rx, lambda a: [a.tensor([0, delta.COO, 3000])])


@case(r"0.weight: bitmap for 3 of 3232 elements, where the other encoding is smaller")


def bitmap_larger_than_coo(rx):
    return delta_case(rx, lambda a: [a.tensor([0, delta.BITMAP, 3])])


@case(r"0.weight: bitmap has 200 bits set, header says 150")


def bitmap_count_mismatch(rx):
    return delta_case(rx, lambda a: [a.tensor([0, delta.BITMAP, 150]),
                                     a.tensor(delta.pack_bits(torch.arange(200), 3232))])


@case(r"0.weight: encoding 1 with 3233 elements is not valid here")


def sparse_count_beyond_the_parameter(rx):
    return delta_case(rx, lambda a: [a.tensor([0, delta.COO, 3233])])


@case(r"0.weight: encoding 2 with 0 elements is not valid here")


def sparse_count_zero(rx):
    return delta_case(rx, lambda a: [a.tensor([0, delta.BITMAP, 0])])


@case(r"0.weight: encoding 7 with 4 elements is not valid here")


def unknown_encoding(rx):
    return delta_case(rx, lambda a: [a.tensor([0, 7, 4])])


@case(r"0.weight: encoding 1 with 2 elements is not valid here")


def sparse_parameter_in_a_dense_update(rx):
    a = Authed(rx).update()
    a.send(a.tensor([0, delta.COO, 2])).end()


@case(r"delta against version 1 but this receiver serves version \d+;")


def delta_against_other_weights(rx):
    a = Authed(rx)
    version = a.dense()
    a.send(a.json({"type": "update", "kind": "delta", "version": version + 1, "base": 1})).end()
    return version


@case(r"versions must not decrease within a session")


def version_goes_back_within_a_session(rx):
    a = Authed(rx)
    version = a.dense()
    a.send(a.json({"type": "update", "kind": "dense", "version": version - 1, "base": None})).end()
    return version


def documented_cases() -> tuple[int, dict[str, int]]:
    """The number of hostile cases docs/security.md states, and its count for each group (the group's
    name up to any colon, followed by its number: "framing before the handshake 22 (...)")."""
    text = " ".join((ROOT / "docs" / "security.md").read_text().split())
    found = re.search(r"\*\*(\d+) hostile cases tried, (\d+) refused\*\*(.*?)(?:- \*\*|$)", text)
    assert found and found[1] == found[2], "docs/security.md no longer states the hostile cases tried and refused"
    by_group = {}
    for name in dict.fromkeys(where.split(":")[0] for *_, where in CASES):
        counted = re.search(rf"\b{re.escape(name)} (\d+)\b", found[3])
        assert counted, f"docs/security.md does not count the group {name!r}"
        by_group[name] = int(counted[1])
    return int(found[1]), by_group


def test_hostile_inputs_are_each_refused_and_the_receiver_serves_on(served, caplog, capsys):
    rx, server = served
    deliver(rx, server, version=1, seed=1)
    served_bytes = rx.nbytes
    largest_param = max(t.numel() * t.element_size() for t in rx.targets.values())
    caplog.set_level(logging.WARNING, logger="faircast_ds.export")
    groups: dict[str, int] = {}
    for i, (name, attack, pattern, where) in enumerate(CASES):
        before, version = digest(rx.targets.items()), rx.version
        after = attack(rx)
        exc, updates = server.outcome()
        while exc == "closed":  # a case that first ended a session of its own cleanly
            exc, more = server.outcome()
            updates += more
        assert isinstance(exc, WeightSyncError), f"{name}: the receiver reported {exc!r}, not a WeightSyncError"
        assert re.search(pattern, str(exc)), f"{name}: unexpected message: {exc}"
        assert len(updates) == (0 if after is None else 1), f"{name}: {updates}"
        assert digest(rx.targets.items()) == before, f"{name}: the receiver's weights changed"
        assert rx.version == (version if after is None else after), name
        assert not rx.connected and rx.last_error == str(exc), name
        assert any(str(exc) in r.getMessage() for r in caplog.records), f"{name}: the refusal was not logged"
        groups[where] = groups.get(where, 0) + 1
        deliver(rx, server, version=rx.version + 1, seed=i, sparse=i % 10 == 0)  # open to the next sender
    assert rx.largest_allocation <= largest_param <= served_bytes, "a length field sized an allocation"
    assert rx.peak_staged_bytes <= served_bytes + rx.numel // 8 + len(rx.specs)
    documented, by_group = documented_cases()
    assert len(CASES) == documented, f"{len(CASES)} hostile cases run, docs/security.md says {documented}"
    assert {where.split(":")[0]: n for where, n in groups.items()} == by_group, (groups, by_group)
    with capsys.disabled():
        print(f"\nhostile cases: {len(CASES)} tried, {len(CASES)} refused ({groups}); receiver served a legitimate "
              f"sender after each; largest allocation {rx.largest_allocation} B (largest parameter {largest_param} B, "
              f"model {served_bytes} B); peak staged {rx.peak_staged_bytes} B")


# ---------------------------------------------------------------- replay of a recorded session

class Recorder:
    """A TCP relay between a sender and the receiver that records what the sender sent."""

    def __init__(self, port: int) -> None:
        self.listen = socket.create_server(("127.0.0.1", 0))
        self.port, self.target, self.sent = self.listen.getsockname()[1], port, bytearray()
        self.thread = threading.Thread(target=self._relay, daemon=True)
        self.thread.start()

    def _relay(self) -> None:
        client, _ = self.listen.accept()
        upstream = socket.create_connection(("127.0.0.1", self.target))
        peers = {client: upstream, upstream: client}
        while peers:
            ready, _, _ = select.select(list(peers), [], [], 10)
            if not ready:
                break
            for s in ready:
                data = s.recv(1 << 16)
                if s is client:
                    self.sent += data
                if not data:
                    try:
                        peers[s].shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    peers.pop(s)
                    continue
                peers[s].sendall(data)
        client.close()
        upstream.close()
        self.listen.close()


def test_a_recorded_session_replayed_is_refused(served):
    rx, server = served
    relay = Recorder(rx.port)
    model = plain_model(seed=5)
    sender = WeightSender(model, port=relay.port, timeout=10, secret=SECRET)
    sender.sync(version=7)
    with torch.no_grad():
        next(model.parameters()).view(-1)[:3] += 1
    sender.sync(version=8)
    sender.close()
    relay.thread.join(timeout=10)
    end, updates = server.outcome()
    assert end == "closed" and [u.version for u in updates] == [7, 8]
    recorded = bytes(relay.sent)
    assert len(recorded) > rx.nbytes  # the whole session: handshake, a dense update, a delta, bye
    print(f"\nrecorded session: {len(recorded)} bytes, replayed verbatim 3 times, then spliced: refused")
    deliver(rx, server, version=20, seed=6)  # the receiver now serves other weights
    served_digest = digest(rx.targets.items())
    for attempt in range(3):  # verbatim, and again (a recorded handshake can never be completed again)
        raw = Raw(rx)
        raw.send(recorded).end()
        exc, updates = server.outcome()
        assert isinstance(exc, WeightSyncError) and not updates
        assert "did not prove the shared secret (a different secret, or a recorded handshake replayed)" in str(exc)
        assert digest(rx.targets.items()) == served_digest and rx.version == 20
    # the recorded update frames spliced into a new authenticated session: their tags do not verify there
    hello_bytes, proof_bytes = wire.FRAME_OVERHEAD + wire._HELLO_BYTES, wire.FRAME_OVERHEAD + wire.TAG_BYTES
    post_handshake = recorded[hello_bytes + proof_bytes:]
    a = Authed(rx, hello=False)
    a.send(post_handshake).end()
    exc, updates = server.outcome()
    assert "frame number 2 (JSON) that fails its authentication tag" in str(exc) and not updates
    assert digest(rx.targets.items()) == served_digest and rx.version == 20
    deliver(rx, server, version=21, seed=7)


# ---------------------------------------------------------------- property-based: random and altered streams

VALID_PREFIX = st.sampled_from([b"", MAGIC, MAGIC + bytes([WIRE_VERSION]), MAGIC + bytes([WIRE_VERSION, HELLO]),
                                MAGIC + bytes([WIRE_VERSION, HELLO, 0, 0]) + bytes(8) + (33).to_bytes(8, "big")])


@settings(max_examples=EXAMPLES["random_bytes"], **FUZZ)
@given(prefix=VALID_PREFIX, tail=st.binary(max_size=400))


def test_random_bytes_never_get_in(served, prefix, tail):
    rx, server = served
    before, version = digest(rx.targets.items()), rx.version
    Raw(rx).send(prefix + tail).end()
    exc, updates = server.outcome()
    assert isinstance(exc, WeightSyncError) and not updates, exc
    assert digest(rx.targets.items()) == before and rx.version == version
    assert rx.largest_allocation <= 6464


def new_bits(rx: WeightReceiver, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randint(-2**15, 2**15, (t.numel(),), generator=g, dtype=torch.int16)
            for n, t in rx.targets.items()}


@settings(max_examples=EXAMPLES["altered_byte"], **FUZZ)
@given(data=st.data())


def test_one_altered_byte_anywhere_in_an_update_is_refused(served, data):
    """An authenticated session's update frames (header, 14 parameters, end marker), one byte changed
    anywhere: the update is refused whole."""
    rx, server = served
    before, version = digest(rx.targets.items()), rx.version
    a = Authed(rx)
    stream = a.json({"type": "update", "kind": "dense", "version": (version or 0) + 1, "base": None}) + \
        a.dense_frames(new_bits(rx, seed=1))
    where = data.draw(st.integers(0, len(stream) - 1), label="byte")
    flip = data.draw(st.integers(1, 255), label="xor")
    altered = bytearray(stream)
    altered[where] ^= flip
    a.send(bytes(altered)).end()
    exc, updates = server.outcome()
    assert isinstance(exc, WeightSyncError) and not updates, exc
    assert digest(rx.targets.items()) == before and rx.version == version


@settings(max_examples=EXAMPLES["cut"], **FUZZ)
@given(data=st.data())


def test_an_update_cut_anywhere_is_discarded(served, data):
    rx, server = served
    before, version = digest(rx.targets.items()), rx.version
    a = Authed(rx)
    stream = a.json({"type": "update", "kind": "dense", "version": (version or 0) + 1, "base": None}) + \
        a.dense_frames(new_bits(rx, seed=2))
    cut = data.draw(st.integers(0, len(stream) - 1), label="cut")
    a.send(stream[:cut]).end()
    exc, updates = server.outcome()
    assert isinstance(exc, SyncAborted) and not updates, exc  # the sender vanished mid-frame or between frames
    assert digest(rx.targets.items()) == before and rx.version == version


def test_the_receiver_serves_after_the_fuzzing(served):
    rx, server = served
    for attempt in range(5):  # a burst of junk, then a legitimate sender
        Raw(rx).send(os.urandom(64)).end()
        assert isinstance(server.outcome()[0], WeightSyncError)
    deliver(rx, server, version=3, seed=3, sparse=True)
    print(f"\nhypothesis examples per property: {EXAMPLES}")


# ---------------------------------------------------------------- the secret, and who may listen where

def test_bitmap_counting_and_applying():
    numel = 13  # a tail: 3 bits of the second byte unused
    bitmap = delta.pack_bits(torch.tensor([0, 5, 12]), numel)
    assert delta.count_bits(bitmap, numel) == 3
    target = torch.zeros(numel, dtype=torch.bfloat16)
    delta.apply_bitmap(target, bitmap, torch.tensor([1, 2, 3], dtype=torch.int16))
    assert delta.bits_view(target).tolist() == [1, 0, 0, 0, 0, 2] + [0] * 6 + [3]
    bitmap[-1] |= 0x80
    with pytest.raises(ValueError, match="past the end"):
        delta.count_bits(bitmap, numel)
    with pytest.raises(ValueError, match="bitmap of 3 bytes for 13 elements"):
        delta.count_bits(torch.zeros(3, dtype=torch.uint8), numel)


def test_the_secret_comes_from_the_argument_the_env_or_a_file(monkeypatch, tmp_path, caplog):
    assert resolve_secret() is None
    assert resolve_secret(SECRET) == SECRET.encode()
    monkeypatch.setenv(wire.SECRET_ENV, SECRET)
    assert resolve_secret() == SECRET.encode()
    assert resolve_secret(OTHER) == OTHER.encode()  # the argument wins
    path = tmp_path / "sync.secret"
    path.write_text(OTHER + "\n")
    path.chmod(0o600)
    monkeypatch.setenv(wire.SECRET_FILE_ENV, str(path))
    with pytest.raises(WeightSyncError, match="both FAIRCAST_DS_SYNC_SECRET and FAIRCAST_DS_SYNC_SECRET_FILE"):
        resolve_secret()
    monkeypatch.delenv(wire.SECRET_ENV)
    assert resolve_secret() == OTHER.encode()  # one trailing newline stripped
    assert not caplog.records
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="faircast_ds.export"):
        assert resolve_secret() == OTHER.encode()
    assert "readable by other users" in caplog.text
    monkeypatch.setenv(wire.SECRET_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(WeightSyncError, match="cannot read the secret file"):
        resolve_secret()
    monkeypatch.delenv(wire.SECRET_FILE_ENV)
    for short in ("", "short", b"fifteen bytes!!"):
        with pytest.raises(WeightSyncError, match="at least 16 are required"):
            resolve_secret(short)
    monkeypatch.setenv(wire.SECRET_ENV, "")
    with pytest.raises(WeightSyncError, match="from FAIRCAST_DS_SYNC_SECRET is 0 bytes"):
        resolve_secret()
    with pytest.raises(WeightSyncError, match="at least 16"):
        WeightSender(plain_model(), secret="too short")


@pytest.fixture
def no_outgoing_connections(monkeypatch):
    """The socket layer patched so that any outgoing connection or datagram fails the test instead of
    leaving the machine (a refusal that regressed must not reach 192.0.2.1); the attempts are also
    recorded, should something catch the error."""
    attempts: list[Any] = []

    def refuse(what: str):
        def blocked(sock, address, *args, **kwargs):
            attempts.append((what, address))
            raise AssertionError(f"the test tried to {what} {address!r}: a refusal did not happen")
        return blocked

    for name in ("connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, refuse(name))
    monkeypatch.setattr(socket.socket, "sendto", lambda sock, data, *rest: refuse("sendto")(sock, rest[-1]))
    with pytest.raises(AssertionError, match="tried to connect"):  # the patch is in force
        socket.create_connection(("127.0.0.1", 9), timeout=1)
    attempts.clear()
    yield attempts
    assert attempts == [], f"outgoing connections attempted: {attempts}"


def test_listening_off_loopback_needs_a_secret(no_outgoing_connections):
    model = plain_model()
    for host in ("0.0.0.0", "::"):
        with pytest.raises(WeightSyncError, match=f"refusing to listen on {re.escape(host)} without a shared secret"):
            WeightReceiver(model, host=host, port=0)
    # 192.0.2.1 (TEST-NET-1) is off loopback: refused before any socket is opened (the fixture fails the
    # test on any connect, so nothing can be sent there even if this refusal regressed)
    with pytest.raises(WeightSyncError, match="refusing to send weights to 192.0.2.1 without a shared secret"):
        WeightSender(model, host="192.0.2.1", port=9, timeout=5).sync(version=1)
    assert no_outgoing_connections == []
    rx = WeightReceiver(model, host="0.0.0.0", port=0, secret=SECRET)  # with one, it may
    assert rx.authenticated
    rx.close()
    for host in ("127.0.0.1", "localhost", "::1"):
        assert wire.is_loopback(host)
    assert not wire.is_loopback("10.0.0.1") and not wire.is_loopback("example.com")


def test_a_receiver_without_a_secret_is_refused_by_a_sender_with_one():
    rx = WeightReceiver(plain_model(seed=99), port=0, timeout=5)  # loopback, unauthenticated
    server = Server(rx)
    try:
        with pytest.raises(WeightSyncError, match="the receiver holds no shared secret and this sender does"):
            WeightSender(plain_model(), port=rx.port, timeout=10, secret=SECRET).sync(version=1)
        exc, _ = server.outcome()
        assert isinstance(exc, WeightSyncError) and "ended the handshake" in str(exc) and rx.version is None
    finally:
        server.stop()
        rx.close()


def run_sender(port: int, **env: str) -> subprocess.CompletedProcess:
    environment = cpu_env(**env)
    for var in ENV_VARS:
        if var not in env:
            environment.pop(var, None)
    return subprocess.run([sys.executable, str(DIST / "export_sender.py"), "--port", str(port), "--versions", "1,2",
                           "--timeout", "20"], capture_output=True, text=True, env=environment, cwd=ROOT, timeout=120)


def test_sender_processes_prove_the_secret_from_their_environment(served, tmp_path, caplog):
    rx, server = served
    caplog.set_level(logging.WARNING, logger="faircast_ds.export")
    before = digest(rx.targets.items())
    refused = run_sender(rx.port)  # a trainer started without the secret
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "requires the shared secret and this sender has none" in json.loads(refused.stdout.splitlines()[-1])["error"]
    exc, _ = server.outcome()
    assert isinstance(exc, WeightSyncError) and "ended the handshake" in str(exc)
    assert digest(rx.targets.items()) == before and rx.version is None
    assert any("refused a sender" in r.getMessage() for r in caplog.records)  # and logged
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    ok = run_sender(rx.port, FAIRCAST_DS_SYNC_SECRET_FILE=str(path))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    lines = [json.loads(line) for line in ok.stdout.splitlines() if line.startswith("{")]
    assert [(x["version"], x["kind"]) for x in lines] == [(1, "dense"), (2, "delta")]
    end, updates = server.outcome()
    assert end == "closed" and [u.version for u in updates] == [1, 2]
    assert digest(rx.targets.items()) == lines[-1]["digest"]
