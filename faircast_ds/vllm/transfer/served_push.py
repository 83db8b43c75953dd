"""The trainer's one entry point into a ``vllm serve`` process with the ``faircast`` backend:
:class:`ServedPush`, on every rank of the training job.

It picks the route by ``plane`` (the registry, :mod:`faircast_ds.vllm.transfer.planes`) and hands it a
:class:`~faircast_ds.vllm.transfer.server.VllmServer` on rank 0. Where no plane is named it takes the
fastest that works, and says which and why in every push's report (``plane``, ``plane_choice``): ``shm``
when the server runs on the host of every rank, ``net`` otherwise; ``tcp`` to a server on rank 0's host
when no rank holds the shared secret (``FAIRCAST_DS_SYNC_SECRET``) the other planes need.

- ``"tcp"`` (any host; the slowest at size, named explicitly): :class:`~faircast_ds.vllm.transfer.tcp_route.TcpRoute`, rank 0
  sends the served weights over the backend's authenticated channel
  (:mod:`faircast_ds.vllm.transfer.trainer` -> :mod:`faircast_ds.export.sync`), the engine checks its
  kernels against what it received inside ``/finish_weight_update``;
- ``"shm"`` (the trainer and the server on one host): :class:`~faircast_ds.vllm.transfer.plane_route.PlaneRoute`,
  every rank writes its own served slices into the engine's shared staging segment
  (:mod:`faircast_ds.vllm.transfer.segment`), the engine checks its kernels against the segment;
- ``"net"`` (any host): the same route and plane, each rank sending its own slices to the engine's
  ``host:port`` on its own authenticated connection (no gather to rank 0);
- ``"group"`` (any host, a network you trust): the same route and plane, each rank's slices sent by
  point-to-point sends in a process group of the ranks and the engine (gloo on CPUs, NCCL on GPUs;
  :mod:`faircast_ds.export.send_group`), set up over the authenticated connections; the bulk bytes carry
  no MAC.

Either way a push is dense first and after any failure, then deltas; it returns one
:class:`~faircast_ds.export.source.ServedReport` (``stages``: seconds per stage) and raises on every
rank when the engine does not hold the pushed bits (:class:`~faircast_ds.vllm.kernels.EngineWeightsMismatch`)
or did not take the update (:class:`~faircast_ds.export.channel.WeightSyncError`).
"""
from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import urlsplit

from faircast_ds._util.dist import all_reduce_sum, from_rank0, rank_world
from faircast_ds.export.channel import DEFAULT_HOST, WeightSyncError, resolve_secret
from faircast_ds.export.source import ServedReport
from faircast_ds.vllm.transfer import planes
from faircast_ds.vllm.transfer.checksums import SAMPLE_COLUMNS
from faircast_ds.vllm.transfer.server import VllmServer

PLANES = planes.NAMES


