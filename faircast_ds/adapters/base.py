"""What every adapter provides to the rest of faircast_ds."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator

import torch

from faircast_ds.shard_caster import ShardCaster, ShardSlice


class UnsupportedSetupError(RuntimeError):
    """The DeepSpeed setup cannot get Fair Cast; the message says which setting and what to do."""


class Adapter(ABC):
    """Finds one optimizer's flat shards, routes its fp32 -> bf16 refresh sites through the caster."""

    zero_stage: int

    def __init__(self, optimizer: object, caster: ShardCaster) -> None:
        self.optimizer = optimizer
        self.caster = caster

    @abstractmethod
    def install(self) -> None:
        """Replace the optimizer's refresh sites with calls to :meth:`cast_group`."""

    @abstractmethod
    def flat_groups(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, list[ShardSlice]]]:
        """Yield (group key, fp32 master flat shard, bf16 served flat shard, slices) for this rank."""

    def local_numel(self) -> int:
        """Parameter elements held by this rank (padding excluded)."""
        return sum(s.numel for _, _, _, slices in self.flat_groups() for s in slices)

    def recast_all(self) -> None:
        """Recompute every served shard from its master at the current step (used after a load)."""
        for key, master, served, slices in self.flat_groups():
            self.caster.cast_flat(key, master, served, slices)
        self.after_recast()

    def after_recast(self) -> None:
        """Hook for adapters whose parameters must be re-pointed after their flat buffer changed."""
