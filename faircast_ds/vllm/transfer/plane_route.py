"""The data-plane routes of :class:`~faircast_ds.vllm.transfer.served_push.ServedPush`: every trainer rank
puts its own served slices into the engine's staging segment (no gather to rank 0); rank 0 commits and
drives vLLM's update. Three transports of the same segment (:mod:`faircast_ds.vllm.transfer.segment`), each
a pair of ends the registry builds by name (:mod:`faircast_ds.vllm.transfer.planes`):

- ``plane="shm"`` (issue 32 item 2; the trainer and a ``vllm serve`` on one host): the segment is a
  memfd the ranks map and copy into; no MAC over the bulk bytes (the descriptor is the capability);
- ``plane="net"`` (item 3; any host): each rank sends its slices on its own authenticated TCP connection
  to the engine's ``host:port``, in chunks the engine reads straight into the segment;
- ``plane="group"`` (item 7; any host, a network you trust): the same connections for the control
  messages, the slices by sends in a process group of the ranks and the engine (gloo, or NCCL on GPUs),
  received straight into the segment. After a failed push every rank leaves the group, and the next
  push forms a new one.

Built on every rank (two collectives per push: the changed-count all-reduce of a delta, and the
outcome); the server (a :class:`~faircast_ds.vllm.transfer.server.VllmServer`, or its URL) on rank 0.
Both processes hold the same ``FAIRCAST_DS_SYNC_SECRET``. One push::

    every rank   diff its slices against its last acknowledged bits (delta)    -> all-reduce of counts
    every rank   begin -> (shm) the segment's descriptor, write its slices / (net) send its slices
                 -> written (bytes, digest)
    rank 0       commit (the engine checks every rank's report) -> HTTP start, update, finish
                 (finish loads the carried layers from the segment, then checks their kernels
                 against it: sampled columns, or every element with verify="full") -> reset_prefix_cache
    every rank   the outcome from rank 0; acknowledged -> the next push is a delta

A push that changes nothing costs one HTTP round trip (``/update_weight_version``) and one local
message. Any failure raises on every rank, leaves the engine serving what it served (the model
changes only at finish), and makes the next push dense (a rank whose connection ended joins again).
"""
from __future__ import annotations

import secrets
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from faircast_ds._util.dist import collective_device, first_failure, from_rank0, rank_world
from faircast_ds.export.channel import DEFAULT_HOST, WeightSyncError
from faircast_ds.export.plane import PlaneError
from faircast_ds.export.source import ServedReport, reader_of
from faircast_ds.export.stages import Stages
from faircast_ds.export.tracking import tracker_for
from faircast_ds.vllm.kernels import EngineWeightsMismatch
from faircast_ds.vllm.transfer import planes
from faircast_ds.vllm.transfer.checksums import SAMPLE_COLUMNS


_STAGE = {"start_weight_update": "http.start", "update_weights": "http.update", "finish_weight_update": "http.finish",
          "reset_prefix_cache": "http.reset_prefix_cache"}


