"""Fair Cast's served weights as vLLM's trainer-side ``WeightSource``, so vLLM's own trainer engines
(nccl, ipc, sparse_nccl on GPUs; any registered backend) send exactly the bits the trainer serves.

    source = FairCastWeightSource(engine)          # every trainer rank (a DeepSpeed engine or a module)
    trainer = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)
    trainer.send_weights()                          # iterates the source: one dense walk, in lockstep
    source.acknowledge()                            # the engine confirmed: the source's delta base

Iteration is one dense walk of :class:`faircast_ds.export.source.ServedSource` (under ZeRO-3 a
collective: one bf16 gather per parameter, never fp32): every rank must iterate it, in order, to the
end, as vLLM's contract already requires. ``metadata()`` reads names, shapes and dtypes locally.
A gathered parameter is released when the walk advances, so it is yielded as a copy (``copy=True``,
the default) for backends that keep references until the round ends (ipc does); where every rank
holds the model (ZeRO-1/2, BF16_Optimizer) the parameter itself is yielded, as vLLM's
``ModuleSource`` does. Backends that send deltas read :attr:`source` itself (delta walks, masks).
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from faircast_ds.export.source import ServedSource, Walk


class FairCastWeightSource(WeightSource):
    """vLLM ``WeightSource`` over the served weights of ``model`` (or of ``source=``, a
    :class:`ServedSource` shared with other consumers, e.g. one built from a Megatron reader)."""

    def __init__(self, model: Any = None, *, source: ServedSource | None = None, copy: bool = True) -> None:
        self.source = source if source is not None else ServedSource(model)
        self.copy = copy
        self.last_walk: Walk | None = None

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(s.name, s.dtype, tuple(s.shape)) for s in self.source.specs]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        walk = self.source.walk("dense")
        self.last_walk = walk
        for item in walk:
            gathered = self.source.reader.is_gathered(item.index)
            yield item.name, item.tensor.clone() if self.copy and gathered else item.tensor

    def acknowledge(self) -> None:
        """The engine confirmed the last round (every rank): later delta walks of :attr:`source` are
        against it."""
        if self.last_walk is None:
            raise RuntimeError("nothing was sent from this source yet")
        self.last_walk.acknowledge()
