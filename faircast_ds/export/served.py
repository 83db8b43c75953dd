"""The served weights' shapes: what a served-weight reader (:class:`faircast_ds.export.source.ServedReader`)
reports and hands out, and the helpers readers share.

Where the parameters live is the reader's business: the integration that attached to a model hands
export its reader (:func:`faircast_ds.export.source.provide`; DeepSpeed's, ZeRO-3 included, is
``faircast_ds.deepspeed.reader``); a model no integration attached is read as a plain module. Nothing
fp32 is ever read here, and no framework is imported.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch


@dataclass(frozen=True)
class ParamSpec:
    """Name, full shape and dtype of one served parameter (known on every rank without a gather)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int = field(init=False, repr=False, compare=False)  # elements, counted once

    def __post_init__(self) -> None:
        n = 1
        for d in self.shape:
            n *= d
        object.__setattr__(self, "numel", n)


@dataclass(frozen=True)
class LocalSlice:
    """Elements ``[start, start + numel)`` of the flattened served parameter ``name`` held by this rank."""

    name: str
    start: int
    values: torch.Tensor  # 1-D view into the rank's served shard

    @property
    def numel(self) -> int:
        return self.values.numel()


def module_of(model: Any) -> torch.nn.Module:
    """The ``nn.Module`` behind a DeepSpeed engine (or the module itself)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def checked(name: str, p: torch.nn.Parameter) -> torch.nn.Parameter:
    """An ordinary parameter; one that holds no elements on this rank is most likely a framework's
    partitioned parameter whose integration handed export no reader: refused."""
    if p.numel() == 0:
        raise ValueError(f"parameter {name!r} holds no elements on this rank and no integration provided a reader "
                         "for this model (faircast_ds.export.source.provide): a ZeRO-3 engine's served weights are "
                         "read by faircast_ds.deepspeed.reader, which DeepSpeed's attach provides (the "
                         "interpreter-start hook, attach(), or faircast_ds.deepspeed.reader.provide(engine))")
    return p


def adapter_slices(adapter: Any) -> list[LocalSlice]:
    """This rank's served shard as an adapter's ``flat_groups()`` describe it (any integration:
    DeepSpeed's, Megatron's), read in place; padding left out. What a
    :class:`~faircast_ds.export.source.ServedReader` returns from ``local_slices`` when the adapter's
    parameter names and element offsets are those of the tensors its ``full`` yields."""
    out = []
    for _, _, served, slices in adapter.flat_groups():
        flat = served.detach().view(-1)
        out.extend(LocalSlice(s.name, s.start, flat.narrow(0, s.offset, s.numel)) for s in slices if not s.is_padding)
    return out


def even_slices(named: Iterable[tuple[str, torch.Tensor]], rank: int, world: int) -> list[LocalSlice]:
    """This rank's share of parameters every rank holds in full (a plain module, ZeRO-1/2 without Fair
    Cast): each split evenly across the ranks, read in place. Over all ranks they cover every element once."""
    out = []
    for name, p in named:
        flat = p.detach().view(-1)
        share = -(-flat.numel() // world)
        start = min(rank * share, flat.numel())
        numel = min(share, flat.numel() - start)
        if numel:
            out.append(LocalSlice(name, start, flat.narrow(0, start, numel)))
    return out