class PlaneRoute:
    """The trainer's end of the data plane, ``plane`` the name of one of the segment's planes
    (:mod:`~faircast_ds.vllm.transfer.planes`; ``host``/``port``: where the engine listens, on the planes
    that listen on an address; see the module docstring); ``server`` a
    :class:`~faircast_ds.vllm.transfer.server.VllmServer` on rank 0, None elsewhere. ``verify``: True (the
    loaded layers' kernels against the segment on sampled columns), ``"full"`` (every element) or
    False. ``delta``: after an acknowledged push, carry only the parameters whose bits changed, read
    from the cast's change marks where the model's reader offers them (1 bit per shard element,
    ``tracking == "marks"``), else from a copy of the acknowledged bits (2 bytes per element,
    ``"baseline"``; :mod:`faircast_ds.export.tracking`)."""

    def __init__(self, model: Any, server: Any, *, plane: str = "shm", host: str = DEFAULT_HOST, port: int = 0,
                 timeout: float = 120.0, verify: bool | str = True, delta: bool = True,
                 secret: str | bytes | None = None, inplace: bool = True, check_columns: int = SAMPLE_COLUMNS) -> None:
        way = planes.plane(plane, segment=True)
        if type(check_columns) is not int or check_columns < 0:
            raise ValueError(f"check_columns must be a non-negative integer, got {check_columns!r}")
        self.check_columns = check_columns
        self.plane = plane
        self.model, self.verify, self.delta, self.timeout = model, verify, delta, float(timeout)
        self.rank, self.world = rank_world()
        self.server = server
        reader = reader_of(model)  # the reader the model's integration provided (ZeRO-3: its adapter's shard)
        self.specs = list(reader.specs)
        index = {s.name: i for i, s in enumerate(self.specs)}
        self.numel = sum(s.numel for s in self.specs)
        try:
            local = reader.local_slices()
        except ValueError as exc:
            raise ValueError(f"the {plane} plane puts each rank's own served slices: {exc}") from None
        self.slices = [(index[s.name], s.start, s.values) for s in local]
        # rank 0 names the session and the place: a local socket, or the engine's port (0: a free port of
        # this host, for an engine on this host)
        session, name, port = from_rank0((secrets.token_hex(16), *way.place(host, port)) if self.rank == 0 else None)
        error = None
        if self.rank == 0:
            try:
                self.server.init_weight_transfer_engine({
                    "plane": plane, "socket": name or "", "host": host, "port": port, "timeout": self.timeout,
                    "inplace": bool(inplace),
                    "params": [[s.name, list(s.shape), str(s.dtype)] for s in self.specs]})
            except Exception as exc:  # noqa: BLE001 - reported on every rank
                error = f"{type(exc).__name__}: {exc}"
        error = from_rank0(error)
        if error is not None:
            raise WeightSyncError(f"the vLLM engine did not open the faircast {plane} plane: {error}")
        self.writer = way.open_writer(name, host, port, self.specs, self.slices, rank=self.rank, world=self.world,
                                      session=session, timeout=self.timeout, secret=secret)
        error = first_failure(self.writer.connect, WeightSyncError)
        if error is not None:
            self.writer.close()
            raise WeightSyncError(f"joining the engine's {plane} plane failed: {error}")
        self.acknowledged: int | None = None  # the version the engine serves from this trainer
        self.tracker = tracker_for(reader, [v for _, _, v in self.slices]) if delta else None
        self.pause: Callable[[int], None] | None = None  # tests: called after each slice written
        # net plane deltas: each slice's changed elements only, where smaller (False: whole changed slices,
        # for side-by-side measurements). The shm plane always copies whole slices (a memcpy into the mapping)
        self.sparse = True
        self.pushes = 0
        self.committed_bytes = 0
        self.last_check: str | None = None  # "whole" or "sampled": how the last push was verified

    # -- one push -------------------------------------------------------------------------------------
    def push(self, version: int | None = None, *, kind: str = "auto", verify: bool | str | None = None) -> ServedReport:
        began = time.perf_counter()
        stages, collectives, http = Stages(), 0, 0
        verify = self.verify if verify is None else verify
        use_delta = kind != "dense" and self.delta and self.acknowledged is not None
        if kind == "delta" and not use_delta:
            raise ValueError("a delta push needs delta=True and a previous acknowledged push")
        params = set(range(len(self.specs)))
        changed = self.numel
        per_slice: list[int] | None = None
        if use_delta:
            with stages("trainer.diff"):
                counts = torch.zeros(len(self.specs), dtype=torch.int64)
                per_slice = self.tracker.counts([v for _, _, v in self.slices])
                for (i, _, _), n in zip(self.slices, per_slice):
                    counts[i] += n
            if self.world > 1:
                collectives += 1
                with stages("trainer.collectives"):
                    reduced = counts.to(collective_device())
                    dist.all_reduce(reduced)
                    counts = reduced.cpu()
            params = {i for i, c in enumerate(counts.tolist()) if c}
            changed = int(counts.sum())
        error, written = None, 0
        if use_delta and not params:
            if self.rank == 0:
                try:
                    with stages(f"{self.plane}.same"):
                        self.writer.same(int(version), self.acknowledged)
                    with stages("http.update_weight_version"):
                        self.server.update_weight_version(str(version))
                    http += 1
                except Exception as exc:  # noqa: BLE001
                    error = f"{type(exc).__name__}: {exc}"
        else:
            try:
                if not self.writer.connected:  # the engine ended this rank's connection (a refused write)
                    self.writer.close()
                    self.writer.connect()
                sparse = {} if per_slice is None or not self.sparse else {
                    "changes": per_slice, "indices": lambda k: self.tracker.indices(k, self.slices[k][2])}
                written = self.writer.write(int(version), "delta" if use_delta else "dense",
                                            self.acknowledged if use_delta else None, params, stages, self.pause,
                                            **sparse)
            except (WeightSyncError, PlaneError) as exc:
                error = f"rank {self.rank}: {exc}"
            except Exception as exc:  # noqa: BLE001 - every rank must reach the outcome's collective
                error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
            if self.rank == 0:
                error = error or self._commit_and_load(int(version), params if use_delta else None, verify, stages)
                http += stages.http_calls()
        if self.world > 1:
            collectives += 1
            with stages("trainer.collectives"):
                try:
                    error = from_rank0(error)
                except Exception as exc:  # noqa: BLE001 - a rank died: say what this rank knows
                    self.acknowledged = None
                    raise WeightSyncError(f"weight update {version}: the training job's ranks could not agree on "
                                          f"its outcome ({type(exc).__name__}: {exc}); this rank's account: "
                                          f"{error or 'its write was accepted'}") from None
        if error is not None:
            self.acknowledged = None  # the engine's segment may be dirty: the next push is dense
            self.writer.failed()  # the group plane: every rank leaves the send group; the next push forms a new one
            if "kernels compute with other bits" in error:
                raise EngineWeightsMismatch(f"weight update {version}: {error}", [])
            raise WeightSyncError(f"weight update {version} not applied by the vLLM engine: {error}")
        if self.delta and params:
            with stages("trainer.acknowledge"):
                self._remember(params, dense=not use_delta)
        self.acknowledged = int(version)
        self.pushes += 1
        self.last_check = (("whole" if verify == "full" or not self.check_columns else "sampled")
                           if verify and params else None)
        if self.rank == 0 and params:
            written = self.committed_bytes  # every rank's bytes sent, as the engine counted them
        carried = sum(self.specs[i].numel for i in params) if params else 0
        seconds = time.perf_counter() - began
        # the stages here run one after the other: what they leave of the push is bookkeeping
        stages.add("trainer.other", max(0.0, seconds - sum(v for k, v in stages.seconds.items()
                                                            if not k.startswith("engine."))))
        return ServedReport(version=int(version), kind="delta" if use_delta else "dense", params=len(params),
                            changed=changed, numel=self.numel, bytes=written, seconds=seconds,
                            elements=carried, params_total=len(self.specs), gathers=0,
                            verified=(True if verify and params else None), stages=stages.as_dict(),
                            http_calls=http, collectives=collectives, tracking=self.tracking,
                            tracking_bytes=self.tracker.nbytes if self.tracker is not None else 0)

    def _commit_and_load(self, version: int, params: set[int] | None, verify: bool | str,
                         stages: Stages) -> str | None:
        """Rank 0: commit the ranks' write, then vLLM's start / update / finish (load + check) and the
        prefix-cache reset. The error as text, or None."""
        server = self.server
        try:
            reply = self.writer.commit(version, params, stages)
            self.committed_bytes = int(reply.get("sent", reply.get("bytes", 0)))
        except (WeightSyncError, PlaneError) as exc:
            return str(exc)
        check = None if not verify else ("full" if verify == "full" or not self.check_columns else "sampled")
        info = {"version": version, "check": check, "check_columns": self.check_columns or SAMPLE_COLUMNS}
        calls = [("start_weight_update", server.start_weight_update, ()),
                 ("update_weights", server.update_weights, (info,)),
                 ("finish_weight_update", server.finish_weight_update, (str(version),)),
                 ("reset_prefix_cache", server.reset_prefix_cache, ())]
        for route, call, args in calls:
            try:
                with stages(_STAGE[route]):
                    call(*args)
            except Exception as exc:  # noqa: BLE001
                error: Exception = exc
                if route == "start_weight_update":  # a session a dead trainer left open: end it, start ours
                    try:
                        server.abandon_weight_update()
                        server.start_weight_update()
                        continue
                    except Exception as again:  # noqa: BLE001
                        error = again
                return f"{route} failed: {error}"
        return None

    def _remember(self, params: set[int], dense: bool) -> None:
        """The engine serves these bits now: what the next delta is measured from (the marks cleared,
        or the baseline copied: all of it after a dense push, the carried parameters' after a delta)."""
        positions = None if dense else {k for k, (i, _, _) in enumerate(self.slices) if i in params}
        self.tracker.acknowledge([v for _, _, v in self.slices], positions)

    @property
    def tracking(self) -> str | None:
        """How a delta finds what changed: ``"marks"``, ``"baseline"``, or None (``delta=False``)."""
        return self.tracker.kind if self.tracker is not None else None

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
        self.writer.close()
        if self.server is not None:
            try:
                self.server.shutdown_weight_transfer_engine()
            except Exception:  # noqa: BLE001 - best effort: the engine may be gone
                pass
