"""The engine side of the ``faircast`` weight-transfer backend: vLLM's ``WeightTransferEngine`` over
:mod:`faircast_ds.export`'s authenticated weight sync.

vLLM calls it from its worker, through its own RPCs and HTTP routes (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``):

- ``init_transfer_engine({"port", "params", "host", "timeout"})`` opens a
  :class:`~faircast_ds.export.WeightReceiver` on ``host:port`` (loopback by default) for the trainer's
  parameter list, into a CPU staging copy of the weights (HF names). The secret is this process's
  ``FAIRCAST_DS_SYNC_SECRET`` (or ``..._FILE``): it never travels over HTTP.
- ``update_weights({"version": v})`` receives one update of the sync (dense the first time in a
  session, then sparse deltas) into the staging copy — applied there only once complete and checked
  (the receiver's all-or-nothing) — and checks it carries version ``v``. The model is not touched.
- ``finish_weight_update()`` loads every staged tensor that changed since the last finish into the
  model in one call (``reload_weights(..., is_checkpoint_format=True)``, whole fused groups: vLLM
  rebuilds ``qkv_proj`` from q, k and v), between two engine steps; vLLM then sets its weight version.

So a trainer killed, or a sync cut, before ``finish`` leaves the model and vLLM's weight version as
they were. ``update_weights({"abandon": true})`` lets a restarted trainer end an update session a dead
one left open (vLLM refuses a new ``start`` while one is active); the staged bits stay staged and are
loaded at the next finish.
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

from faircast_ds.export.channel import DEFAULT_HOST
from faircast_ds.export.source import ServedReport
from faircast_ds.export.sync import WeightReceiver
from faircast_ds.vllm import fused
from faircast_ds.vllm.kernels import quiet_reload

logger = logging.getLogger("faircast_ds.vllm")
_DTYPES = {str(d): d for d in (torch.bfloat16, torch.float16, torch.float32)}


@dataclass
class FairCastInitInfo(WeightTransferInitInfo):
    """What the trainer tells the engine at ``/init_weight_transfer_engine``."""

    port: int
    params: list  # [[HF name, shape, dtype], ...] in the trainer's served order (spec_list)
    host: str = DEFAULT_HOST
    timeout: float = 120.0  # each wait of the receiver inside an update, seconds
    plane: str = "tcp"  # "tcp": the authenticated channel; "shm": the one-host shared-memory plane (shm.py)
    socket: str = ""  # the shm plane's abstract AF_UNIX socket name (the trainer picks it)


@dataclass
class FairCastUpdateInfo(WeightTransferUpdateInfo):
    """One ``/update_weights`` call: receive the sync's update of ``version`` (or ``abandon`` it)."""

    version: int | None = None
    abandon: bool = False
    check_columns: int = 0  # > 0: the next /weight_checker checksum samples this many columns per matrix
    check: str | None = None  # shm plane: "sampled" or "full": finish checks the loaded layers' kernels against the segment


