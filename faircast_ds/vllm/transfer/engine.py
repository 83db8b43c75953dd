"""The engine side of the ``faircast`` weight-transfer backend: vLLM's ``WeightTransferEngine`` over the
staging segment the trainer ranks write (:mod:`faircast_ds.vllm.transfer.segment`).

vLLM calls it from its worker, through its own RPCs and HTTP endpoints (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``):

- ``init_transfer_engine({"plane", "params", "socket" | "host" + "port", "timeout", "inplace"})`` opens the
  plane's host end (:mod:`faircast_ds.vllm.transfer.planes`) for the trainer's parameter list: the staging
  copy of the weights (HF names) is the segment itself. The secret is this process's
  ``FAIRCAST_DS_SYNC_SECRET`` (or ``..._FILE``): it never travels over HTTP.
- ``update_weights({"version": v, "check": "sampled" | "full" | null, "check_columns": k})`` takes rank
  0's commit of version ``v`` (the ranks have already written the segment, and the ledger checked every
  rank's report). The model is not touched.
- ``finish_weight_update()`` loads every staged tensor the commit carried into the model in one call
  (``reload_weights(..., is_checkpoint_format=True)``, whole fused groups: vLLM rebuilds ``qkv_proj`` from
  q, k and v; or in place, where the kernels read the engine's tensor live), between two engine steps;
  then, when the update asked, reads the loaded layers' kernels back against the staging copy (``k``
  sampled input columns per matrix — on the net plane with the columns, and embedding rows, the ranks'
  change lists touched, up to ``k`` more — or every element for ``"full"``) and fails the call on a
  difference. vLLM then sets its weight version: a verified push needs no other call.

So a trainer killed, or a write cut, before ``finish`` leaves the model and vLLM's weight version as
they were. ``update_weights({"abandon": true})`` lets a restarted trainer end an update session a dead
one left open (vLLM refuses a new ``start`` while one is active).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from faircast_ds.export import delta
from faircast_ds.export.channel import DEFAULT_HOST
from faircast_ds.vllm import engine_weights, fused, inplace
from faircast_ds.vllm.engine_weights import quiet_reload
from faircast_ds.vllm.transfer import planes
from faircast_ds.vllm.transfer.checksums import SAMPLE_COLUMNS

logger = logging.getLogger("faircast_ds.vllm")
_DTYPES = {str(d): d for d in (torch.bfloat16, torch.float16, torch.float32)}


@dataclass
class FairCastInitInfo(WeightTransferInitInfo):
    """What the trainer tells the engine at ``/init_weight_transfer_engine``."""

    params: list  # [[HF name, shape, dtype], ...] in the trainer's served order
    plane: str = ""  # "shm", "net" or "group" (planes.py): how the ranks' bytes reach the segment
    host: str = DEFAULT_HOST  # net and group: where the engine's end listens
    port: int = 0
    timeout: float = 120.0  # the commit's wait for the ranks' reports, seconds
    socket: str = ""  # the shm plane's abstract AF_UNIX socket name (the trainer picks it)
    # write updates straight into the tensors the kernels compute with, where they read them live
    # (faircast_ds.vllm.inplace); False: every load through vLLM's reload_weights
    inplace: bool = True


@dataclass
class FairCastUpdateInfo(WeightTransferUpdateInfo):
    """One ``/update_weights`` call: take the committed write of ``version`` (or ``abandon`` the session)."""

    version: int | None = None
    abandon: bool = False
    check: str | None = None  # "sampled" or "full": finish checks the loaded layers' kernels against the staging copy
    check_columns: int = SAMPLE_COLUMNS  # input columns per matrix of a sampled check


class FairCastWeightTransferEngine(WeightTransferEngine[FairCastInitInfo, FairCastUpdateInfo]):
    """vLLM's worker-side engine for ``--weight-transfer-config '{"backend": "faircast"}'``."""

    init_info_cls = FairCastInitInfo
    update_info_cls = FairCastUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.plane: Any = None  # the plane's host end (planes.py)
        self._commit: Any = None  # the committed write this session loads at finish
        self._check_mode: str | None = None  # what this session's update asked finish to check
        self._check_columns = SAMPLE_COLUMNS
        self.staging: dict[str, torch.Tensor] = {}
        self.groups: dict[str, tuple[str, ...]] = {}
        # per HF name, the (rows, columns) holding an element the deltas staged since the last load changed,
        # which a sampled check also reads; None once a dense update (or a delta without change lists) was
        # staged: then the check reads its sample alone
        self._touched: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = {}
        self._abandoned = False
        self._inplace = True
        # per HF name: whether the kernels compute with the engine's tensor live (probed after each vLLM
        # reload of it), and that tensor's part, which later loads write in place
        self._live: dict[str, bool] = {}
        self._targets: dict[str, torch.Tensor] = {}
        # per HF name, the element indices the deltas staged since the last load changed, where the ranks
        # listed them (None for a name written whole); None once a dense update was staged
        self._changes: dict[str, list[torch.Tensor] | None] | None = {}
        self.last: dict[str, Any] = {}

    # -- lifecycle -------------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: FairCastInitInfo) -> None:
        params = init_info.params
        if not isinstance(params, list) or not params:
            raise ValueError("faircast init_info needs 'params': the trainer's [[name, shape, dtype], ...]")
        for name, shape, dtype in params:
            if dtype not in _DTYPES:
                raise ValueError(f"faircast: {name} has dtype {dtype!r}; supported: {sorted(_DTYPES)}")
        try:
            way = planes.plane(init_info.plane)
        except ValueError as exc:
            raise ValueError(f"faircast init_info 'plane': {exc}") from None
        if type(init_info.inplace) is not bool:
            raise ValueError(f"faircast init_info 'inplace' is true or false, not {init_info.inplace!r}")
        self.shutdown()
        self._commit = None  # a commit of the plane this init replaces is never loaded
        from faircast_ds.export.served import ParamSpec

        specs = [ParamSpec(str(n), tuple(int(d) for d in shape), _DTYPES[dtype]) for n, shape, dtype in params]
        self.plane = way.open_host(specs, init_info, self.device)
        self.staging = staging = self.plane.views()  # the staging copy is the segment itself
        packed = {k: list(v) for k, v in (getattr(self.model, "packed_modules_mapping", None) or {}).items()}
        self.groups = fused.packed_groups(list(staging), packed)
        self._touched = {}
        self._inplace, self._live, self._targets, self._changes = init_info.inplace, {}, {}, {}
        logger.info("faircast weight transfer: %s plane %s (%d parameters, %d bytes)", init_info.plane,
                    self.plane.where(), len(staging), self.plane.layout.nbytes)

    def start_weight_update(self) -> None:
        self._require()
        self._abandoned, self._commit, self._check_mode = False, None, None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class would synchronize an accelerator: this engine loads nothing before finish
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: FairCastUpdateInfo) -> None:
        self._require()
        if update_info.abandon:
            self._abandoned, self._commit = True, None
            return
        if type(update_info.version) is not int:
            raise ValueError(f"faircast update_info needs an integer 'version', got {update_info.version!r}")
        if update_info.check not in (None, "sampled", "full"):
            raise ValueError(f"faircast update_info 'check' is 'sampled', 'full' or null, not {update_info.check!r}")
        columns = update_info.check_columns
        if type(columns) is not int or columns < 1:
            raise ValueError(f"faircast update_info 'check_columns' must be a positive integer, got {columns!r}")
        self._check_mode, self._check_columns = update_info.check, columns
        # the ranks wrote and rank 0 committed before this call
        self._commit = self.plane.ledger.take(update_info.version)
        self._stage_listed(self._commit.kind, self._commit.listed, update_info.check == "sampled")
        self.last = {"version": self._commit.version, "kind": self._commit.kind, "params": len(self._commit.params),
                     "bytes": self._commit.bytes, "receive_seconds": 0.0}

    def finish_weight_update(self) -> None:
        """Load this session's update into the model (the groups with a changed member), then, when the
        update asked, check the loaded layers' kernels against the staging copy."""
        self._require()
        if self._abandoned:
            self._abandoned = False
            return  # an abandoned session: nothing loaded, vLLM's version unchanged (the trainer sends none)
        if self._commit is None:
            raise RuntimeError("faircast: no complete update was received in this session; the engine keeps "
                               "serving its previous weights")
        names = list(self.staging)
        commit, self._commit = self._commit, None  # the committed write names the parameters it carried
        version, changed = commit.version, {names[i] for i in commit.params}
        load = [n for n in names if any(m in changed for m in self.groups.get(n, (n,)))]
        began = time.perf_counter()
        self._load(load, changed)
        touched, self._touched, self._changes = self._touched, {}, {}
        loaded = time.perf_counter()
        self.last.update(loaded=len(load), load_seconds=loaded - began)
        if self._check_mode is not None and load:
            self._check(load, version, touched)
            self.last.update(check_seconds=time.perf_counter() - loaded, checked=len(load))

    def _stage_touched(self, kind: str, touched: dict[str, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Add a received update's changed rows and columns to those staged since the last load."""
        if kind != "delta" or touched is None or self._touched is None:
            self._touched = None
            return
        for name, (rows, cols) in touched.items():
            had = self._touched.get(name)
            self._touched[name] = (rows, cols) if had is None else (
                torch.unique(torch.cat([had[0], rows])), torch.unique(torch.cat([had[1], cols])))

    def _stage_listed(self, kind: str, listed: dict[int, torch.Tensor | None] | None, sampled: bool) -> None:
        """A committed plane write's listed elements (the net plane's change lists; None on the shm plane,
        which names changed parameters only): staged for the in-place write and, for a sampled check, as
        the rows and columns the write touched."""
        names = list(self.staging)
        changes = None if listed is None else {names[i]: index for i, index in listed.items()}
        self._stage_changes(kind, changes)
        touched = None
        if sampled and changes is not None:
            touched = {}
            for name, index in changes.items():
                lines = None if index is None else delta.touched_lines(self.staging[name].shape, delta.COO, index)
                if lines is not None:
                    touched[name] = lines
        self._stage_touched(kind, touched)

    def _stage_changes(self, kind: str, changes: dict[str, torch.Tensor | None] | None) -> None:
        """Add a received delta's listed element indices to those staged since the last load."""
        if kind != "delta" or changes is None or self._changes is None:
            self._changes = None
            return
        for name, index in changes.items():
            had = self._changes.get(name, [])
            self._changes[name] = None if index is None or had is None else had + [index]

    def _writable(self, name: str, changed: set[str]) -> bool:
        """Whether this load can write HF tensor ``name`` in place: every member of its fused group is read
        live by its kernel, and every changed member's changes were listed."""
        group = self.groups.get(name, (name,))
        if not all(self._live.get(m) for m in group):
            return False
        return all(m not in changed or (self._changes is not None and self._changes.get(m) is not None)
                   for m in group)

    def _load(self, names: list[str], changed: set[str]) -> None:
        """Load these staging tensors (HF names, whole fused groups; ``changed``: those the update wrote) into
        the model, all or nothing: where the kernels compute with the engine's tensor live and the deltas
        listed the elements they changed, those elements are written in place (their old bits kept,
        :class:`~faircast_ds.vllm.inplace.UndoRecord`); the rest go through vLLM's reload, whole groups, and
        are probed afterwards. If anything fails, the in-place writes are undone."""
        direct = [n for n in names if self._writable(n, changed)]
        written_in_place = set(direct)
        rest = [n for n in names if n not in written_in_place]
        undo = inplace.UndoRecord()
        began = time.perf_counter()
        with torch.inference_mode():
            try:
                for n in direct:
                    for index in (self._changes or {}).get(n) or ():
                        undo.write(self._targets[n], self.staging[n], index)
                wrote = time.perf_counter()
                self._reload(rest)
            except BaseException:
                undo.restore()
                for n in rest:  # vLLM may have replaced some of their tensors before it failed: probe them again
                    self._live.pop(n, None)
                    self._targets.pop(n, None)
                try:  # the logits follow what the embedding holds now
                    engine_weights.refresh_tied_heads(self.model, names)
                except Exception as exc:  # noqa: BLE001 - the load's own failure is what the caller must see
                    logger.warning("faircast: refreshing tied LM heads after a failed load failed too: %s", exc)
                raise
            reloaded = time.perf_counter()
            heads = engine_weights.refresh_tied_heads(self.model, names)
        written = undo.written
        undo.clear()
        refreshed = time.perf_counter()
        self._probe(rest)
        self.last.update(inplace=len(direct), inplace_elements=written, inplace_seconds=wrote - began,
                         reloaded=len(rest), reload_seconds=reloaded - wrote, tied_heads=heads,
                         tied_head_seconds=refreshed - reloaded, probe_seconds=time.perf_counter() - refreshed)

    def _probe(self, names: list[str]) -> None:
        """After vLLM reloaded these tensors: which of them later loads may write in place (the kernels
        compute with the engine's tensor, live; :func:`~faircast_ds.vllm.inplace.reads_live`). A tensor is
        probed at its first reload in a session; at later ones only its place is taken anew (vLLM picks a
        layer's kernel the same way at every reload, and probing every reloaded tensor again doubled the
        load of a delta that went through vLLM's reload)."""
        dtype = self.vllm_config.model_config.dtype
        for n in names:
            verdict = self._live.get(n)  # None: not probed yet in this session
            self._live[n] = False
            self._targets.pop(n, None)
            if not self._inplace or verdict is False:
                continue
            staged = self.staging[n]
            shape = tuple(staged.shape)
            with torch.inference_mode():
                target = engine_weights.inplace_target(self.model, n, shape, staged.dtype)
                if target is None:
                    continue
                live = True
                if verdict is None:
                    try:
                        rows, columns = engine_weights.kernel_probes(self.model, n, shape, dtype)
                        live = inplace.reads_live(target, staged, rows, columns)
                    except Exception as exc:  # noqa: BLE001 - a kernel that cannot be probed is reloaded
                        logger.debug("faircast: %s cannot be probed (%s); it keeps vLLM's reload", n, exc)
                        continue
            if live:
                self._live[n], self._targets[n] = True, target

    def _reload(self, names: list[str]) -> None:
        """vLLM's in-place reload of these staging tensors (HF names, whole fused groups)."""
        if not names:
            return
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        items = [(n, self.staging[n].to(self.device)) for n in names]
        with quiet_reload(), torch.inference_mode():
            reload_weights(self.vllm_config, self.model, weights_iterator=iter(items), weights_path=None,
                           is_checkpoint_format=True)

    def _check(self, names: list[str], version: int,
               touched: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """The loaded layers' kernels against the staging copy: sampled columns — with those the staged deltas
        changed (``touched``), up to as many again — or every element."""
        from faircast_ds.vllm.transfer.checksums import staging_check, touched_lines

        columns = 0 if self._check_mode == "full" else self._check_columns
        staged = [(n, self.staging[n]) for n in names]
        tied = engine_weights.ties_head(self.model)
        extra = touched_lines(staged, touched, columns, version, tied=tied) if columns and touched else None
        self.last.update(touched_lines=sum(t.numel() for t in extra.values()) if extra else 0)
        times: dict[str, float] = {}
        bad = staging_check(self.model, self.vllm_config.model_config.dtype, staged, columns, version, extra,
                            tied=tied, times=times)
        self.last.update({f"check_{k}": v for k, v in times.items()})
        if bad:
            raise RuntimeError(f"faircast: after loading version {version} the kernels compute with other "
                               f"bits than the staging copy in {len(bad)} tensor(s) ({self._check_mode} check): "
                               f"{bad[:5]}")

    def shutdown(self) -> None:
        if self.plane is not None:
            self.staging = {}
            self.plane.close()
        self.plane = None

    def _require(self) -> None:
        if self.plane is None:
            raise RuntimeError("faircast weight transfer is not initialized: POST /init_weight_transfer_engine "
                               "with the trainer's init_info first")
