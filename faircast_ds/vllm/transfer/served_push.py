"""The trainer's one way into a ``vllm serve`` process with the ``faircast`` backend: :class:`ServedPush`,
on every rank of the training job. Every rank puts its own served slices into the engine's staging
segment (no gather to rank 0); rank 0 commits and drives vLLM's update.

The plane is how the bytes cross (the registry, :mod:`faircast_ds.vllm.transfer.planes`; both ends in
:mod:`faircast_ds.vllm.transfer.segment`). Where none is named, ServedPush takes the fastest that works
and says which and why in every push's report (``plane``, ``plane_choice``):

- ``"shm"`` (the trainer and the server on one host; the default there): the segment is a memfd the
  ranks map and copy into; no MAC over the bulk bytes (the descriptor is the capability). With
  ``FAIRCAST_DS_SYNC_SECRET`` both ends prove it; without, each end takes only a process of its own user;
- ``"net"`` (any host; the default for a server elsewhere, and the secret is needed): each rank sends
  its slices on its own authenticated TCP connection to the engine's ``host:port``, in chunks the engine
  reads straight into the segment;
- ``"group"`` (any host, a network you trust): the same connections for the control messages, the
  slices by sends in a process group of the ranks and the engine (gloo, or NCCL on GPUs;
  :mod:`faircast_ds.export.send_group`). After a failed push every rank leaves the group, and the next
  push forms a new one.

One push (two collectives: the changed-count all-reduce of a delta, and the outcome)::

    every rank   diff its slices against its last acknowledged bits (delta)    -> all-reduce of counts
    every rank   begin -> (shm) the segment's descriptor, write its slices / (net) send its slices
                 -> written (bytes, digest)
    rank 0       commit (the engine checks every rank's report) -> HTTP start, update, finish
                 (finish loads the carried layers from the segment, then checks their kernels
                 against it: sampled columns, or every element with verify="full") -> reset_prefix_cache
    every rank   the outcome from rank 0; acknowledged -> the next push is a delta

A push that changes nothing costs one HTTP round trip (``/update_weight_version``) and one local
message. Any failure raises on every rank (:class:`~faircast_ds.vllm.engine_weights.EngineWeightsMismatch`
when the engine's kernels do not hold the pushed bits, :class:`~faircast_ds.export.channel.WeightSyncError`
otherwise), leaves the engine serving what it served (the model changes only at finish), and makes the
next push dense (a rank whose connection ended joins again).
"""
from __future__ import annotations

import secrets
import time
from typing import Any, Callable
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from faircast_ds._util.dist import all_reduce_sum, collective_device, first_failure, from_rank0, rank_world
from faircast_ds.export import delta
from faircast_ds.export.channel import DEFAULT_HOST, WeightSyncError, resolve_secret
from faircast_ds.export.plane import PlaneError
from faircast_ds.export.source import ServedReport, Stages, reader_of, tracker_for
from faircast_ds.vllm.engine_weights import EngineWeightsMismatch
from faircast_ds.vllm.transfer import planes
from faircast_ds.vllm.transfer.checksums import SAMPLE_COLUMNS
from faircast_ds.vllm.transfer.server import VllmServer

_STAGE = {"start_weight_update": "http.start", "update_weights": "http.update", "finish_weight_update": "http.finish",
          "reset_prefix_cache": "http.reset_prefix_cache"}


