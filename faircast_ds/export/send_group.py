"""Per-rank sends through a collective library (issue 32 item 7, the ``group`` plane): the trainer ranks and
the engine form one small process group of their own, apart from the training job's, and each rank sends
its own served slices to the engine with point-to-point ``send``/``recv`` (the shape of vLLM's
``nccl_m2n``: no gather to one rank). NCCL on GPUs, gloo on CPUs; the code is the same.

**Rendezvous.** The engine hosts a ``TCPStore`` and tells each rank where it is, under a fresh random
prefix, only on that rank's authenticated channel (after the handshake and the hello the ledger
accepted). The group has ``world + 1`` members: the trainer ranks keep their own numbers and the engine is
the last. One :class:`Generation` is one group; a rank that leaves ends it, and the ranks then join a new
one together (:class:`~faircast_ds.vllm.transfer.served_push.ServedPush` closes every rank's end after a
failed push).

**What it does not authenticate.** The bytes of a send carry no MAC, and the store and the library's own
connections accept any peer that reaches them: a peer on the network can join a rendezvous whose prefix
it guesses, send bytes a rank should have sent, or (gloo) abort the engine's process with a malformed
message (docs/security.md). The content is vouched for as on the shared-memory plane: each rank's write
digest (sampled elements of what it meant to send) in the commit, then the kernels read back against the
staging copy after the load. Use it on a network you trust, as NCCL is used.

Only gloo runs here (no GPU was lent): the NCCL branch is the same calls with ``ProcessGroupNCCL`` and
device tensors, and has not run.
"""
from __future__ import annotations

import datetime
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from faircast_ds.export.plane import PlaneError

BACKENDS = ("gloo", "nccl")
STORE_TIMEOUT = 60.0  # seconds a member waits for the store


def backend_for(device: torch.device | str) -> str:
    """``"nccl"`` for CUDA memory, ``"gloo"`` for host memory."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def build(info: dict[str, Any], rank: int, local_host: str, store: Any = None) -> Any:
    """This member's end of the group ``info`` describes (``host``, ``port``, ``prefix``, ``size``,
    ``backend``, ``timeout``): blocks until every member joined or the timeout passed (then raises
    :class:`PlaneError`). ``local_host``: the address the other members reach this one at (the gloo
    device binds it). ``store``: the engine's own master store (the ranks connect to it)."""
    problem = check_info(info)
    if problem is not None:
        raise PlaneError(f"the engine described its send group oddly: {problem}")
    timeout = datetime.timedelta(seconds=float(info["timeout"]))
    try:
        if store is None:
            store = dist.TCPStore(info["host"], int(info["port"]), is_master=False,
                                  timeout=datetime.timedelta(seconds=STORE_TIMEOUT))
        prefixed = dist.PrefixStore(info["prefix"], store)
        if info["backend"] == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return dist.ProcessGroupNCCL(prefixed, rank, int(info["size"]), options)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        options._timeout = timeout
        return dist.ProcessGroupGloo(prefixed, rank, int(info["size"]), options)
    except PlaneError:
        raise
    except Exception as exc:  # noqa: BLE001 - the library's own errors, named
        raise PlaneError(f"joining the send group as member {rank} of {info['size']} ({info['backend']}) failed: "
                         f"{type(exc).__name__}: {exc}") from None


def check_info(info: Any) -> str | None:
    """Why ``info`` is not a send group's description (None if it is)."""
    if not isinstance(info, dict):
        return "not an object"
    kinds = {"host": str, "port": int, "prefix": str, "size": int, "backend": str, "timeout": (int, float)}
    for key, kind in kinds.items():
        if not isinstance(info.get(key), kind) or isinstance(info.get(key), bool):
            return f"{key} is {info.get(key)!r}"
    if info["backend"] not in BACKENDS:
        return f"backend {info['backend']!r} is not one of {BACKENDS}"
    if not 0 < info["port"] < 65536 or info["size"] < 2 or info["timeout"] <= 0:
        return f"port {info['port']}, size {info['size']}, timeout {info['timeout']}"
    return None


def send(group: Any, tensor: torch.Tensor, dst: int, timeout: float) -> None:
    """Send ``tensor`` to member ``dst``; returns once it is sent, or raises after ``timeout`` seconds
    (a timed wait: NCCL then blocks the calling thread too, instead of only queueing the wait)."""
    group.send([tensor], dst, 0).wait(datetime.timedelta(seconds=timeout))


