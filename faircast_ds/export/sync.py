"""Weight sync from a DeepSpeed trainer to a separate inference process, dense or as sparse deltas.

Both ends hold the same secret (``export FAIRCAST_DS_SYNC_SECRET=$(python3 -c 'import secrets;
print(secrets.token_hex(32))')`` once, in both environments; or a file named by
``FAIRCAST_DS_SYNC_SECRET_FILE``; or ``secret=``). Trainer side, on every rank (each sync is a
collective of the training job)::

    sender = WeightSender(engine, host="127.0.0.1", port=29600)
    sender.sync()            # after each optimizer step; dense the first time, then deltas

Inference side, in a process that is not part of the training job::

    receiver = WeightReceiver(model, host="127.0.0.1", port=29600)
    receiver.accept(timeout=600)            # a sender joins; names, shapes, dtypes checked
    while (report := receiver.receive(timeout=600)) is not None:
        ...serve with model (hold receiver.lock while reading the weights)...

Both read the served weights through one walk of :class:`~faircast_ds.export.source.ServedSource`.
A dense sync gathers one parameter at a time and rank 0 sends it. A delta sync sends only the
parameters whose bits changed since the last acknowledged sync: each rank compares its own served
shard with its copy of the bits last acknowledged (one bf16 copy of the rank's shard), one
all-reduce of per-parameter counts tells every rank which parameters changed, and only those are
gathered, once each. Rank 0 sends each in the smallest of three encodings (whole, index list,
bitmap; see :mod:`faircast_ds.export.delta`), from the gathered parameter and each rank's bitmap of
its changed elements: it holds one parameter at a time.

Delivery is all-or-nothing: the receiver stages an update and applies it only after the sender's
end marker, all parameters checked; if the sender dies or stalls mid-update the staged data is
dropped, the previous weights stay as they were, and :class:`SyncAborted` says so. The sender keeps
its delta baseline only for updates the receiver acknowledged; after any failure the next sync
reconnects and is dense.

Message protocol (``PROTOCOL``), inside the framed, authenticated channel of
:mod:`faircast_ds.export.channel`: hello/welcome JSON (protocol, parameter names/shapes/dtypes,
versions); per update a JSON header, the receiver's go/no-go, per parameter (in increasing index
order) an int64 triple ``[index, encoding, count]`` and its payload (see
:mod:`faircast_ds.export.delta`; a sparse parameter must use the smaller of the two encodings), an
end triple ``[-1, 0, parameters sent]``, and the receiver's JSON acknowledgement.

Security: both ends must prove the shared secret (``FAIRCAST_DS_SYNC_SECRET``, a file named by
``FAIRCAST_DS_SYNC_SECRET_FILE``, or ``secret=``) before any message is read, and every frame is
authenticated and sequenced. Without a secret the channel works on loopback only. Every failure, a
hostile stream included, raises :class:`WeightSyncError`, closes the session, and leaves the receiver
serving its previous weights and ready for the next :meth:`WeightReceiver.accept`. See
docs/security.md for what is and is not guaranteed.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from faircast_ds._util.dist import from_rank0, rank_world
from faircast_ds.export import delta as delta_encoding
from faircast_ds.export.channel import (
    DEFAULT_HOST,
    SECRET_ENV,
    AcceptTimeout,
    Channel,
    ChannelError,
    Limits,
    Listener,
    WeightSyncError,
    connect,
    resolve_secret,
)
from faircast_ds.export.served import ParamSpec, module_of
from faircast_ds.export.source import ServedItem, ServedReport, ServedSource, Stages, Walk

PROTOCOL = 2  # 2: the framed, authenticated channel (1 was the gloo channel)
_END = -1
logger = logging.getLogger("faircast_ds.export")


class SyncAborted(ChannelError):
    """The sender vanished or stalled; the receiver's weights are those of its last complete update."""


