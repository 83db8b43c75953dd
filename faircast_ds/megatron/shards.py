"""Where Megatron-Core's distributed optimizer keeps this rank's shards, as (parameter, index) slices.

The param-and-grad buffer holds every parameter flat, bucket by bucket; each data-parallel rank owns
one contiguous range of each bucket, which cuts across parameters. For every parameter that reaches
into its range, the optimizer records (``gbuf_ranges[buffer][dtype][bucket]["param_map"][param]``):

- ``"param"``: the owned elements within the flattened parameter — the noise index of the first
  one is ``param.start``;
- ``"gbuf_world_in_bucket"``: where those elements sit in the bucket's ``param_data``.

Its fp32 main shard (``shard_fp32_from_float16_groups``) holds exactly those elements, and
``_copy_main_params_to_model_params`` copies it into ``param_data[gbuf_world_in_bucket]`` before the
param all-gather. Nothing here reads Megatron beyond those recorded ranges and the tensor-parallel
attributes of the parameter.

Under tensor parallelism the parameter is this rank's slice: ``"param"`` ranges over the flattened
LOCAL slice, and :mod:`faircast_ds.megatron.layout` maps it to the full parameter's indices (the noise
id); a shard's slices are computed once, on first use, and kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterator

import torch

from faircast_ds.megatron.layout import TensorSplit, split_of
from faircast_ds.shard.caster import ShardSlice


@dataclass(frozen=True)
class ParamShard:
    """Elements ``[start, start + numel)`` of this rank's parameter (flattened; under tensor parallelism
    its local slice, ``split`` saying where that sits in the full parameter ``name``), owned by this
    rank; they sit at ``[offset, offset + numel)`` of bucket ``bucket`` of param buffer ``buffer``."""

    name: str
    start: int
    numel: int
    buffer: int
    bucket: int
    offset: int
    split: TensorSplit | None = field(default=None, compare=False)

    @property
    def key(self) -> tuple[str, int]:
        """The caster's key for this shard (its residual, its diagnostics): stable for any data-parallel
        sharding (under tensor parallelism ``start`` is in the local slice: one key per rank's shard)."""
        return (self.name, self.start)

    @cached_property
    def _slices(self) -> list[ShardSlice]:
        if self.split is None:
            return [ShardSlice(self.name, self.start, self.numel, 0)]
        return self.split.slices(self.name, self.start, self.numel)

    def slices(self) -> list[ShardSlice]:
        """The shard as the caster sees it, keyed by the full parameter's indices: one slice when it is
        one contiguous run of the full parameter, else a few runs or one slice with index runs."""
        return self._slices


def param_shard(name: str, param_range: Any, bucket_range: Any, buffer: int, bucket: int,
                split: TensorSplit | None = None) -> ParamShard:
    """One shard from Megatron's two ranges for it (objects with ``start``, ``end``, ``size``)."""
    numel = int(param_range.end) - int(param_range.start)
    if numel != int(bucket_range.end) - int(bucket_range.start) or numel != int(param_range.size):
        raise ValueError(f"{name}: shard range in the parameter ({param_range}) and in the bucket "
                         f"({bucket_range}) differ in length")
    return ParamShard(name, int(param_range.start), numel, buffer, bucket, int(bucket_range.start), split)


def range_map(optimizer: Any, model_param: torch.nn.Parameter) -> dict[str, Any]:
    """Megatron's ranges for ``model_param`` on this rank (what its ``_get_model_param_range_map`` reads)."""
    buffer, dtype, bucket = optimizer.model_param_gbuf_map[model_param]
    return optimizer.gbuf_ranges[buffer][dtype][bucket]["param_map"][model_param]


def low_precision_shards(optimizer: Any, names: dict) -> Iterator[tuple[ParamShard, torch.Tensor, torch.Tensor]]:
    """(shard, fp32 main shard, bf16 view of the param buffer) for every bf16 parameter this rank owns
    a piece of, in the optimizer's own order."""
    for model_group, main_group in zip(optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups):
        for model_param, main in zip(model_group, main_group):
            ranges = range_map(optimizer, model_param)
            buffer, _, bucket = optimizer.model_param_gbuf_map[model_param]
            split = split_of(model_param)
            shard = param_shard(names[model_param], ranges["param"], ranges["gbuf_world_in_bucket"], buffer, bucket,
                                split)
            served = optimizer.buffers[buffer].buckets[bucket].param_data.view(-1)
            yield shard, main, served.narrow(0, shard.offset, shard.numel)


def fp32_shards(optimizer: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(fp32 main shard, fp32 view of the param buffer) for parameters kept in fp32: copied, not cast."""
    for model_group, main_group in zip(optimizer.model_fp32_groups, optimizer.shard_fp32_groups):
        for model_param, main in zip(model_group, main_group):
            ranges = range_map(optimizer, model_param)
            buffer, _, bucket = optimizer.model_param_gbuf_map[model_param]
            where = ranges["gbuf_world_in_bucket"]
            served = optimizer.buffers[buffer].buckets[bucket].param_data.view(-1)
            yield main, served.narrow(0, int(where.start), int(where.end) - int(where.start))
