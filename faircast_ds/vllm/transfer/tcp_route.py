"""The socket route of :class:`~faircast_ds.vllm.transfer.served_push.ServedPush`: the served weights
into a ``vllm serve`` process over the ``faircast`` backend's authenticated channel (any host).

vLLM's ``HTTPVLLMWeightSyncClient`` drives the backend (:mod:`faircast_ds.vllm.transfer.trainer`: rank 0
sends one walk of the served weights, dense then deltas, while ``/update_weights`` receives it). With
``verify`` the engine reads the loaded layers' kernels back against what it received inside
``/finish_weight_update`` and fails that call on a difference; then the prefix cache is reset. A
verified push is four HTTP calls: start, update, finish (load + check), reset; a push whose delta
changes nothing is one (``/update_weight_version``).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from faircast_ds._util.dist import rank_world
from faircast_ds.export.channel import DEFAULT_HOST, WeightSyncError
from faircast_ds.export.source import ServedReport
from faircast_ds.export.stages import Stages
from faircast_ds.vllm.kernels import EngineWeightsMismatch
from faircast_ds.vllm.transfer.checksums import SAMPLE_COLUMNS
from faircast_ds.vllm.transfer.server import VllmServer

# what the engine's finish says when its kernels disagree with the staging copy (engine.py)
_MISMATCH = "kernels compute with other bits"


class TcpRoute:
    """The trainer's end of the authenticated channel, on every rank (collectives under ZeRO-3);
    ``server`` a :class:`VllmServer` on rank 0, None elsewhere. Built by ``ServedPush(plane="tcp")``.

    Verification (``verify=True``, the default) happens in the engine's ``finish_weight_update``: the
    layers the push loaded are read back through their kernels and compared with the staging copy the
    authenticated channel filled, every vector and ``check_columns`` input columns of every matrix (64;
    columns that move with each update of the layer,
    :func:`~faircast_ds.vllm.transfer.checksums.sample_columns`; the embedding at as large a share of
    its rows), because reading a whole matrix back through its kernel costs more than the push
    (docs/vllm.md). ``verify="full"`` (or ``check_columns=0``) reads every element."""

    def __init__(self, model: Any, server: VllmServer | None, *, port: int = 0, host: str = DEFAULT_HOST,
                 timeout: float = 120.0, delta: bool = True, verify: bool | str = True,
                 check_columns: int = SAMPLE_COLUMNS, inplace: bool = True) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferTrainerFactory,
        )

        from faircast_ds.vllm.transfer import register
        from faircast_ds.vllm.transfer.trainer import FairCastTrainerInitInfo

        if type(check_columns) is not int or check_columns < 0:
            raise ValueError(f"check_columns must be a non-negative integer, got {check_columns!r}")
        register()  # this process may not have run vLLM's plugin loader
        self.model, self.verify, self.check_columns = model, verify, check_columns
        self.rank, self.world = rank_world()
        self.server = server
        client = HTTPVLLMWeightSyncClient(self.server.url, timeout=timeout + 60) if self.server is not None else None
        self.transfer = WeightTransferTrainerFactory.trainer_init(
            FairCastTrainerInitInfo(rank=self.rank, port=port, host=host, timeout=timeout, delta=delta, inplace=inplace),
            client=client, source=model)
        self.params_total = len(self.transfer.sender.specs)
        self.last_check: str | None = None  # "whole" or "sampled": how the last push was verified

    def push(self, version: int | None = None, *, verify: bool | str | None = None, kind: str = "auto") -> ServedReport:
        """One update (dense the first time and after any failure, then deltas), checked in the engine's
        finish (``verify``: True, ``"full"`` or False), then the prefix cache reset;
        :class:`EngineWeightsMismatch` on every rank when the engine's kernels disagree."""
        verify = self.verify if verify is None else verify
        began = time.perf_counter()
        check = None if not verify else ("full" if verify == "full" or not self.check_columns else "sampled")

        def reset(stages: Stages) -> None:  # the engine's KV blocks were computed with the old weights
            with stages("http.reset_prefix_cache"):
                self.server.reset_prefix_cache()

        self.last_check = None
        try:
            sync = self.transfer.send_weights(version, kind=kind, check=check,
                                              check_columns=self.check_columns or SAMPLE_COLUMNS, after=reset)
        except WeightSyncError as exc:
            if _MISMATCH in str(exc):
                raise EngineWeightsMismatch(str(exc), []) from None
            raise
        self.last_check = ("whole" if check == "full" else "sampled") if check and sync.params else None
        # the engine's load and check are both inside the finish round trip (their split: the engine's own
        # report, VllmServer.engine_report(): load_seconds, check_seconds)
        return dataclasses.replace(sync, params_total=self.params_total, seconds=time.perf_counter() - began,
                                   load_seconds=float((sync.stages or {}).get("http.finish", 0.0)),
                                   verified=True if check and sync.params else None)

    def close(self) -> None:
        self.transfer.shutdown()
