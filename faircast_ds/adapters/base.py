"""What every adapter provides to the rest of faircast_ds."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterable, Iterator

import torch

from faircast_ds.shard_caster import ShardCaster, ShardSlice, with_padding


class UnsupportedSetupError(RuntimeError):
    """The DeepSpeed setup cannot get Fair Cast; the message says which setting and what to do."""


def param_name(names: dict, param: object) -> str:
    """The model's name for ``param``: the stable id its noise is derived from."""
    try:
        return names[param]
    except KeyError:
        raise UnsupportedSetupError("fair_cast: an optimizer parameter has no name in the model; the noise of an "
                                    "element is keyed by its parameter's name") from None


def slices_from_fragments(params: Iterable[Any], names: dict, total: int) -> list[ShardSlice]:
    """Slices of a flat fp32 partition that cuts across parameters, read from DeepSpeed's own
    fragment mapping (``param._hp_mapping``: where the local fragment sits in the parameter and in
    the partition); the gaps are alignment padding."""
    slices = []
    for param in params:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:  # no element of this parameter lives in this rank's partition
            continue
        lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
        slices.append(ShardSlice(param_name(names, param), int(lp.start), int(lp.numel), int(hp.start)))
    return with_padding(slices, total)


class Adapter(ABC):
    """Finds one optimizer's flat shards, routes its fp32 -> bf16 refresh sites through the caster."""

    zero_stage: int

    def __init__(self, optimizer: Any, caster: ShardCaster, names: dict) -> None:
        self.optimizer = optimizer
        self.caster = caster
        self.names = names  # parameter -> name in the model, as DeepSpeed's engine records it

    @abstractmethod
    def install(self) -> None:
        """Replace the optimizer's refresh sites with calls to :meth:`cast_group`."""

    @abstractmethod
    def flat_groups(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, list[ShardSlice]]]:
        """Yield (group key, fp32 master flat shard, bf16 served flat shard, slices) for this rank."""

    @abstractmethod
    def publish(self) -> None:
        """Make the model's bf16 parameters reflect the served shards after they were rewritten outside
        an optimizer step (a load, a restore)."""

    def local_numel(self) -> int:
        """Parameter elements held by this rank (padding excluded)."""
        return sum(s.numel for _, _, _, slices in self.flat_groups() for s in slices if not s.is_padding)

    @torch.no_grad()
    def cast_all(self) -> None:
        """Recompute every served shard from its master at the caster's current step."""
        for key, master, served, slices in self.flat_groups():
            self.caster.cast_flat(key, master, served, slices, previous=self.previous(key))

    def recast_all(self) -> None:
        """cast_all(), then publish the result to the model's parameters."""
        self.cast_all()
        self.publish()

    def previous(self, key: int) -> torch.Tensor | None:
        """The last served bits of a flat group, for adapters whose optimizer overwrites the served shard
        by round-to-nearest before the cast (None: the served shard itself still holds them)."""
        return None
