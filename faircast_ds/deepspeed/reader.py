"""DeepSpeed's served-weight reader: a :class:`faircast_ds.export.source.ServedReader` over an engine (or
its module), handed to export by the attach pipeline (:func:`provide`, called by
``faircast_ds.deepspeed.attachment.attach`` for every engine it sees, with or without a ``fair_cast``
section).

- ZeRO-3: each parameter is partitioned (``faircast_ds.deepspeed.params``); its full shape is read from its
  ``ds_shape``, and a walk gathers it through DeepSpeed's own ``GatheredParameters``, one at a time, in
  its served dtype. A rank's own pieces are its served shard as Fair Cast's adapter describes it (the
  offsets of each parameter's partition); without Fair Cast they cannot be read (no delta walk then).
- ZeRO-0/1/2 and BF16_Optimizer: every rank holds the whole bf16 model; nothing is gathered. A rank's
  pieces are its adapter's shard with Fair Cast attached, else an even split of each parameter.

Nothing of export is reached back into: export asks :func:`faircast_ds.export.source.reader_of`, and gets
this reader because the attach handed it over.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from faircast_ds._util.dist import rank_world
from faircast_ds.deepspeed import params as ds_params
from faircast_ds.export import source as export_source
from faircast_ds.export.served import (
    LocalSlice,
    ParamSpec,
    adapter_slices,
    even_slices,
    module_of,
)
from faircast_ds.shard.handle import get_fair_cast


class DeepSpeedReader:
    """A DeepSpeed engine's (any ZeRO stage, BF16_Optimizer) served weights, in ``named_parameters()``
    order. ``model``: the engine or its module (Fair Cast's handle is kept on both). Local to build."""

    group = None  # the walk's collectives: the default group (ZeRO-3's gathers run on DeepSpeed's own)

    def __init__(self, model: Any) -> None:
        self.model = model
        named = list(module_of(model).named_parameters())
        self._params = [p for _, p in named]
        self.specs = [ParamSpec(name, ds_params.full_shape(p), p.dtype) for name, p in named]

    def local_slices(self) -> list[LocalSlice]:
        fair_cast = get_fair_cast(self.model)
        if fair_cast is not None:
            return adapter_slices(fair_cast.adapter)
        if any(ds_params.is_partitioned(p) for p in self._params):
            raise ValueError("reading a ZeRO-3 rank's served shard goes through Fair Cast's adapter, and this engine "
                             "has no fair_cast section (use mode 'nearest' for DeepSpeed's own rounding)")
        rank, world = rank_world()
        return even_slices(((s.name, p) for s, p in zip(self.specs, self._params)), rank, world)

    def is_gathered(self, index: int) -> bool:
        return ds_params.is_partitioned(self._params[index])

    @contextlib.contextmanager
    def full(self, index: int) -> Iterator[torch.Tensor]:
        with ds_params.gathered(self._params[index]) as full:
            yield full

    def change_marks(self) -> Any:
        """The casts' change marks over this rank's served shard (``FairCast.change_marks``), or None
        without Fair Cast: what a delta push reads instead of a copy of the bits it sent."""
        fair_cast = get_fair_cast(self.model)
        return fair_cast.change_marks() if fair_cast is not None else None

    def fair_cast_summary(self) -> dict[str, Any] | None:
        """The Fair Cast settings an export records (None: no Fair Cast on this engine)."""
        fair_cast = get_fair_cast(self.model)
        return fair_cast.summary() if fair_cast is not None else None


def provide(engine: Any) -> None:
    """Hand export this engine's reader, under the engine and under its module (a consumer may hold
    either). Called by ``attach`` for every engine; call it yourself for an engine built with the
    interpreter-start hook off and never attached."""
    export_source.provide(engine, DeepSpeedReader)
    module = getattr(engine, "module", None)
    if isinstance(module, torch.nn.Module):
        export_source.provide(module, DeepSpeedReader)