def spec_list(specs: list[ParamSpec]) -> list[list[Any]]:
    return [[s.name, list(s.shape), str(s.dtype)] for s in specs]


def spec_mismatch(mine: list[list[Any]], theirs: list[list[Any]], limit: int = 5) -> str | None:
    """A readable description of how two parameter lists differ, or None if they are equal."""
    if mine == theirs:
        return None
    a = {n: (s, d) for n, s, d in mine}
    b = {n: (s, d) for n, s, d in theirs}
    problems = []
    missing = [n for n in a if n not in b]
    extra = [n for n in b if n not in a]
    if missing:
        problems.append(f"{len(missing)} parameter(s) the receiver has and the sender does not send, "
                        f"e.g. {missing[:limit]}")
    if extra:
        problems.append(f"{len(extra)} parameter(s) the sender sends and the receiver does not have, "
                        f"e.g. {extra[:limit]}")
    differ = [f"{n}: sender {list(b[n][0])} {b[n][1]}, receiver {list(a[n][0])} {a[n][1]}"
              for n in a if n in b and (list(a[n][0]), a[n][1]) != (list(b[n][0]), b[n][1])]
    if differ:
        problems.append(f"{len(differ)} parameter(s) differ in shape or dtype: " + "; ".join(differ[:limit]))
    if not problems:
        problems.append("the parameters are listed in a different order")
    return "; ".join(problems)


