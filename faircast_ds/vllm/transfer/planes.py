"""The planes of a push into ``vllm serve``, by name: the one place where a plane's name is read.

A plane is how the served bits cross from the trainer ranks into the engine's staging segment
(:mod:`faircast_ds.vllm.transfer.segment`); each has one class on each end:

==========  =====================  ===================  ==============================================
name        trainer rank's end     engine's end         where it serves
==========  =====================  ===================  ==============================================
``shm``     :class:`ShmWriter`     :class:`ShmHost`     the trainer and the server on one host (memfd)
``net``     :class:`NetWriter`     :class:`NetHost`     any host (each rank's authenticated connection)
``group``   :class:`GroupWriter`   :class:`GroupHost`   any host, a network you trust (gloo / NCCL sends)
==========  =====================  ===================  ==============================================

There is no other way in (the TCP push over rank 0's channel is gone, CHANGELOG.md; ``plane="tcp"`` is refused,
naming these three). Everything else asks a :class:`Plane` (or an end) what it needs: never compare a
plane's name (the layout test counts such comparisons outside this module).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from faircast_ds.export.channel import free_port
from faircast_ds.export.served import ParamSpec
from faircast_ds.vllm.transfer.segment import (GroupHost, GroupWriter, NetHost, NetWriter, SegmentHost, SegmentWriter,
                                               ShmHost, ShmWriter, socket_name)

_NETWORKED = frozenset({"port", "host", "check_columns"})


@dataclass(frozen=True)
class Plane:
    """One way in: its ``name``, its two ends, whether the trainer and the engine must share a host
    (``local``: a local socket, not an address; without a shared secret its ends take only processes of
    one user), and the :class:`ServedPush` options it takes besides the common ones."""

    name: str
    writer: type[SegmentWriter]
    host: type[SegmentHost]
    local: bool
    options: frozenset[str]
    where: str  # one line: where it serves

    def place(self, host: str, port: int) -> tuple[str | None, int]:
        """Rank 0: where the engine's end listens — a fresh local socket name (``local``), or ``port`` of
        ``host`` (0: a free port of this host, for an engine on this host)."""
        return (socket_name(), 0) if self.local else (None, port or free_port(host))

    def open_writer(self, name: str | None, host: str, port: int, specs: Sequence[ParamSpec],
                    slices: Sequence[Any], **kw: Any) -> SegmentWriter:
        """A trainer rank's end, to the place :meth:`place` chose (``name``, or ``host:port``)."""
        if self.local:
            return self.writer(name, specs, slices, **kw)
        return self.writer(None, specs, slices, address=(host, port), **kw)

    def open_host(self, specs: Sequence[ParamSpec], info: Any, device: Any) -> SegmentHost:
        """The engine's end for the trainer's ``init_info`` (``socket``; or ``host``, ``port``), the model
        on ``device``. ValueError where ``info`` does not say where."""
        if self.local:
            if not isinstance(info.socket, str) or not info.socket:
                raise ValueError(f"faircast init_info with plane {self.name!r} needs 'socket' (the local socket's name)")
            return self.host(specs, info.socket, timeout=float(info.timeout))
        if type(info.port) is not int or not 0 < info.port < 65536:
            raise ValueError(f"faircast init_info with plane {self.name!r} needs the 'port' to listen on, "
                             f"got {info.port!r}")
        return self.host(specs, address=(str(info.host), info.port), timeout=float(info.timeout),
                         group=self.host.backend(device))


SHM = Plane("shm", ShmWriter, ShmHost, local=True, options=frozenset({"check_columns"}),
            where="the trainer and the server on one host: every rank copies its slices into a shared segment")
NET = Plane("net", NetWriter, NetHost, local=False, options=_NETWORKED,
            where="any host: every rank sends its slices on its own authenticated connection")
GROUP = Plane("group", GroupWriter, GroupHost, local=False, options=_NETWORKED,
              where="any host, a network you trust: every rank's slices by sends in a process group")

PLANES: dict[str, Plane] = {p.name: p for p in (SHM, NET, GROUP)}
NAMES = tuple(PLANES)
# names that were ways in once, and what to take instead
RETIRED = {"tcp": "the TCP push (rank 0 alone over one channel) is gone, CHANGELOG.md: shm on one host, net or "
                  "group across hosts"}


def listed(names: Sequence[str] = NAMES) -> str:
    """``'a', 'b' or 'c'``: names for a message."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def plane(name: Any) -> Plane:
    """The plane named ``name``; ValueError naming the planes otherwise."""
    found = PLANES.get(name) if isinstance(name, str) else None
    if found is None:
        gone = RETIRED.get(name) if isinstance(name, str) else None
        raise ValueError(f"the plane is {listed()}, not {name!r}" + (f": {gone}" if gone else ""))
    return found


def on_this_host(host: str) -> bool:
    """Whether ``host`` (a name or an address) is an address of this machine, in this network namespace:
    one a socket here can bind (a loopback address, or an interface's own)."""
    import socket

    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, kind, _, _, address in found:
        try:
            with socket.socket(family, kind) as probe:
                probe.bind((address[0], 0))
            return True
        except OSError:
            continue
    return False


def fastest(server_host: str, *, every_rank_here: bool, secret: bool) -> tuple[Plane, str]:
    """ServedPush's plane where none is named: the fastest that works, and why (for the push report).
    ``every_rank_here``: the server's host is an address of every trainer rank's machine; ``secret``:
    every rank holds the shared secret (``FAIRCAST_DS_SYNC_SECRET``)."""
    if every_rank_here:
        how = ("the ranks and the engine prove the shared secret" if secret else
               "no shared secret is set, so each end takes only a process of its own user")
        return SHM, (f"the server ({server_host}) runs on this host: shm, the fastest way in (each rank copies "
                     f"its slices into the engine's shared segment; {how})")
    if secret:
        return NET, (f"the server ({server_host}) is not on the host of every rank: net (each rank sends its own "
                     "slices on its own authenticated connection)")
    return NET, (f"the server ({server_host}) is not on the host of every rank: net, which needs the shared secret "
                 "(FAIRCAST_DS_SYNC_SECRET) on both ends")