class ServedPush:
    """Push Fair Cast's served weights into a ``vllm serve`` process. Construct and :meth:`push` on every
    rank (collectives under ZeRO-3); ``server`` (a :class:`VllmServer` or its URL; or anything with its
    weight-transfer methods, e.g. :class:`~faircast_ds.vllm.transfer.trainer.ClientServer` over a client of
    vLLM's) on rank 0, None elsewhere.

    ``plane``: ``"shm"``, ``"net"`` or ``"group"``, or None (the default): the fastest that works, shm for
    a server on this host, net otherwise (module docstring; :attr:`plane_choice` says why).
    ``verify``: True (sampled columns of the loaded layers, read back through their kernels in the
    engine's finish), ``"full"`` (every element) or False. ``delta``: after an acknowledged push, carry
    only the parameters whose bits changed, read from the cast's change marks where the model's reader
    offers them (1 bit per shard element, ``tracking == "marks"``), else from a copy of the acknowledged
    bits (2 bytes per element, ``"baseline"``; :func:`faircast_ds.export.source.tracker_for`). ``timeout`` bounds
    every wait, seconds. net and group: ``port``/``host`` where the engine listens (0: a free port of this
    host, for a local engine). ``check_columns``: columns per matrix of a sampled check (0: every check
    whole). ``secret`` (default: ``FAIRCAST_DS_SYNC_SECRET``; on the shm plane none may be set on either
end, and each end then takes only a process of its own user). ``inplace``: the engine writes updates
    straight into the tensors its kernels compute with, where they read them live, instead of vLLM's
    reload (:mod:`faircast_ds.vllm.inplace`); False: every load through vLLM's reload."""

    def __init__(self, model: Any, server: VllmServer | str | None, *, plane: str | None = None,
                 verify: bool | str = True, delta: bool = True, timeout: float = 120.0, port: int = 0,
                 host: str = DEFAULT_HOST, check_columns: int = SAMPLE_COLUMNS, secret: str | bytes | None = None,
                 inplace: bool = True) -> None:
        if plane is not None:
            try:
                planes.plane(plane)
            except ValueError as exc:
                raise ValueError(f"ServedPush: {exc} (None: the fastest that works)") from None
        _check_verify(verify)
        if type(inplace) is not bool:
            raise ValueError(f"inplace must be True or False, got {inplace!r}")
        if type(check_columns) is not int or check_columns < 0:
            raise ValueError(f"check_columns must be a non-negative integer, got {check_columns!r}")
        self.rank, self.world = rank_world()
        self.device = collective_device() if self.world > 1 else None  # where the push's collectives' tensors live
        if self.rank == 0 and server is None:
            raise ValueError("ServedPush needs the server (or its URL) on rank 0")
        if self.rank != 0:
            server = None
        elif isinstance(server, str):
            server = VllmServer(url=server)
        self.server = server
        # why this plane, where ServedPush chose it (None: the caller named it)
        self.plane_choice: str | None = None
        if plane is None:
            way, self.plane_choice = _fastest(server, self.world, secret)
            plane = way.name
        way = planes.PLANES[plane]
        given = {k for k, v, default in (("port", port, 0), ("host", host, DEFAULT_HOST),
                                         ("check_columns", check_columns, SAMPLE_COLUMNS)) if v != default}
        foreign = sorted(given - way.options)
        if foreign:
            chose = f" (ServedPush chose it: {self.plane_choice}; name the plane)" if self.plane_choice else ""
            raise ValueError(f"{', '.join(foreign)}: not an option of plane {plane!r}{chose}")
        self.model, self.plane, self.check_columns = model, plane, check_columns
        self.verify, self.delta, self.timeout = verify, delta, float(timeout)
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
                    reduced = counts.to(self.device)
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
                changes = None
                if per_slice is not None and self.sparse and self.writer.sparse:
                    with stages("trainer.encode"):
                        changes = self._change_lists(per_slice, params)
                written = self.writer.write(int(version), "delta" if use_delta else "dense",
                                            self.acknowledged if use_delta else None, params, stages.seconds,
                                            self.pause, changes=changes)
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
                    box = [error]  # rank 0's account of the push, on every rank
                    dist.broadcast_object_list(box, src=0)
                    error = box[0]
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
                            tracking_bytes=self.tracker.nbytes if self.tracker is not None else 0,
                            plane=self.plane, plane_choice=self.plane_choice)

    def _commit_and_load(self, version: int, params: set[int] | None, verify: bool | str,
                         stages: Stages) -> str | None:
        """Rank 0: commit the ranks' write, then vLLM's start / update / finish (load + check) and the
        prefix-cache reset. The error as text, or None."""
        server = self.server
        try:
            reply = self.writer.commit(version, params, stages.seconds)
            self.committed_bytes = int(reply.get("sent", reply.get("bytes", 0)))
        except (WeightSyncError, PlaneError) as exc:
            return str(exc)
        check = None if not verify else ("full" if verify == "full" or not self.check_columns else "sampled")
        info = {"version": version, "check": check, "check_columns": self.check_columns or SAMPLE_COLUMNS}
        calls = [("start_weight_update", server.start_weight_update, ()),
                 ("update_weights", server.update_weights, (info,)),
                 ("finish_weight_update", server.finish_weight_update, (str(version),)),
                 ("reset_prefix_cache", server.reset_prefix_cache, ())]
        for endpoint, call, args in calls:
            try:
                with stages(_STAGE[endpoint]):
                    call(*args)
            except Exception as exc:  # noqa: BLE001
                error: Exception = exc
                if endpoint == "start_weight_update":  # a session a dead trainer left open: end it, start ours
                    try:
                        server.abandon_weight_update()
                        server.start_weight_update()
                        continue
                    except Exception as again:  # noqa: BLE001
                        error = again
                return f"{endpoint} failed: {error}"
        return None

    def _change_lists(self, per_slice: list[int], params: set[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """A delta's change lists, per slice of the carried ``params`` where a list is the smallest encoding
        (under ~3% of the slice changed: listing more costs more than sending the slice on a fast link,
        docs/vllm.md): the changed elements' indices into the slice and their new bits."""
        lists = {}
        for k, ((i, _, values), count) in enumerate(zip(self.slices, per_slice)):
            if i in params and delta.best(values.numel(), count, values.element_size()) == delta.COO:
                where = self.tracker.indices(k, values) if count else torch.zeros(0, dtype=torch.int64)
                if where.numel() != count:
                    raise PlaneError(f"slice {k}: {where.numel()} changed indices for a count of {count}")
                lists[k] = (where.to(delta.index_dtype(values.numel())), delta.bits_view(values)[where])
        return lists

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


def _fastest(server: Any, world: int, secret: str | bytes | None) -> tuple[planes.Plane, str]:
    """The fastest plane that works for this job (the same on every rank; collectives with several ranks):
    shm where the server runs on the host of every rank, net otherwise."""
    mine = None
    if server is not None:  # rank 0
        mine = getattr(server, "engine_host", None) or urlsplit(server.url).hostname or ""
    host = from_rank0(mine)
    here = planes.on_this_host(host)
    try:
        keyed = resolve_secret(secret) is not None
    except WeightSyncError:
        keyed = True  # a secret that is there but refused: the plane names why when it reads it
    if world > 1:
        away, unkeyed = all_reduce_sum([float(not here), float(not keyed)])
        here, keyed = away == 0, unkeyed == 0
    return planes.fastest(host, every_rank_here=here, secret=keyed)


def _check_verify(verify: Any) -> None:
    if not (verify is True or verify is False or verify == "full"):
        raise ValueError(f"verify must be True, False or 'full', got {verify!r}")