class WeightSender:
    """The trainer's end. Construct, :meth:`sync` and :meth:`close` on every rank of the training job;
    only rank 0 talks to the receiver.

    ``model`` is a DeepSpeed engine (or an ``nn.Module``, then ``version`` must be given to
    :meth:`sync`). ``delta`` allows sparse updates; under ZeRO-3 they need Fair Cast attached to the
    engine (any mode) to read each rank's served shard in place. ``timeout`` bounds every wait on the
    channel, in seconds. ``secret`` is the shared secret the receiver holds (default:
    ``FAIRCAST_DS_SYNC_SECRET`` or the file ``FAIRCAST_DS_SYNC_SECRET_FILE`` names, read on rank 0);
    without one only a loopback receiver that holds none is reached. ``bind`` is the local address
    rank 0 connects from (default: any). Collectives run on the default process group: pure data
    parallelism is assumed.
    """

    def __init__(self, model: Any, host: str = DEFAULT_HOST, port: int = 29600, *, timeout: float = 60.0,
                 delta: bool = True, bind: str | None = None, secret: str | bytes | None = None,
                 source: ServedSource | None = None) -> None:
        if secret is not None:
            resolve_secret(secret)  # a short or empty secret= is refused here, on every rank alike
        self.model = model
        self.host, self.port, self.timeout, self.bind = host, port, timeout, bind
        self._secret = secret  # None: from the environment, when rank 0 connects
        self.source = source if source is not None else ServedSource(model, delta=delta)
        self.specs = self.source.specs
        self.numel = self.source.numel
        self.rank, self.world = rank_world()
        self.channel: Channel | None = None
        self.can_delta = delta and self.source.can_delta
        self.last_walk: Walk | None = None
        self.stages = Stages()  # the current sync's (issue 32 item 1)
        self.collectives = 0

    @property
    def _baseline_version(self) -> int | None:
        """The version the receiver acknowledged in this session (what a delta is against)."""
        return self.source.acknowledged

    def connect(self) -> None:
        """Join the receiver and exchange hello/welcome (collective; raises on every rank if refused)."""
        error = None
        if self.rank == 0:
            error = self._on_rank0(self._hello)
        error = from_rank0(error)
        self.source.require_dense()  # a new session: the receiver holds nothing of ours yet
        if error is not None:
            raise WeightSyncError(error)

    def _hello(self) -> None:
        bound = _json_limit(self.specs) + (1 << 20)  # the receiver's replies quote at most a few parameters
        self.channel = connect(self.host, self.port, self.timeout, self.bind, secret=self._secret,
                               limits=Limits(max_json=bound, max_frame=bound))
        self.channel.send_json({"type": "hello", "protocol": PROTOCOL, "params": spec_list(self.specs)})
        reply = self.channel.recv_json()
        if reply.get("ok") is not True:
            self.channel.close()
            raise WeightSyncError(f"the weight receiver at {self.host}:{self.port} refused this sender: "
                                  f"{reply.get('error')}")

    def _on_rank0(self, fn: Callable[[], Any]) -> str | None:
        try:
            fn()
            return None
        except WeightSyncError as exc:
            if self.channel is not None:
                self.channel.close()
            return str(exc)

    def _session_alive(self) -> bool:
        """Whether rank 0 still has a session (collective)."""
        return bool(self._from_rank0(self.channel is not None and not self.channel.closed if self.rank == 0 else None))

    def _from_rank0(self, obj: Any) -> Any:
        """:func:`from_rank0`, timed and counted in this sync's stages."""
        if self.world == 1:
            return obj
        self.collectives += 1
        with self.stages("trainer.collectives"):
            return from_rank0(obj)

    def sync(self, version: int | None = None, kind: str = "auto", *,
             on_param: Callable[[ServedItem], None] | None = None,
             groups: Mapping[str, Sequence[str]] | None = None) -> ServedReport:
        """Push the served weights (collective). ``version`` defaults to the engine's ``global_steps``.
        ``kind``: ``auto`` (delta when the receiver acknowledged a previous sync in this session, else
        dense), ``dense``, or ``delta``. Reconnects first if the session is gone. Raises
        WeightSyncError on every rank if the update was refused or not delivered (the receiver then
        still serves its previous weights). ``on_param`` sees every parameter the walk yields, on
        every rank, while its bits are at hand (a push's verification digests: no second walk).
        ``groups`` (name -> names, the same on every rank): a delta walk also yields the unchanged
        members of a group with a changed member, to ``on_param`` only (they are not sent)."""
        began = time.perf_counter()
        self.stages, self.collectives, self._engine_stages = Stages(), 0, {}
        if version is None:
            version = getattr(self.model, "global_steps", None)
            if version is None:
                raise ValueError("sync(version=...) is required for a model that is not a DeepSpeed engine")
        if kind not in ("auto", "dense", "delta"):
            raise ValueError(f"kind must be 'auto', 'dense' or 'delta', not {kind!r}")
        if not self._session_alive():
            self.connect()
        use_delta = kind != "dense" and self.can_delta and self._baseline_version is not None
        if kind == "delta" and not use_delta:
            raise WeightSyncError("a delta sync needs a previous sync acknowledged in this session" + (
                "" if self.can_delta else " and each rank's served shard (under ZeRO-3: Fair Cast attached)"))
        error, sent_before, mac_before, io_before = None, 0, 0.0, 0.0
        if self.rank == 0:
            sent_before = self.channel.sent_bytes
            mac_before, io_before = self.channel.mac_seconds, self.channel.io_seconds
            header = {"type": "update", "kind": "delta" if use_delta else "dense", "version": int(version),
                      "base": self._baseline_version if use_delta else None}
            error = self._on_rank0(lambda: self._open_update(header))
        error = self._from_rank0(error)
        if error is not None:
            self.source.require_dense()
            raise WeightSyncError(error)
        walk = self.source.walk("delta" if use_delta else "dense", masks=use_delta, groups=groups,
                                version=int(version))
        self.last_walk = walk
        failure, params, carried = self._stream(walk, on_param)
        if self.rank == 0 and failure is None:
            failure = self._on_rank0(lambda: self._finish(params))
        sent = self.channel.sent_bytes - sent_before if self.rank == 0 else 0
        if self.rank == 0 and self.channel is not None:
            self.stages.add("trainer.mac", self.channel.mac_seconds - mac_before)
            self.stages.add("trainer.send", self.channel.io_seconds - io_before)
        self.stages.add("trainer.walk", walk.walk_seconds)
        if walk.kind == "delta" and self.world > 1:
            self.collectives += 1  # the changed-count all-reduce (mask gathers: one per sparse parameter)
        failure, sent, carried = self._from_rank0((failure, sent, carried))
        if failure is not None:
            walk.abort()
            self.source.require_dense()  # the session is closed: the next one starts dense
            raise WeightSyncError(f"weight sync of version {version} not delivered: {failure}")
        with self.stages("trainer.acknowledge"):  # each rank copies its baseline for the next delta
            walk.acknowledge()  # the receiver applied it whole and said so
        stages = self.stages.as_dict()
        stages.update(self._from_rank0(self._engine_stages))
        report = walk.report(bytes=sent, params=params, elements=carried, stages=stages,
                             collectives=self.collectives)
        return dataclasses.replace(report, seconds=time.perf_counter() - began)

    def _open_update(self, header: dict[str, Any]) -> None:
        self.channel.send_json(header)
        reply = self.channel.recv_json()
        if reply.get("ok") is not True:
            raise WeightSyncError(f"the weight receiver refused update {header['version']}: {reply.get('error')}")

    def _finish(self, params: int) -> None:
        self.channel.send_tensor(torch.tensor([_END, 0, params], dtype=torch.int64))
        with self.stages("trainer.wait_ack"):
            ack = self.channel.recv_json()
        if ack.get("ok") is not True:
            raise WeightSyncError(f"the weight receiver rejected the update: {ack.get('error')}")
        engine = ack.get("stages")
        if isinstance(engine, dict):
            self._engine_stages = {f"engine.{k}": float(v) for k, v in engine.items()
                                   if isinstance(v, (int, float)) and isinstance(k, str)}

    def _send(self, failure: str | None, index: int, encoding: int, count: int,
              payload: list[torch.Tensor]) -> str | None:
        """Rank 0 sends one parameter unless an earlier send failed (the other ranks' collectives go on)."""
        if failure is not None:
            return failure
        try:
            self.channel.send_tensor(torch.tensor([index, encoding, count], dtype=torch.int64))
            for t in payload:
                self.channel.send_tensor(t)
        except WeightSyncError as exc:
            return str(exc)
        return None

    def _stream(self, walk: Walk, on_param: Callable[[ServedItem], None] | None) -> tuple[str | None, int, int]:
        """Every changed parameter the walk yields, encoded on rank 0 in the smallest of dense, index list
        and bitmap; rank 0 holds one parameter's payload at a time. Returns (failure, parameters
        carried, elements carried)."""
        failure, params, carried = None, 0, 0
        for item in walk:  # a collective under ZeRO-3: every rank consumes it to the end
            if on_param is not None:
                with self.stages("trainer.checksums"):
                    on_param(item)
            if walk.kind == "delta" and item.changed == 0:
                continue  # an unchanged member of a changed group: seen, not sent
            params += 1
            if self.rank != 0:
                continue
            t0 = time.perf_counter()
            bits = delta_encoding.bits_view(item.tensor)
            if item.mask is None:  # dense walk, or a parameter most of whose elements changed
                carried += item.spec.numel
                failure = self._send(failure, item.index, delta_encoding.DENSE, item.spec.numel, [bits])
                continue
            carried += item.changed
            encoding = delta_encoding.choose(item.spec.numel, item.changed, bits.element_size())
            if encoding == delta_encoding.COO:
                first = item.mask.nonzero().view(-1).to(delta_encoding.index_dtype(item.spec.numel))
            else:
                first = delta_encoding.mask_to_bitmap(item.mask)
            values = bits[item.mask]
            self.stages.add("trainer.encode", time.perf_counter() - t0)
            failure = self._send(failure, item.index, encoding, item.changed, [first, values])
        return failure, params, carried

    def close(self) -> None:
        """End the session cleanly (the receiver's :meth:`WeightReceiver.receive` returns None)."""
        if self.rank == 0 and self.channel is not None and not self.channel.closed:
            try:
                self.channel.send_json({"type": "bye"})
            except WeightSyncError:
                pass
            self.channel.close()
        self.channel = None
        self.source.require_dense()


