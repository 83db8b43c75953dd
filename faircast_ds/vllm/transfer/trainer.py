"""The trainer side of the ``faircast`` weight-transfer backend for vLLM's own RL API: vLLM's
``TrainerWeightTransferEngine`` over :class:`~faircast_ds.vllm.transfer.served_push.ServedPush`, driving the
engine through a weight-sync client of vLLM's (HTTP, Ray, or :class:`LLMWeightSyncClient` in process).

Construct through vLLM's factory on every rank of the training job (a push is a collective under
ZeRO-3; rank 0 holds the client)::

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from faircast_ds.vllm.transfer import FairCastTrainerInitInfo

    client = HTTPVLLMWeightSyncClient("http://127.0.0.1:8000")
    transfer = WeightTransferTrainerFactory.trainer_init(FairCastTrainerInitInfo(rank=rank),
                                                         client=client, source=ds_engine)
    transfer.send_weights()           # after each optimizer step: version = ds_engine.global_steps

Each round is one :meth:`ServedPush.push`: every rank writes its slices through the plane, rank 0 drives
``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` through the client. Any failure
raises :class:`~faircast_ds.export.channel.WeightSyncError` on every rank and the next round is dense.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar
from urllib.parse import urlsplit

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
)

from faircast_ds.export.channel import DEFAULT_HOST
from faircast_ds.export.source import ServedReport
from faircast_ds.vllm.transfer.checksums import SAMPLE_COLUMNS
from faircast_ds.vllm.transfer.served_push import ServedPush


@dataclass
class FairCastTrainerInitInfo(TrainerInitInfo):
    """``plane``: ``"shm"``, ``"net"`` or ``"group"``, or None: the fastest that works for an engine at
    ``host`` (shm where it is this host). ``host``/``port``: where the engine's end listens on the net and
    group planes (port 0: a free port of this host, for an engine on this host). ``timeout`` bounds every
    wait, seconds. ``delta``: after the first (dense) push, only what changed. ``inplace``: the engine may
    write updates into the tensors its kernels read live (False: vLLM's reload for every load)."""

    backend: ClassVar[str] = "faircast"
    plane: str | None = None
    port: int = 0
    host: str = DEFAULT_HOST
    timeout: float = 120.0
    delta: bool = True
    inplace: bool = True


def model_of(source: Any) -> Any:
    """The DeepSpeed engine (or module) a source serves from: ``source`` itself, a
    :class:`~faircast_ds.export.source.ServedSource`'s model, or a
    :class:`~faircast_ds.vllm.weight_source.FairCastWeightSource`'s."""
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
        self.push: ServedPush | None = None
        self.last: ServedReport | None = None

    @classmethod
    def trainer_init(cls, init_info: FairCastTrainerInitInfo, *, client: Any, source: Any = None
                     ) -> "FairCastTrainerWeightTransferEngine":
        self = cls(client=client, source=source, is_sender=init_info.is_sender)
        server = ClientServer(client, init_info.host) if self.is_sender else None
        networked = {} if init_info.port == 0 and init_info.host == DEFAULT_HOST else \
            {"port": init_info.port, "host": init_info.host}
        self.push = ServedPush(model_of(source), server, plane=init_info.plane, timeout=init_info.timeout,
                               delta=init_info.delta, inplace=init_info.inplace, **networked)
        return self

    def send_weights(self, version: int | None = None, *, kind: str = "auto", check: str | None = "sampled",
                     check_columns: int = SAMPLE_COLUMNS) -> ServedReport:
        """One update round (every rank): the served weights at ``version`` (default: the DeepSpeed
        engine's ``global_steps``) into the engine, and vLLM's weight version set to ``str(version)``.
        ``check`` (``"sampled"``, ``"full"`` or None) has the engine read the loaded layers' kernels back
        against the segment inside ``finish_weight_update`` (``check_columns`` input columns per matrix
        when sampled): a difference fails the update (:mod:`faircast_ds.vllm.transfer.checksums`)."""
        if check not in (None, "sampled", "full"):
            raise ValueError(f"check is 'sampled', 'full' or None, not {check!r}")
        self.push.check_columns = check_columns
        self.last = self.push.push(version, kind=kind, verify={None: False, "sampled": True, "full": "full"}[check])
        return self.last

    def shutdown(self) -> None:
        if self.push is not None:
            self.push.close()


class ClientServer:
    """What :class:`ServedPush` asks of a server, over a weight-sync client of vLLM's (which has vLLM's
    four update calls and the engine's init and shutdown). ``engine_host``: the engine's host as this
    process reaches it, for the plane ServedPush picks."""

    def __init__(self, client: Any, engine_host: str) -> None:
        url = getattr(client, "base_url", None)  # vLLM's HTTP client: where the server is
        self.client = client
        self.engine_host = (urlsplit(url).hostname if isinstance(url, str) else None) or engine_host
        for name in ("init_weight_transfer_engine", "shutdown_weight_transfer_engine", "start_weight_update",
                     "update_weights", "finish_weight_update"):
            setattr(self, name, getattr(client, name))
        self._set_version = version_setter(client)

    def abandon_weight_update(self) -> None:
        """End an update session a dead trainer left open: nothing loaded, vLLM's version unchanged."""
        self.client.update_weights({"abandon": True})
        self.client.finish_weight_update(None)

    def update_weight_version(self, version: str) -> None:
        """vLLM's weight version alone (a push that changed no bit): the client's own call where it has one,
        else an abandoned round whose finish sets the version."""
        if self._set_version is not None:
            self._set_version(version)
            return
        self.client.start_weight_update()
        self.client.update_weights({"abandon": True})
        self.client.finish_weight_update(version)

    def reset_prefix_cache(self) -> None:
        """The engine's prefix cache, where the client can reset it (vLLM's HTTP client, an in-process LLM)."""
        own = getattr(self.client, "reset_prefix_cache", None)
        post = getattr(self.client, "_post", None)
        if callable(own):
            own()
        elif callable(post) and isinstance(getattr(self.client, "base_url", None), str):
            post("reset_prefix_cache", None)


def version_setter(client: Any) -> Callable[[str], None] | None:
    """How ``client`` sets vLLM's weight version without an update round: its own
    ``update_weight_version``, or the server's ``/update_weight_version`` endpoint for vLLM's HTTP client;
    None for a client with neither."""
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
    ``finish_weight_update`` (``vllm.entrypoints.rl.offline``), the weight version it keeps, and its
    prefix cache."""

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

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()