def recv(group: Any, tensor: torch.Tensor, src: int, timeout: float) -> None:
    """Receive into ``tensor`` from member ``src`` (its size is what the sender must send)."""
    group.recv([tensor], src, 0).wait(datetime.timedelta(seconds=timeout))


def shut(group: Any) -> None:
    """Tear this member's side of a group down (NCCL: its communicators, on the engine's GPU). Best
    effort: a group the library already tore down is left alone. gloo's pending receive is not cut
    short by it: it ends when its peer's connection closes or its timeout passes."""
    for name in ("abort", "shutdown"):
        try:
            getattr(group, name)()
            return
        except Exception:  # noqa: BLE001 - not supported by this backend or already gone: try the next
            continue


@dataclass
class Generation:
    """One send group: its prefix, the trainer world it serves, the ranks that joined it, and the engine's
    end once built (or why it could not be)."""

    token: str
    world: int
    members: set[int] = field(default_factory=set)
    group: Any = None
    error: str | None = None
    ended: str | None = None
    built: threading.Event = field(default_factory=threading.Event)


class Rendezvous:
    """The engine's side: the store, and the current :class:`Generation` (thread-safe: each rank's
    connection is served on its own thread)."""

    def __init__(self, host: str, backend: str, timeout: float) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"a send group's backend is one of {BACKENDS}, not {backend!r}")
        self.host, self.backend, self.timeout = host, backend, float(timeout)
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=STORE_TIMEOUT))
        self.port = self.store.port
        self._lock = threading.Lock()
        self.current: Generation | None = None
        self.generations = 0

    def join(self, rank: int, world: int, engine_host: str) -> tuple[Generation, dict[str, Any]]:
        """Rank ``rank`` of ``world`` joins the current group, or opens a new one (the first rank to join
        after the last ended, a different world, or a rank joining twice). Returns the group and the
        description the rank builds its end from. ``engine_host``: the address the rank reached the
        engine at (where the engine's end listens)."""
        with self._lock:
            gen = self.current
            if gen is None or gen.ended is not None or gen.world != world or rank in gen.members:
                if gen is not None and gen.ended is None:
                    gen.ended = f"a new send group replaced it (rank {rank} joined again)"
                gen = self.current = Generation(secrets.token_hex(16), world)
                self.generations += 1
                threading.Thread(target=self._build, args=(gen, engine_host), daemon=True,
                                 name="faircast-ds send group").start()
            gen.members.add(rank)
        return gen, self._info(gen)

    def _info(self, gen: Generation) -> dict[str, Any]:
        """The description of ``gen`` that its members build their ends from."""
        return {"host": self.host, "port": self.port, "prefix": f"faircast-ds/{gen.token}/", "size": gen.world + 1,
                "backend": self.backend, "timeout": self.timeout}

    def _build(self, gen: Generation, engine_host: str) -> None:
        try:
            gen.group = build(self._info(gen), gen.world, engine_host, store=self.store)
        except PlaneError as exc:
            gen.error = str(exc)
        finally:
            gen.built.set()

    def end(self, gen: Generation | None, why: str) -> None:
        """A member of ``gen`` left: the group is over (a later join opens a new one)."""
        if gen is None:
            return
        with self._lock:
            gen.ended = gen.ended or why
        if gen.built.is_set() and gen.group is not None:
            shut(gen.group)  # a receive still posted from the member that left fails now

    def ready(self, gen: Generation) -> Any:
        """The engine's end of ``gen`` once every member joined; :class:`PlaneError` if it ended or could
        not be built within the timeout."""
        if not gen.built.wait(self.timeout + STORE_TIMEOUT):
            raise PlaneError("the send group was not formed in time: a trainer rank did not join it")
        if gen.error is not None:
            raise PlaneError(gen.error)
        if gen.ended is not None:
            raise PlaneError(f"the send group ended: {gen.ended}; the trainer's ranks join a new one")
        return gen.group

    def close(self) -> None:
        with self._lock:
            gen, self.current = self.current, None
        self.end(gen, "the engine's plane closed")
        self.store = None