def _json_limit(specs: list[ParamSpec]) -> int:
    """The largest JSON message a receiver of these parameters reads: a hello listing parameters like its
    own, with room for longer names (twice its own list, plus 4 KiB)."""
    return 4096 + 2 * len(json.dumps(spec_list(specs), separators=(",", ":")))


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _spec_list_problem(params: Any, limit: int) -> str | None:
    """What is malformed in a hello's parameter list (None when it is a list of [name, shape, dtype])."""
    if not isinstance(params, list):
        return f"params is {type(params).__name__}, not a list"
    if len(params) > limit:
        return f"{len(params)} parameters listed, more than this receiver could ever match"
    seen = set()
    for i, item in enumerate(params):
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and isinstance(item[1], list)
                and isinstance(item[2], str)
                and all(type(d) is int and 0 <= d < 2**62 for d in item[1])):
            return f"params[{i}] is {_short(item)}, not [name, [dims...], dtype]"
        if item[0] in seen:
            return f"parameter {_short(item[0])} is listed twice"
        seen.add(item[0])
    return None


class WeightReceiver:
    """The inference process's end: receives updates into ``model``'s parameters (or a mapping of
    name -> tensor), all-or-nothing. Listens on ``host:port`` only (``port`` 0 picks a free one,
    see :attr:`port`). ``timeout`` bounds each wait inside an update, in seconds; a connection must
    finish its handshake within ``handshake_timeout`` (default ``min(timeout, 10)``).

    ``secret``: the shared secret every sender must prove (default: ``FAIRCAST_DS_SYNC_SECRET``, or
    the file ``FAIRCAST_DS_SYNC_SECRET_FILE`` names). Without one the receiver listens on loopback
    addresses only (binding elsewhere is refused) and any local process can push weights.

    Refuses, with a clear error to both sides: a sender that does not prove the secret, any frame
    that breaks the protocol (magic, version, sequence, length, tag), another protocol, parameters
    that differ in names, shapes or dtypes, an update older than the weights served (unless
    ``allow_rollback``), a delta against weights this receiver does not hold, and any malformed
    update. Every refusal raises :class:`WeightSyncError`, is logged, closes the session and leaves
    the weights as they were; the next :meth:`accept` serves the next sender. No length field makes
    it allocate more than the parameter the field is for. Hold :attr:`lock` while reading the
    weights to never see an update half applied.
    """

    def __init__(self, model: torch.nn.Module | Mapping[str, torch.Tensor], host: str = DEFAULT_HOST, port: int = 0,
                 *, timeout: float = 60.0, allow_rollback: bool = False, secret: str | bytes | None = None,
                 handshake_timeout: float | None = None) -> None:
        if isinstance(model, Mapping):
            self.targets = dict(model)
        else:
            self.targets = {n: p for n, p in module_of(model).named_parameters()}
        self.names = list(self.targets)
        self.specs = [ParamSpec(n, tuple(t.shape), t.dtype) for n, t in self.targets.items()]
        self.numel = sum(s.numel for s in self.specs)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.targets.values())  # the model's own size
        self.timeout = timeout
        self.allow_rollback = allow_rollback
        key = resolve_secret(secret)
        json_limit = _json_limit(self.specs)
        largest = max([t.numel() * t.element_size() for t in self.targets.values()], default=0)
        self.limits = Limits(max_json=json_limit, max_frame=max(largest, json_limit))
        self.listener = Listener(host, port, timeout, secret=key, limits=self.limits,
                                 handshake_timeout=handshake_timeout)
        self.authenticated = key is not None
        if key is None:
            logger.warning("faircast-ds weight receiver %s:%d is not authenticated: any local process can push "
                           "weights; set %s on both ends", self.host, self.port, SECRET_ENV)
        self.lock = threading.Lock()
        self.channel: Channel | None = None
        self.version: int | None = None  # of the weights now served, None before the first update
        self.updates = 0
        self.refusals = 0  # sessions ended by a refusal or failure
        self.last_error: str | None = None
        self.peak_staged_bytes = 0  # the most bytes one update held staged (bounded by the model's size)
        self._synced_in_session = False

    @property
    def host(self) -> str:
        return self.listener.host

    @property
    def port(self) -> int:
        return self.listener.port

    @property
    def connected(self) -> bool:
        return self.channel is not None and not self.channel.closed

    @property
    def largest_allocation(self) -> int:
        """The largest buffer a frame made this receiver allocate so far, in bytes."""
        return self.limits.largest

    def accept(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a sender, authenticate it, then check its hello. Raises
        WeightSyncError (the sender is told why, where it can be) for a refused sender; the receiver
        keeps its weights and the next call waits for the next sender."""
        if self.connected:
            raise WeightSyncError("a sender is already connected")
        self._synced_in_session = False
        self.channel = None
        try:
            self.channel = self.listener.accept(timeout)
        except AcceptTimeout:
            raise  # nobody came: not a refusal
        except ChannelError as exc:
            raise self._fail(SyncAborted(f"the sender vanished during the handshake: {exc}")) from None
        except WeightSyncError as exc:
            raise self._fail(WeightSyncError(f"refused a sender: {exc}")) from None
        except Exception as exc:  # noqa: BLE001 - whatever happens, the receiver stays up and keeps its weights
            raise self._fail(WeightSyncError(f"refused a sender after an internal error: {type(exc).__name__}: "
                                             f"{exc}")) from exc
        try:
            hello = self.channel.recv_json()
            error = self._check_hello(hello)
        except ChannelError as exc:
            raise self._fail(SyncAborted(f"the sender vanished during the handshake: {exc}")) from None
        except WeightSyncError as exc:
            raise self._fail(WeightSyncError(f"refused a sender: {exc}")) from None
        except Exception as exc:  # noqa: BLE001
            raise self._fail(WeightSyncError(f"refused a sender after an internal error: {type(exc).__name__}: "
                                             f"{exc}")) from exc
        self._reply(error)
        if error is not None:
            raise self._fail(WeightSyncError(f"refused a sender: {error}"))

    def _check_hello(self, hello: dict[str, Any]) -> str | None:
        protocol = hello.get("protocol")
        if hello.get("type") != "hello" or type(protocol) is not int or protocol != PROTOCOL:
            return (f"protocol mismatch: receiver speaks faircast-ds weight sync protocol {PROTOCOL}, the sender "
                    f"sent {_short(hello.get('type'))} protocol {_short(protocol)}")
        params = hello.get("params")
        problem = _spec_list_problem(params, 4 * len(self.specs) + 64)
        if problem is not None:
            return f"malformed hello: {problem}"
        problem = spec_mismatch(spec_list(self.specs), params)
        return None if problem is None else f"model mismatch: {problem}"

    def _reply(self, error: str | None, **extra: Any) -> None:
        if not self.connected:
            return
        try:
            self.channel.send_json({"ok": error is None, "error": error, "version": self.version, **extra})
        except ChannelError:
            pass  # the sender is gone; the next receive reports it

    def _fail(self, exc: WeightSyncError) -> WeightSyncError:
        """Record and log a refusal or failure, close the session; the weights are untouched."""
        self.last_error = str(exc)
        self.refusals += 1
        logger.warning("faircast-ds weight receiver %s:%d: %s", self.host, self.port, exc)
        if self.channel is not None:
            self.channel.close()
        return exc

    def receive(self, timeout: float) -> ServedReport | None:
        """Wait up to ``timeout`` seconds for the next update and apply it whole. Returns its report,
        or None when the sender ended the session. Raises SyncAborted if the sender vanished or
        stalled, WeightSyncError if the update or any frame of it was refused or malformed; either way
        the session is closed and the weights are those of the last complete update."""
        if not self.connected:
            raise WeightSyncError("no sender connected; call accept() first")
        try:
            return self._receive(timeout)
        except WeightSyncError as exc:
            raise self._fail(exc) from None
        except Exception as exc:  # noqa: BLE001 - whatever happens, the receiver stays up and keeps its weights
            raise self._fail(WeightSyncError(
                f"update discarded after an internal error, still serving version {self.version}: "
                f"{type(exc).__name__}: {exc}")) from exc

    def _receive(self, timeout: float) -> ServedReport | None:
        began = time.perf_counter()
        received_before = self.channel.received_bytes
        mac_before, io_before = self.channel.mac_seconds, self.channel.io_seconds
        try:
            header = self.channel.recv_json(timeout)
        except ChannelError as exc:
            raise SyncAborted(f"the sender disconnected or went silent between updates ({exc}); "
                              f"still serving version {self.version}") from None
        except WeightSyncError as exc:
            raise WeightSyncError(f"refused the sender's message, session closed, still serving version "
                                  f"{self.version}: {exc}") from None
        if header.get("type") == "bye" and len(header) == 1:
            self.channel.close()
            return None
        error = self._check_header(header)
        self._reply(error)
        if error is not None:
            raise WeightSyncError(f"refused update: {error}")
        version, is_delta = header["version"], header["kind"] == "delta"
        staged: dict[int, tuple[int, torch.Tensor | None, torch.Tensor]] = {}
        changed, staged_bytes, last = 0, 0, -1
        try:
            while True:
                index, encoding, count = (int(v) for v in self.channel.recv_tensor(3, torch.int64))
                if index == _END:
                    if encoding != 0 or count != len(staged):
                        raise ValueError(f"end marker [{index}, {encoding}, {count}] after {len(staged)} parameters")
                    break
                if not 0 <= index < len(self.specs):
                    raise ValueError(f"parameter index {index} out of range [0, {len(self.specs)})")
                if index <= last:
                    raise ValueError(f"parameter index {index} after {last}: repeated or out of order")
                last = index
                item = self._receive_param(index, encoding, count, is_delta)
                staged[index] = item
                staged_bytes += sum(t.numel() * t.element_size() for t in item[1:] if t is not None)
                self.peak_staged_bytes = max(self.peak_staged_bytes, staged_bytes)
                changed += count
        except ChannelError as exc:
            raise SyncAborted(
                f"the sender vanished mid-update (version {version}, {len(staged)} of "
                f"{'?' if is_delta else len(self.specs)} parameters received): the update was discarded, still "
                f"serving version {self.version} ({exc})") from None
        except WeightSyncError as exc:
            raise WeightSyncError(f"malformed update {version} discarded, session closed, still serving version "
                                  f"{self.version}: {exc}") from None
        except ValueError as exc:
            self._reply(f"malformed update: {exc}")
            raise WeightSyncError(f"malformed update {version} discarded, still serving "
                                  f"version {self.version}: {exc}") from None
        if not is_delta and len(staged) != len(self.specs):
            missing = [self.names[i] for i in range(len(self.specs)) if i not in staged]
            self._reply(f"dense update without {missing[:5]}")
            raise WeightSyncError(f"dense update {version} is missing {len(missing)} "
                                  f"parameter(s), e.g. {missing[:5]}; discarded")
        if self.version is not None and int(version) == self.version and not all(
                delta_encoding.same_bits(self.targets[self.names[i]], *item) for i, item in staged.items()):
            # a version names one set of bits: other bits under the served version would make the
            # engine's weight version (and every check keyed by it) lie
            self._reply(f"update version {version} carries bits other than those served under version {version}")
            raise WeightSyncError(f"refused update {version}: it changes the weights this receiver already serves "
                                  f"as version {version}; versions must increase when the weights change")
        t_stage = time.perf_counter()
        with self.lock:  # validated in full: nothing below can fail halfway
            for index, (encoding, first, values) in staged.items():
                target = self.targets[self.names[index]]
                if encoding == delta_encoding.COO:
                    delta_encoding.apply(target, first, values)
                elif encoding == delta_encoding.BITMAP:
                    delta_encoding.apply_bitmap(target, first, values)
                else:
                    delta_encoding.bits_view(target).copy_(values)
            self.version = int(version)
            self.updates += 1
            self._synced_in_session = True
        stages = {"receive": self.channel.io_seconds - io_before, "mac": self.channel.mac_seconds - mac_before,
                  "stage": time.perf_counter() - t_stage}
        stages["other"] = max(0.0, t_stage - began - stages["receive"] - stages["mac"])  # waits, parsing, checks
        received = self.channel.received_bytes - received_before
        self._reply(None, stages=stages)
        self.last_error = None
        return ServedReport(self.version, header["kind"], len(staged), changed, self.numel, received,
                          time.perf_counter() - began, stages=stages)

    def _check_header(self, header: dict[str, Any]) -> str | None:
        if header.get("type") != "update" or header.get("kind") not in ("dense", "delta"):
            return f"unexpected message {_short(header)}"
        version = header.get("version")
        if type(version) is not int or not 0 <= version < 2**63:
            return f"update without an integer version in [0, 2^63): {_short(version)}"
        if self.version is not None and version < self.version:
            first = not self._synced_in_session
            if not (first and self.allow_rollback):
                return (f"update version {version} is older than the weights served (version {self.version}); "
                        + ("a stale sender? start the receiver with allow_rollback=True to accept a trainer resumed "
                           "from an earlier checkpoint" if first else "versions must not decrease within a session"))
        base = header.get("base")
        if header["kind"] == "delta" and (not self._synced_in_session or type(base) is not int
                                          or base != self.version):
            return (f"delta against version {_short(base)} but this receiver serves version {self.version}"
                    + ("" if self._synced_in_session else " from another session") + "; send a dense update")
        return None

    def _receive_param(self, index: int, encoding: int, count: int,
                       is_delta: bool) -> tuple[int, torch.Tensor | None, torch.Tensor]:
        """One parameter's payload, validated against this receiver's own spec before anything is
        allocated: (encoding, indices or bitmap or None, values)."""
        spec = self.specs[index]
        vdtype = delta_encoding.bits_dtype(spec.dtype)
        if encoding == delta_encoding.DENSE:
            if count != spec.numel:
                raise ValueError(f"{spec.name}: dense payload of {count} elements, expected {spec.numel}")
            return encoding, None, self.channel.recv_tensor(count, vdtype)
        if not is_delta or encoding not in (delta_encoding.COO, delta_encoding.BITMAP) or not 0 < count <= spec.numel:
            raise ValueError(f"{spec.name}: encoding {encoding} with {count} elements is not valid here")
        element_size = torch.empty((), dtype=vdtype).element_size()
        if encoding != delta_encoding.choose(spec.numel, count, element_size):
            raise ValueError(f"{spec.name}: {delta_encoding.ENCODINGS[encoding]} for {count} of {spec.numel} "
                             "elements, where the other encoding is smaller")
        try:
            if encoding == delta_encoding.COO:
                first = self.channel.recv_tensor(count, delta_encoding.index_dtype(spec.numel))
                delta_encoding.check_indices(first, spec.numel)
            else:
                first = self.channel.recv_tensor((spec.numel + 7) // 8, torch.uint8)
                found = delta_encoding.count_bits(first, spec.numel)
                if found != count:
                    raise ValueError(f"bitmap has {found} bits set, header says {count}")
        except ValueError as exc:
            raise ValueError(f"{spec.name}: {exc}") from None
        return encoding, first, self.channel.recv_tensor(count, vdtype)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.listener.close()
