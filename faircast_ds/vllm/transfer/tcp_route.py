"""The socket route of :class:`~faircast_ds.vllm.transfer.served_push.ServedPush`: the served weights
into a ``vllm serve`` process over the ``faircast`` backend's authenticated channel (any host).

vLLM's ``HTTPVLLMWeightSyncClient`` drives the backend (:mod:`faircast_ds.vllm.transfer.trainer`: rank 0
sends one walk of the served weights, dense then deltas); then the engine's prefix cache is reset and,
with ``verify``, vLLM's ``/weight_checker`` is asked to compare its checksums (the bits its kernels
compute with) with the served weights' own (:class:`~faircast_ds.vllm.transfer.checksums.ChecksumCollector`,
taken in the same walk, without vLLM) and ``/weight_info`` to show the pushed version.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from faircast_ds._util.dist import from_rank0, rank_world
from faircast_ds.export.channel import DEFAULT_HOST
from faircast_ds.export.source import ServedReport
from faircast_ds.export.stages import Stages
from faircast_ds.vllm.fused import packed_groups
from faircast_ds.vllm.kernels import EngineWeightsMismatch
from faircast_ds.vllm.transfer.checksums import (
    SAMPLE_COLUMNS,
    ChecksumCollector,
    served_checksums,
)
from faircast_ds.vllm.transfer.server import VllmServer


def _merged(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0.0) + v
    return out


class TcpRoute:
    """The trainer's end of the authenticated channel, on every rank (collectives under ZeRO-3);
    ``server`` a :class:`VllmServer` on rank 0, None elsewhere. Built by ``ServedPush(plane="tcp")``.

    Verification (``verify=True``, the default) compares vLLM's ``/weight_checker`` checksums of the
    bits its kernels compute with against the served weights' own, after every push. The first
    verified push of a session (and any push after a failed or unverified one) is checked whole:
    every element of every tensor. Later pushes check every vector and the embedding whole and
    ``check_columns`` input columns of every matrix (64; columns that move with each update of the
    layer, :func:`~faircast_ds.vllm.transfer.checksums.sample_columns`), because reading a whole
    matrix back through its kernel costs more than the push (docs/vllm.md). ``push(verify="full")``
    asks for a whole check; ``check_columns=0`` makes every check whole."""

    def __init__(self, model: Any, server: VllmServer | None, *, port: int = 0, host: str = DEFAULT_HOST,
                 timeout: float = 120.0, delta: bool = True, verify: bool | str = True,
                 check_columns: int = SAMPLE_COLUMNS) -> None:
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
            FairCastTrainerInitInfo(rank=self.rank, port=port, host=host, timeout=timeout, delta=delta),
            client=client, source=model)
        self.params_total = len(self.transfer.sender.specs)
        # verification rides on the update's own walk: a delta walk also shows the unchanged parts of a
        # fused layer with a changed part (vLLM checksums the fused tensor), and the checksums of the
        # layers it does not show are the last verified update's
        names = [s.name for s in self.transfer.sender.specs]
        self.groups = {n: g for n, g in packed_groups(names).items()
                       if len(g) > 1}
        # rank 0: vLLM-named checksums the engine's current weights must have, whole and sampled; None
        # where they are not known for every layer (every rank alike: whether they are known)
        self._whole: dict[str, str] | None = None
        self._sampled: dict[str, str] | None = None
        self.last_check: str | None = None  # "whole" or "sampled": how the last push was verified

    def push(self, version: int | None = None, *, verify: bool | str | None = None, kind: str = "auto") -> ServedReport:
        """One update (dense the first time and after any failure, then deltas), the prefix cache reset,
        and (``verify``: True, ``"full"`` or False) vLLM's ``/weight_checker`` compared with the served bits
        and ``/weight_info`` with ``version``; :class:`EngineWeightsMismatch` on every rank otherwise."""
        verify = self.verify if verify is None else verify
        began = time.perf_counter()
        sampled = bool(verify) and verify != "full" and self.check_columns > 0 and self._sampled is not None
        collector = None
        if verify and self.rank == 0:
            # whole checksums only for a whole check; sampled ones always (cheap), for the next push
            collector = ChecksumCollector(whole=not sampled,
                                          sample=(self.check_columns, int(version)) if self.check_columns else None)

        stages = Stages()

        def see(item: Any) -> None:  # the tensor is valid only until the walk advances
            if collector is not None:
                collector.add(item.name, item.tensor)

        try:
            sync = self.transfer.send_weights(version, kind=kind, on_param=see if verify else None,
                                              groups=self.groups if verify else None,
                                              check_columns=self.check_columns if sampled else 0)
        except Exception:
            self._whole = self._sampled = None
            raise
        version = sync.version
        error, mismatched, verify_seconds = None, [], 0.0
        if self.server is not None:
            try:
                with stages("http.reset_prefix_cache"):
                    self.server.reset_prefix_cache()  # its KV blocks were computed with the old weights
            except Exception as exc:  # noqa: BLE001 - reported on every rank
                error = f"reset_prefix_cache failed: {exc}"
        whole = sampled_now = None
        if verify:
            t0 = time.perf_counter()
            if collector is not None:
                collector.done()
            dense = sync.kind == "dense"
            t_sums = time.perf_counter()
            if not sampled and not dense and self._whole is None:
                # a whole check of a delta, but the layers it did not show were last sent unverified or
                # sampled: one more walk (a collective under ZeRO-3, every rank alike)
                from faircast_ds.export.source import served_weights

                everything = served_checksums(served_weights(self.model))
                stages.add("trainer.checksums", time.perf_counter() - t_sums)
                if collector is not None:
                    collector.full = everything
                    dense = True  # the expected checksums now cover every layer
            if self.rank == 0:
                if sampled:
                    sampled_now = {**self._sampled, **collector.sampled}
                    expected = sampled_now
                else:
                    whole = collector.full if dense else {**self._whole, **collector.full}
                    expected = whole
                    if self.check_columns and (sync.kind == "dense" or self._sampled is not None):
                        sampled_now = collector.sampled if sync.kind == "dense" else {**self._sampled,
                                                                                      **collector.sampled}
            if self.server is not None and error is None:
                try:
                    with stages("http.weight_checker"):  # the engine reads its kernels back here
                        result = self.server.compare(expected)
                    mismatched = list(result["mismatches"])
                    with stages("http.weight_info"):
                        served_version = self.server.weight_version()
                    if mismatched:
                        error = (f"after update {version} vLLM's /weight_checker disagrees with the served bits in "
                                 f"{len(mismatched)} tensor(s) ({'sampled' if sampled else 'whole'} check): "
                                 f"{mismatched[:5]}")
                    elif served_version != str(version):
                        error = f"vLLM serves weight version {served_version!r} after update {version}"
                except Exception as exc:  # noqa: BLE001
                    error = f"/weight_checker failed: {exc}"
            verify_seconds = time.perf_counter() - t0
        with stages("trainer.collectives"):
            error, mismatched = from_rank0((error, mismatched))
            ok = bool(verify) and error is None
            # every rank alike: whether rank 0's checksums describe the engine's weights now
            known_sampled = from_rank0(sampled_now is not None) if ok else False
        collectives = sync.collectives + ((2 if ok else 1) if self.world > 1 else 0)
        self._whole = (whole if self.rank == 0 else {}) if ok and not sampled else None
        self._sampled = (sampled_now if self.rank == 0 else {}) if known_sampled else None
        self.last_check = ("sampled" if sampled else "whole") if verify else None
        if error is not None:
            self.transfer._drop()  # the next push is dense
            raise EngineWeightsMismatch(error, mismatched)
        return dataclasses.replace(sync, params_total=self.params_total, seconds=time.perf_counter() - began,
                                   verify_seconds=verify_seconds, verified=True if verify else None,
                                   stages=_merged(sync.stages, stages.as_dict()),
                                   http_calls=sync.http_calls + stages.http_calls(), collectives=collectives)

    def close(self) -> None:
        self.transfer.shutdown()
