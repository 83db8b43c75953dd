"""The served weights: the bf16 parameters the trainer's forward uses, read one parameter at a time.

A parameter a framework partitions across ranks (DeepSpeed ZeRO-3's) is gathered in its served dtype,
through the framework's own gather (the layout its integration registers: ``faircast_ds.shard.partitioned``),
only while it is being read; under ZeRO-1/2 and BF16_Optimizer every rank already holds the full bf16
model, so nothing is gathered. Nothing fp32 is ever read here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from faircast_ds.shard import partitioned


@dataclass(frozen=True)
class ParamSpec:
    """Name, full shape and dtype of one served parameter (known on every rank without a gather)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


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
    """An ordinary parameter; one that holds no elements while no partitioned layout is registered is
    most likely a framework's partitioned parameter whose integration was never imported: refused."""
    if p.numel() == 0 and not partitioned.layouts():
        raise ValueError(f"parameter {name!r} holds no elements on this rank and no partitioned-parameter layout is "
                         "registered: a ZeRO-3 parameter is read through faircast_ds.deepspeed (import "
                         "faircast_ds.deepspeed.attachment, as the interpreter-start hook or attach() does)")
    return p


def served_specs(model: Any) -> list[ParamSpec]:
    """Every served parameter's name, full shape and dtype, in ``named_parameters()`` order. Local: no
    collective, no gather."""
    specs = []
    for name, p in module_of(model).named_parameters():
        shape = partitioned.full_shape(checked(name, p))
        specs.append(ParamSpec(name, shape, p.dtype))
    return specs


@torch.no_grad()
def served_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every parameter, in ``named_parameters()`` order, exactly as the
    trainer's forward sees it (bf16 under DeepSpeed's bf16 mode).

    A collective under ZeRO-3: call it on every rank and consume the iterator to the end on every
    rank. Each parameter is gathered on its own, in its served dtype, and released before the next
    one, so no rank holds more than one gathered parameter at a time. The yielded tensor is the
    parameter's own storage, not a copy: it is valid until the iterator advances and must not be
    modified. ``model`` is a DeepSpeed engine or a plain ``nn.Module``.
    """
    for name, p in module_of(model).named_parameters():
        if partitioned.is_partitioned(p):
            with partitioned.gathered(p) as full:
                yield name, full
        else:
            yield name, checked(name, p).data


def fair_cast_of(model: Any) -> Any:
    """The Fair Cast attached to an engine, or None (without importing DeepSpeed when no engine can
    exist)."""
    from faircast_ds.shard.handle import get_fair_cast

    return get_fair_cast(model)


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


def local_served_slices(model: Any) -> list[LocalSlice]:
    """This rank's own pieces of the served parameters, read in place (no gather, no copy). Over all
    ranks they cover every trained element exactly once.

    With Fair Cast attached they are the rank's served shard as its adapter describes it (any
    ZeRO stage). Without it, parameters that are not partitioned (ZeRO-1/2, a plain module) are
    split evenly across ranks. Raises ValueError for ZeRO-3 without Fair Cast.
    """
    fair_cast = fair_cast_of(model)
    if fair_cast is not None:
        return adapter_slices(fair_cast.adapter)
    params = list(module_of(model).named_parameters())
    if any(partitioned.is_partitioned(p) for _, p in params):
        raise ValueError("reading a ZeRO-3 rank's served shard goes through Fair Cast's adapter, and this engine "
                         "has no fair_cast section (use mode 'nearest' for DeepSpeed's own rounding)")
    from faircast_ds._util.dist import rank_world

    rank, world = rank_world()
    out = []
    for name, p in params:
        flat = p.detach().view(-1)
        share = -(-flat.numel() // world)
        start = min(rank * share, flat.numel())
        numel = min(share, flat.numel() - start)
        if numel:
            out.append(LocalSlice(name, start, flat.narrow(0, start, numel)))
    return out