class ServedPush:
    """Push Fair Cast's served weights into a ``vllm serve`` process. Construct and :meth:`push` on every
    rank (collectives under ZeRO-3); ``server`` (a :class:`VllmServer` or its URL) on rank 0, None elsewhere.

    ``plane``: ``"tcp"``, ``"shm"``, ``"net"`` or ``"group"``, or None (the default): the fastest that
    works, shm for a server on this host, net otherwise (module docstring; :attr:`plane_choice` says why).
    ``verify``: True (sampled columns of the loaded
    layers, read back through their kernels in the engine's finish), ``"full"`` (every element) or False.
    ``delta``: after an acknowledged push, carry only what changed. ``timeout`` bounds every wait, seconds.
    TCP, net and group: ``port``/``host`` where the engine listens (0: a free port of this host, for a local
    engine). ``check_columns``: columns per matrix of a sampled check (0: every check whole).
    shm, net and group: ``secret`` (default: ``FAIRCAST_DS_SYNC_SECRET``). ``inplace``: the engine writes updates
    straight into the tensors its kernels compute with, where they read them live, instead of vLLM's
    reload (:mod:`faircast_ds.vllm.inplace`); False: every load through vLLM's reload."""

    def __init__(self, model: Any, server: VllmServer | str | None, *, plane: str | None = None,
                 verify: bool | str = True, delta: bool = True, timeout: float = 120.0, port: int = 0,
                 host: str = DEFAULT_HOST, check_columns: int = SAMPLE_COLUMNS, secret: str | bytes | None = None,
                 inplace: bool = True) -> None:
        if plane is not None and (not isinstance(plane, str) or plane not in planes.PLANES):
            raise ValueError(f"plane must be one of {PLANES}, not {plane!r} (None: the fastest that works)")
        _check_verify(verify)
        if type(inplace) is not bool:
            raise ValueError(f"inplace must be True or False, got {inplace!r}")
        rank, world = rank_world()
        if rank == 0 and server is None:
            raise ValueError("ServedPush needs the server (or its URL) on rank 0")
        if rank != 0:
            server = None
        elif not isinstance(server, VllmServer):
            server = VllmServer(url=server)
        # why this plane, where ServedPush chose it (None: the caller named it)
        self.plane_choice: str | None = None
        if plane is None:
            way, self.plane_choice = _fastest(server, world, secret)
            plane = way.name
        way = planes.PLANES[plane]
        given = {k for k, v, default in (("port", port, 0), ("host", host, DEFAULT_HOST),
                                         ("check_columns", check_columns, SAMPLE_COLUMNS)) if v != default}
        foreign = sorted(given - way.options)
        if foreign:
            chose = f" (ServedPush chose it: {self.plane_choice}; name the plane)" if self.plane_choice else ""
            raise ValueError(f"{', '.join(foreign)}: not an option of plane {plane!r}{chose}")
        if not way.takes_secret and secret is not None:
            takers = [n for n, p in planes.PLANES.items() if p.takes_secret]
            raise ValueError(f"secret: an option of planes {', '.join(map(repr, takers[:-1]))} and {takers[-1]!r} "
                             "(the channel reads FAIRCAST_DS_SYNC_SECRET)")
        self.model, self.plane = model, plane
        if way.segment:
            from faircast_ds.vllm.transfer.plane_route import PlaneRoute

            self.route: Any = PlaneRoute(model, server, plane=plane, host=host, port=port, timeout=timeout,
                                         verify=verify, delta=delta, secret=secret, inplace=inplace,
                                         check_columns=check_columns)
        else:
            from faircast_ds.vllm.transfer.tcp_route import TcpRoute

            self.route = TcpRoute(model, server, port=port, host=host, timeout=timeout, delta=delta, verify=verify,
                                  check_columns=check_columns, inplace=inplace)

    @property
    def server(self) -> VllmServer | None:
        return self.route.server

    @property
    def last_check(self) -> str | None:
        """How the last push was verified: ``"whole"``, ``"sampled"`` or None (not checked)."""
        return self.route.last_check

    def push(self, version: int | None = None, *, verify: bool | str | None = None, kind: str = "auto") -> ServedReport:
        """One update at ``version`` (default: the DeepSpeed engine's ``global_steps``), every rank.
        ``kind``: ``auto`` (a delta once a push was acknowledged and ``delta`` is on), ``dense`` or ``delta``;
        ``verify`` overrides the constructor's for this push."""
        if verify is not None:
            _check_verify(verify)
        if kind not in ("auto", "dense", "delta"):
            raise ValueError(f"kind must be 'auto', 'dense' or 'delta', not {kind!r}")
        if version is None:
            version = getattr(self.model, "global_steps", None)
            if version is None:
                raise ValueError("push(version=...) is required for a model that is not a DeepSpeed engine")
        report = self.route.push(int(version), verify=verify, kind=kind)
        return dataclasses.replace(report, plane=self.plane, plane_choice=self.plane_choice)

    def close(self) -> None:
        self.route.close()


def _fastest(server: VllmServer | None, world: int, secret: str | bytes | None) -> tuple[planes.Plane, str]:
    """The fastest plane that works for this job (the same on every rank; collectives with several ranks):
    shm where the server runs on the host of every rank, net otherwise; tcp to a server on rank 0's host
    where no rank holds the shared secret the other planes need."""
    mine = None
    if server is not None:  # rank 0
        mine = (urlsplit(server.url).hostname or "", planes.on_this_host(urlsplit(server.url).hostname or ""))
    host, rank0_here = from_rank0(mine)
    here = rank0_here if server is not None else planes.on_this_host(host)
    try:
        keyed = resolve_secret(secret) is not None
    except WeightSyncError:
        keyed = True  # a secret that is there but refused: the plane names why when it reads it
    if world > 1:
        away, unkeyed = all_reduce_sum([float(not here), float(not keyed)])
        every_rank_here, keyed = away == 0, unkeyed == 0
    else:
        every_rank_here = here
    return planes.fastest(host, rank0_here=rank0_here, every_rank_here=every_rank_here, secret=keyed)


def _check_verify(verify: Any) -> None:
    if not (verify is True or verify is False or verify == "full"):
        raise ValueError(f"verify must be True, False or 'full', got {verify!r}")
