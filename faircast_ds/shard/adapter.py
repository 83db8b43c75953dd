"""What every adapter provides to the rest of faircast_ds: the framework-neutral base class.

An adapter belongs to one framework integration (``faircast_ds.deepspeed.adapters``,
``faircast_ds.megatron``): it finds one optimizer's flat shards, describes them as ``ShardSlice`` lists
and routes the optimizer's fp32 -> bf16 refresh sites through a :class:`ShardCaster`. Everything that
reads a framework's internals lives in those subclasses; this base only knows shards and casters.
"""
from __future__ import annotations

import contextlib

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Hashable, Iterator

import torch

from faircast_ds.shard.caster import ShardCaster, ShardSlice


class UnsupportedSetupError(RuntimeError):
    """The training setup (DeepSpeed, Megatron-Core) cannot get Fair Cast; the message names the setting and
    what to do."""


def param_name(names: dict, param: object) -> str:
    """The model's name for ``param``: the stable id its noise is derived from."""
    try:
        return names[param]
    except KeyError:
        raise UnsupportedSetupError("fair_cast: an optimizer parameter has no name in the model; the noise of an "
                                    "element is keyed by its parameter's name") from None


def narrowed(served: torch.Tensor, slices: list[ShardSlice]) -> Iterator[tuple[ShardSlice, torch.Tensor]]:
    """(slice, its elements of the flat ``served`` shard) for each parameter slice, padding left out."""
    flat = served.detach().view(-1)
    for s in slices:
        if not s.is_padding:
            yield s, flat.narrow(0, s.offset, s.numel)


@dataclass(frozen=True)
class Setup:
    """How an integration's optimizer holds its shards, in the integration's own terms (DeepSpeed:
    ``zero_stage``; Megatron-Core: ``optimizer``): the banner prints it, the state file keeps it."""

    fields: tuple[tuple[str, int | str | None], ...] = ()

    @classmethod
    def of(cls, **fields: int | str | None) -> "Setup":
        return cls(tuple(fields.items()))

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.fields)

    def state(self) -> dict[str, int | str | None]:
        """The entries the state file records (``faircast_ds.shard.state.save_state``)."""
        return dict(self.fields)


class Adapter(ABC):
    """Finds one optimizer's flat shards, routes its fp32 -> bf16 refresh sites through the caster."""

    def __init__(self, optimizer: Any, caster: ShardCaster, names: dict) -> None:
        self.optimizer = optimizer
        self.caster = caster
        self.names = names  # parameter -> name in the model, as the framework records it
        # True while a checkpoint load runs whose restore casts (or restores) every flat group afterwards:
        # load sites then leave the framework's refresh for the restore to replace (no cast at the old step)
        self.load_cast_deferred = False

    @abstractmethod
    def install(self) -> None:
        """Replace the optimizer's refresh sites with calls to :meth:`cast_group`."""

    @abstractmethod
    def flat_groups(self) -> Iterator[tuple[Hashable, torch.Tensor, torch.Tensor, list[ShardSlice]]]:
        """Yield (group key, fp32 master flat shard, bf16 served flat shard, slices) for this rank."""

    @abstractmethod
    def publish(self) -> None:
        """Make the model's bf16 parameters reflect the served shards after they were rewritten outside
        an optimizer step (a load, a restore)."""

    @contextlib.contextmanager
    def deferring_load_casts(self) -> Iterator["Adapter"]:
        """Inside, load sites do not cast: the caller casts or restores every flat group after the load
        (a checkpoint load with Fair Cast's restore), so a cast at the old step would only be replaced."""
        before, self.load_cast_deferred = self.load_cast_deferred, True
        try:
            yield self
        finally:
            self.load_cast_deferred = before

    def group_slices(self, key: Hashable) -> list[ShardSlice]:
        """The slices of one flat group."""
        for k, _, _, slices in self.flat_groups():
            if k == key:
                return slices
        raise KeyError(f"no flat group {key!r} in this rank's shards")

    @property
    def setup(self) -> Setup:
        """How this integration's optimizer shards (the banner prints it; e.g. ``zero_stage=3``). The
        base class knows no framework: an integration says it."""
        return Setup()

    def local_numel(self) -> int:
        """Parameter elements held by this rank (padding excluded)."""
        return sum(s.numel for _, _, _, slices in self.flat_groups() for s in slices if not s.is_padding)

    def served_views(self, key: Hashable) -> Iterator[tuple[ShardSlice, torch.Tensor]]:
        """(slice, the tensor the framework serves those elements from) for each parameter slice of group
        ``key``: by default the served flat shard itself (ZeRO-3 overrides: it serves from ``ds_tensor``)."""
        for k, _, served, slices in self.flat_groups():
            if k == key:
                yield from narrowed(served, slices)
                return

    def staging(self, key: Hashable) -> torch.Tensor | None:
        """A host bf16 buffer of the group's size the caster may cast into when the fp32 master is on the
        host and the served shard on a device (None: the caster keeps its own)."""
        return None

    @torch.no_grad()
    def cast_all(self) -> None:
        """Recompute every served shard from its master at the caster's current step."""
        for key, master, served, slices in self.flat_groups():
            self.caster.cast_flat(key, master, served, slices, previous=self.previous(key), staging=self.staging(key))

    def recast_and_publish(self, after_load: bool = False) -> None:
        """cast_all(), then publish the result to the model's parameters. A collective (publishing
        all-gathers the shards): call it on every rank. ``after_load``: the framework's own load has just
        written the checkpoint's model weights on every rank (an adapter may then skip a gather that
        would change nothing)."""
        self.cast_all()
        self.publish()

    def publish_restored(self, changed: int | None) -> None:
        """Publish after a restore wrote the saved served bits into the shards (a collective).
        ``changed``: how many of this rank's served elements the restore changed (None: unknown). Here
        always :meth:`publish`; an adapter whose framework's load already put the saved bits in every
        rank's full copy may skip a gather that no rank's restore made necessary."""
        self.publish()

    def previous(self, key: Hashable) -> torch.Tensor | None:
        """The last served bits of a flat group, for adapters whose optimizer overwrites the served shard
        by round-to-nearest before the cast (None: the served shard itself still holds them)."""
        return None
