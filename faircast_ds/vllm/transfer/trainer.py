"""The trainer side of the ``faircast`` weight-transfer backend: vLLM's ``TrainerWeightTransferEngine``
over :class:`faircast_ds.export.WeightSender` (the authenticated channel, dense then deltas).

Construct through vLLM's factory on every rank of the training job (a sync is a collective under
ZeRO-3; rank 0 is the sender and the only one that talks to the engine)::

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from faircast_ds.vllm.transfer import FairCastTrainerInitInfo

    client = HTTPVLLMWeightSyncClient("http://127.0.0.1:8000")
    transfer = WeightTransferTrainerFactory.trainer_init(FairCastTrainerInitInfo(rank=rank, port=29650),
                                                         client=client, source=ds_engine)
    transfer.send_weights()           # after each optimizer step: version = ds_engine.global_steps

One round: ``start_weight_update``; ``update_weights({"version": v})`` on a thread while every rank
runs :meth:`WeightSender.sync` (the engine's worker receives inside that call); then
``finish_weight_update(str(v))``, which loads the update into the model and sets vLLM's weight
version. Any failure raises :class:`~faircast_ds.export.WeightSyncError` on every rank and closes the
session, so the next round reconnects and is dense.
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
)

from faircast_ds._util.dist import from_rank0, rank_world
from faircast_ds.export.channel import DEFAULT_HOST, WeightSyncError, free_port  # noqa: F401 - free_port: its old home
from faircast_ds.export.stages import Stages
from faircast_ds.export.source import ServedReport
from faircast_ds.export.sync import WeightSender, spec_list
from faircast_ds.vllm.transfer.checksums import SAMPLE_COLUMNS


@dataclass
class FairCastTrainerInitInfo(TrainerInitInfo):
    """``port``: where the engine's receiver listens (0: a free port of this host, for a loopback engine).
    ``host``: the engine's address as both ends see it (loopback or a private interface). ``timeout``
    bounds every wait, seconds. ``delta``: sparse updates after the first (dense) one. ``inplace``: the engine
    may write updates into the tensors its kernels read live (False: vLLM's reload for every load)."""

    backend: ClassVar[str] = "faircast"
    port: int = 0
    host: str = DEFAULT_HOST
    timeout: float = 120.0
    delta: bool = True
    inplace: bool = True


def model_of(source: Any) -> Any:
    """The DeepSpeed engine (or module) a source serves from: ``source`` itself, a
    :class:`~faircast_ds.export.source.ServedSource`'s model, or a
    :class:`~faircast_ds.vllm.source.FairCastWeightSource`'s."""
    if source is None:
        raise ValueError("the faircast backend sends the served weights of a model: pass source=<DeepSpeed engine>")
    if callable(getattr(source, "forward", None)):
        return source
    inner = getattr(source, "source", None)  # a FairCastWeightSource wraps a ServedSource
    model = getattr(inner if inner is not None else source, "model", None)
    if model is None:
        raise ValueError(f"the faircast backend cannot find the model behind {type(source).__name__}: pass the "
                         "DeepSpeed engine, a ServedSource or a FairCastWeightSource")
    return model


class FairCastTrainerWeightTransferEngine(TrainerWeightTransferEngine[FairCastTrainerInitInfo]):
    init_info_cls = FairCastTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.sender: WeightSender | None = None
        self.timeout = 120.0
        self.last: ServedReport | None = None
        self.version_settable = False  # agreed by every rank in trainer_init

    @classmethod
    def trainer_init(cls, init_info: FairCastTrainerInitInfo, *, client: Any, source: Any = None
                     ) -> "FairCastTrainerWeightTransferEngine":
        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        self.timeout = float(init_info.timeout)
        model = model_of(source)
        port = from_rank0(init_info.port or free_port(init_info.host) if rank_world()[0] == 0 else None)
        self.sender = WeightSender(model, init_info.host, port, timeout=self.timeout, delta=init_info.delta)
        outcome = None
        if self.is_sender:
            outcome = (_call(client.init_weight_transfer_engine,
                             {"port": port, "host": init_info.host, "params": spec_list(self.sender.specs),
                              "timeout": self.timeout, "inplace": bool(init_info.inplace)}),
                       version_setter(client) is not None)
        # whether a push that changes nothing can set the version alone: only the sending rank holds the
        # client, and every rank must take the same path (one rank on the short path, the others on the
        # whole round, wait for each other forever)
        error, self.version_settable = from_rank0(outcome)
        if error is not None:
            raise WeightSyncError(f"the vLLM engine did not initialize the faircast backend: {error}")
        return self

    def send_weights(self, version: int | None = None, *, kind: str = "auto", check: str | None = None,
                     check_columns: int = SAMPLE_COLUMNS,
                     after: Callable[[Stages], None] | None = None) -> ServedReport:
        """One update round (every rank): the served weights at ``version`` (default: the DeepSpeed
        engine's ``global_steps``) into the engine, and vLLM's weight version set to ``str(version)``.
        ``check`` (``"sampled"`` or ``"full"``) has the engine read the loaded layers' kernels back against
        what it received inside ``finish_weight_update`` (``check_columns`` input columns per matrix when
        sampled): a difference fails the update (:mod:`faircast_ds.vllm.transfer.checksums`). ``after``:
        called on the sending rank once the engine finished (e.g. the prefix-cache reset); what it raises
        fails the round on every rank, in the same collective as the outcome."""
        sender = self.sender
        if version is None:
            version = getattr(sender.model, "global_steps", None)
            if version is None:
                raise ValueError("send_weights(version=...) is required for a model that is not a DeepSpeed engine")
        error = None
        stages = Stages()
        collectives = 0
        # a delta's changed count comes first: a push that changes nothing only sets vLLM's version
        walk = sender.delta_walk(kind, int(version))
        if walk is not None and walk.changed == 0 and self.version_settable:
            return self._same_bits(walk, int(version), stages)
        if self.is_sender:
            error = _timed(stages, "http.start", self.client.start_weight_update)
            if error is not None:  # a session a dead trainer left open: end it, then start ours
                error = (_timed(stages, "http.update", self.client.update_weights, {"abandon": True})
                         or _timed(stages, "http.finish", self.client.finish_weight_update, None)
                         or _timed(stages, "http.start", self.client.start_weight_update))
        if rank_world()[1] > 1:
            collectives += 1
        with stages("trainer.collectives"):
            error = from_rank0(error)
        if error is not None:
            if walk is not None:
                walk.close()
            self._drop()
            raise WeightSyncError(f"the vLLM engine did not start weight update {version}: {error}")
        box: dict[str, Any] = {}
        thread = None
        if self.is_sender:
            thread = threading.Thread(target=lambda: box.update(error=_timed(
                stages, "http.update", self.client.update_weights,
                {"version": int(version), "check": check, "check_columns": int(check_columns)})),
                daemon=True, name="faircast update_weights")
            thread.start()
        report, failure = None, None
        try:
            report = sender.sync(version, kind=kind, walk=walk)
        except WeightSyncError as exc:
            failure = str(exc)
        if self.is_sender:
            thread.join(self.timeout + 30.0)
            if thread.is_alive():
                failure = failure or f"the engine's update_weights did not return within {self.timeout + 30:.0f} s"
            elif box.get("error") is not None:
                failure = failure or f"the engine's update_weights failed: {box['error']}"
            if failure is None:
                failure = _timed(stages, "http.finish", self.client.finish_weight_update, str(version))
                if failure is not None:
                    failure = f"the engine's finish_weight_update failed: {failure}"
            if failure is None and after is not None:
                try:
                    after(stages)
                except Exception as exc:  # noqa: BLE001 - reported on every rank
                    failure = f"{type(exc).__name__}: {exc}"
        if rank_world()[1] > 1:
            collectives += 1
        with stages("trainer.collectives"):
            failure = from_rank0(failure)
        if failure is not None:
            self._drop()
            raise WeightSyncError(f"weight update {version} not applied by the vLLM engine: {failure}")
        stages.merge(report.stages)
        report = dataclasses.replace(report, stages=stages.as_dict(), http_calls=stages.http_calls(),
                                     collectives=report.collectives + collectives)
        self.last = report
        return report

    def _same_bits(self, walk: Any, version: int, stages: Stages) -> ServedReport:
        """Nothing changed since the acknowledged version: one call sets vLLM's weight version. The
        engine's receiver keeps the acknowledged version (the next delta is against it: the same bits),
        and nothing is loaded, so there is nothing to check and no cache to reset."""
        sender = self.sender
        walk.close()
        error = _timed(stages, "http.update_weight_version", version_setter(self.client), str(version)) \
            if self.is_sender else None
        collectives = sender.collectives + (2 if sender.world > 1 else 0)  # the count's all-reduce, the outcome
        with stages("trainer.collectives"):
            error = from_rank0(error)
        if error is not None:
            self._drop()
            raise WeightSyncError(f"weight version {version} (no bits changed) not set by the vLLM engine: {error}")
        stages.merge(sender.stages)
        report = walk.report(params=0, elements=0, stages=stages.as_dict(), http_calls=stages.http_calls(),
                             collectives=collectives)
        self.last = dataclasses.replace(report, version=version, seconds=walk.seconds)
        return self.last

    def _drop(self) -> None:
        """After a failure: end the session; the next round reconnects and is dense."""
        if self.sender is not None:
            self.sender.close()

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.is_sender and hasattr(self.client, "shutdown_weight_transfer_engine"):
            _call(self.client.shutdown_weight_transfer_engine)


def version_setter(client: Any) -> Callable[[str], None] | None:
    """How ``client`` sets vLLM's weight version without an update round: its own
    ``update_weight_version``, or the server's ``/update_weight_version`` route for vLLM's HTTP client;
    None for a client with neither (a push that changes nothing then makes the whole round)."""
    own = getattr(client, "update_weight_version", None)
    if callable(own):
        return own
    post, url = getattr(client, "_post", None), getattr(client, "base_url", None)
    if callable(post) and isinstance(url, str):
        return lambda version: post("update_weight_version", {"new_version": version})
    return None


class LLMWeightSyncClient:
    """vLLM's four-method weight-sync client over an in-process ``vllm.LLM`` (colocated): its own
    ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
    ``finish_weight_update`` (``vllm.entrypoints.rl.offline``), and the weight version it keeps."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def update_weight_version(self, weight_version: str) -> None:
        self.llm.update_weight_version(weight_version)


def _timed(stages: Stages, name: str, fn: Any, *args: Any) -> str | None:
    """:func:`_call`, its round trip added to ``stages`` under ``name``."""
    with stages(name):
        return _call(fn, *args)


def _call(fn: Any, *args: Any) -> str | None:
    """Run one control-plane call; its error as text (an HTTP error with vLLM's reply), or None."""
    try:
        fn(*args)
        return None
    except Exception as exc:  # noqa: BLE001 - reported on every rank by the caller
        detail = getattr(getattr(exc, "response", None), "text", "") or ""
        return f"{type(exc).__name__}: {exc} {detail[:300]}".strip()