class FairCastWeightTransferEngine(WeightTransferEngine[FairCastInitInfo, FairCastUpdateInfo]):
    """vLLM's worker-side engine for ``--weight-transfer-config '{"backend": "faircast"}'``."""

    init_info_cls = FairCastInitInfo
    update_info_cls = FairCastUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver: WeightReceiver | None = None
        self.plane: Any = None  # the shm plane's SegmentHost
        self._commit: Any = None  # the shm plane's committed write this session loads at finish
        self._check_mode: str | None = None
        self.staging: dict[str, torch.Tensor] = {}
        self.groups: dict[str, tuple[str, ...]] = {}
        self._loaded: dict[str, int] = {}  # staging tensors' version counters at the last load into the model
        self._received: ServedReport | None = None  # this session's complete update, not yet loaded
        self._abandoned = False
        self._loaded_version: dict[str, int] = {}  # staging name -> the version it was last loaded at
        self._check: int = 0  # columns per matrix the next checksum samples (0: whole)
        self._pending_check: int = 0  # what this session's update asked for, set at finish
        self.last: dict[str, Any] = {}

    # -- lifecycle -------------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: FairCastInitInfo) -> None:
        params = init_info.params
        if not isinstance(params, list) or not params:
            raise ValueError("faircast init_info needs 'params': the trainer's [[name, shape, dtype], ...]")
        for name, shape, dtype in params:
            if dtype not in _DTYPES:
                raise ValueError(f"faircast: {name} has dtype {dtype!r}; supported: {sorted(_DTYPES)}")
        if init_info.plane not in ("tcp", "shm"):
            raise ValueError(f"faircast init_info 'plane' is 'tcp' or 'shm', not {init_info.plane!r}")
        self.shutdown()
        if init_info.plane == "shm":
            from faircast_ds.export.served import ParamSpec
            from faircast_ds.vllm.transfer.shm import SegmentHost

            if not isinstance(init_info.socket, str) or not init_info.socket:
                raise ValueError("faircast init_info with plane 'shm' needs 'socket' (the local socket's name)")
            specs = [ParamSpec(str(n), tuple(int(d) for d in shape), _DTYPES[dtype]) for n, shape, dtype in params]
            self.plane = SegmentHost(specs, init_info.socket, timeout=float(init_info.timeout))
            staging = self.plane.views()  # the staging copy is the segment itself
        else:
            staging = {str(n): torch.zeros([int(d) for d in shape], dtype=_DTYPES[dtype]) for n, shape, dtype in params}
            # a new trainer's first update is dense (the receiver asks it), so zeros are never loaded
            self.receiver = WeightReceiver(staging, init_info.host, int(init_info.port), timeout=float(init_info.timeout))
        self.staging = staging
        packed = {k: list(v) for k, v in (getattr(self.model, "packed_modules_mapping", None) or {}).items()}
        self.groups = fused.packed_groups(list(staging), packed)
        self._loaded = {n: t._version for n, t in staging.items()}
        self._loaded_version, self._check = {}, 0
        if self.receiver is not None:
            logger.info("faircast weight transfer: receiver on %s:%d (%d parameters)", self.receiver.host,
                        self.receiver.port, len(staging))
        else:
            logger.info("faircast weight transfer: shared-memory plane @%s (%d parameters, %d bytes)",
                        init_info.socket, len(staging), self.plane.layout.nbytes)

    def start_weight_update(self) -> None:
        self._require()
        self._received, self._abandoned, self._pending_check = None, False, 0
        self._commit, self._check_mode = None, None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class would synchronize an accelerator: this engine loads nothing before finish
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: FairCastUpdateInfo) -> None:
        receiver = self._require()
        if update_info.abandon:
            self._received, self._abandoned, self._commit = None, True, None
            return
        if type(update_info.version) is not int:
            raise ValueError(f"faircast update_info needs an integer 'version', got {update_info.version!r}")
        if self.plane is not None:  # the ranks wrote and rank 0 committed before this call
            if update_info.check not in (None, "sampled", "full"):
                raise ValueError(f"faircast update_info 'check' is 'sampled', 'full' or null, not {update_info.check!r}")
            self._commit = self.plane.ledger.take(update_info.version)
            self._check_mode = update_info.check
            self._pending_check = 0
            self.last = {"version": self._commit.version, "kind": self._commit.kind, "params": len(self._commit.params),
                         "bytes": self._commit.bytes, "receive_seconds": 0.0}
            return
        began = time.perf_counter()
        report = None
        for _ in range(2):  # a sender that ended its session (bye) is followed by its next one
            if not receiver.connected:
                receiver.accept(timeout=receiver.timeout)
            report = receiver.receive(timeout=receiver.timeout)
            if report is not None:
                break
        if report is None:
            raise RuntimeError("faircast: the trainer ended its session without sending an update")
        if report.version != update_info.version:
            raise RuntimeError(f"faircast: received version {report.version}, the trainer announced "
                               f"{update_info.version}; not loaded")
        columns = update_info.check_columns
        if type(columns) is not int or columns < 0:
            raise ValueError(f"faircast update_info 'check_columns' must be a non-negative integer, got {columns!r}")
        self._received, self._pending_check = report, columns
        self.last = {"version": report.version, "kind": report.kind, "params": report.params,
                     "elements": report.changed, "bytes": report.bytes,
                     "receive_seconds": time.perf_counter() - began,
                     **{f"stage.{k}": float(v) for k, v in (report.stages or {}).items()}}

    def finish_weight_update(self) -> None:
        self._require()
        if self._abandoned:
            self._abandoned = False
            return  # an abandoned session: nothing loaded, vLLM's version unchanged (the trainer sends none)
        if self._received is None and self._commit is None:
            raise RuntimeError("faircast: no complete update was received in this session; the engine keeps "
                               "serving its previous weights")
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        began = time.perf_counter()
        if self._commit is not None:
            self._finish_plane(reload_weights)
            return
        changed = {n for n, t in self.staging.items() if t._version != self._loaded[n]}
        load = [n for n in self.staging if any(m in changed for m in self.groups.get(n, (n,)))]
        if load:
            items = [(n, self.staging[n].to(self.device)) for n in load]
            with quiet_reload(), torch.inference_mode():
                reload_weights(self.vllm_config, self.model, weights_iterator=iter(items), weights_path=None,
                               is_checkpoint_format=True)
        self._loaded = {n: t._version for n, t in self.staging.items()}
        self._loaded_version.update((n, self._received.version) for n in load)
        self._check = self._pending_check
        self.last.update(loaded=len(load), load_seconds=time.perf_counter() - began)
        self._received = None

    def _finish_plane(self, reload_weights: Any) -> None:
        """Load a committed shm write from the segment (the groups with a carried member; no copy on
        CPU), then, when asked, check the loaded layers' kernels against the segment."""
        commit, self._commit = self._commit, None
        began = time.perf_counter()
        names = list(self.staging)
        changed = {names[i] for i in commit.params}
        load = [n for n in names if any(m in changed for m in self.groups.get(n, (n,)))]
        if load:
            items = [(n, self.staging[n].to(self.device)) for n in load]
            with quiet_reload(), torch.inference_mode():
                reload_weights(self.vllm_config, self.model, weights_iterator=iter(items), weights_path=None,
                               is_checkpoint_format=True)
        self._loaded_version.update((n, commit.version) for n in load)
        loaded = time.perf_counter()
        self.last.update(loaded=len(load), load_seconds=loaded - began)
        if self._check_mode is not None and load:
            from faircast_ds.vllm.transfer.checksums import plane_check

            columns = 0 if self._check_mode == "full" else self._check_columns
            bad = plane_check(self.model, self.vllm_config.model_config.dtype, [(n, self.staging[n]) for n in load],
                              columns, commit.version)
            self.last.update(check_seconds=time.perf_counter() - loaded, checked=len(load))
            if bad:
                raise RuntimeError(f"faircast: after loading version {commit.version} the kernels compute with other "
                                   f"bits than the staging segment in {len(bad)} tensor(s) ({self._check_mode} check): "
                                   f"{bad[:5]}")

    _check_columns = 64

    def take_check_request(self) -> tuple[int, Any] | None:
        """For the next ``/weight_checker`` checksum (once): ``(columns per matrix, version_of)``, where
        ``version_of(vllm name)`` is the weight version that layer was last loaded at (None: never
        loaded through this backend, checked whole); None when the last update asked for a whole check."""
        columns, self._check = self._check, 0
        if not columns:
            return None
        packed = getattr(self.model, "packed_modules_mapping", None) or {}

        def version_of(name: str) -> int | None:  # a fused layer shares its first HF part's load version
            return self._loaded_version.get(fused.first_part(name, packed))

        return columns, version_of

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = None
        if self.plane is not None:
            self.staging = {}
            self.plane.close()
        self.plane = None

    def _require(self) -> Any:
        if self.receiver is None and self.plane is None:
            raise RuntimeError("faircast weight transfer is not initialized: POST /init_weight_transfer_engine "
                               "with the trainer's init_info first")
        return self.receiver
