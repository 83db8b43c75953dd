"""Where a Megatron-Core parameter's local elements sit in the full, unsplit parameter: the noise ids.

The noise of an element is keyed by (parameter name, index in the flattened parameter). Under tensor
and pipeline parallelism a rank holds a slice of some parameters, under a stage-local name; keyed by
those, TP 1 and TP 2 (or PP 1 and PP 2) would serve different bits. Here every local element gets the
FULL parameter's name and its index in the FULL parameter, so the served bits of a full parameter are
the same whatever the layout:

- names (:func:`global_names`): a transformer layer's ``layers.<i>`` (``i`` counted within the stage)
  becomes ``layers.<layer_number - 1>``, Megatron's own global number (``TransformerLayer.layer_number``,
  the stage's offset included); on a last stage that holds a copy of tied word embeddings
  (``shared_embedding``), ``output_layer.weight`` is served as ``embedding.word_embeddings.weight``, the
  parameter it copies.
- indices (:class:`TensorSplit`): from the attributes Megatron sets on a split parameter
  (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``; ``megatron/core/tensor_parallel/
  layers.py``): the partition dimension is cut into ``stride * tp`` equal chunks and rank ``r`` holds
  chunks ``r, r + tp, ...`` in that order, as Megatron's own CPU initialization splits a master weight
  (``_initialize_affine_weight_cpu``: ``weight_list[rank::world_size]``). That covers column-parallel
  linears and vocab-parallel embeddings / output layers (dimension 0: one contiguous run), row-parallel
  linears (dimension 1: one run per row), the fused QKV (grouped by query group, so a plain dimension-0
  split: TP slices concatenate to the TP 1 layout) and SwiGLU's ``linear_fc1`` (stride 2: rank ``r``
  holds ``[gate_r; up_r]``, gate chunk ``r`` and up chunk ``tp + r`` of ``[gate; up]``).

A local range of a rank's main shard becomes contiguous slices when it spans few runs or its runs are very
long (:data:`MIN_KERNEL_RUN`; the fused kernel casts each), else one slice with
:class:`faircast_ds.shard.caster.IndexRuns` (one start per run, computed once per shard), which the fused
kernels cast in one call over the runs (``rules.cast_into(..., runs=...)``; the eager path expands them),
never a per-element Python loop.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from faircast_ds.shard.caster import IndexRuns, ShardSlice

MAX_PLAIN_RUNS = 4  # up to this many contiguous runs a shard is cut into plain slices (fused kernel each)
# runs at least this long are plain slices however many (one fused-kernel call each, ~20 microseconds of
# Python and dispatch, small beside casting 2^18 elements); shorter runs -- a row-parallel weight's rows, of
# in_features / tp elements -- are one slice with index runs, cast by one kernel call over all of them
# (benchmarks/bench_runs.py: one call per row cost 13-50x a contiguous cast of the same elements)
MIN_KERNEL_RUN = 1 << 18

_LAYER = re.compile(r"^(.*\.)?layers\.(\d+)$")
TIED_OUTPUT = "output_layer.weight"
TIED_EMBEDDING = "embedding.word_embeddings.weight"


def _strip(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def global_names(chunks: Iterable[torch.nn.Module]) -> dict:
    """parameter -> the name of the full parameter it is (part of) in the whole model: wrappers'
    ``module.`` prefixes removed, stage-local layer numbers made global, a tied output copy named as
    the embedding it copies. Raises ValueError if two local parameters would get one name."""
    names: dict = {}
    for chunk in chunks:
        layers: dict[str, str] = {}  # local module path -> the same path with the global layer number
        for path, module in chunk.named_modules():
            path = _strip(path)
            match = _LAYER.match(path)
            number = getattr(module, "layer_number", None)
            if match and isinstance(number, int) and not isinstance(number, bool):
                layers[path] = f"{match.group(1) or ''}layers.{number - 1}"
        for name, param in chunk.named_parameters():
            names[param] = global_name(_strip(name), layers, shared_embedding=getattr(param, "shared_embedding", False))
    seen: dict[str, Any] = {}
    for param, name in names.items():
        if name in seen and seen[name] is not param:
            raise ValueError(f"two parameters of this rank map to the one full parameter {name!r}")
        seen[name] = param
    return names


def global_name(local: str, layers: dict[str, str], *, shared_embedding: bool = False) -> str:
    """The global name of the parameter called ``local`` on this stage, ``layers`` mapping each local
    transformer-layer path to its global one (the longest matching path wins)."""
    best = ""
    for path in layers:
        if local.startswith(path + ".") and len(path) > len(best):
            best = path
    name = layers[best] + local[len(best):] if best else local
    if shared_embedding and (name == TIED_OUTPUT or name.endswith("." + TIED_OUTPUT)):
        name = name[: len(name) - len(TIED_OUTPUT)] + TIED_EMBEDDING
    return name


@dataclass(frozen=True)
class TensorSplit:
    """A tensor-parallel slice of local shape ``local_shape``: rank ``rank`` of ``size``, cut along
    ``dim`` into chunks of ``local_shape[dim] // stride``; local chunk ``j`` is full chunk
    ``j * size + rank``."""

    local_shape: tuple[int, ...]
    dim: int
    stride: int
    size: int
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.dim < len(self.local_shape):
            raise ValueError(f"partition_dim {self.dim} is not a dimension of a {self.local_shape} slice")
        if self.stride < 1 or self.local_shape[self.dim] % self.stride:
            raise ValueError(f"partition_stride {self.stride} does not divide dimension {self.dim} of "
                             f"{self.local_shape}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size}")

    @property
    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.local_shape)
        shape[self.dim] *= self.size
        return tuple(shape)

    @property
    def _inner(self) -> int:
        n = 1
        for d in self.local_shape[self.dim + 1:]:
            n *= d
        return n

    @property
    def run_length(self) -> int:
        """Elements in one contiguous run of the full parameter: a chunk times the dimensions after ``dim``."""
        return self.local_shape[self.dim] // self.stride * self._inner

    def run_starts(self, first: int, last: int) -> torch.Tensor:
        """The full-parameter index of the first element of local runs ``first..last`` (int64)."""
        q = torch.arange(first, last + 1, dtype=torch.int64)
        outer, j = q // self.stride, q % self.stride
        chunk = self.local_shape[self.dim] // self.stride
        return (outer * self.full_shape[self.dim] + (j * self.size + self.rank) * chunk) * self._inner

    def slices(self, name: str, start: int, numel: int) -> list[ShardSlice]:
        """Local flattened elements ``[start, start + numel)`` (at flat offsets ``[0, numel)``) as slices
        keyed by their full-parameter indices."""
        if numel == 0:
            return []
        length = self.run_length
        first, last = start // length, (start + numel - 1) // length
        starts = self.run_starts(first, last)
        phase = start - first * length
        breaks = (starts[1:] != starts[:-1] + length).nonzero().flatten().tolist()
        if len(breaks) + 1 <= MAX_PLAIN_RUNS or length >= MIN_KERNEL_RUN:  # the fused kernel casts each piece
            out, run = [], 0
            for end_run in [b + 1 for b in breaks] + [len(starts)]:
                lo = max(run * length - phase, 0)
                hi = min(end_run * length - phase, numel)
                out.append(ShardSlice(name, int(starts[run]) + (phase if run == 0 else 0), hi - lo, lo))
                run = end_run
            return out
        return [ShardSlice(name, int(starts[0]) + phase, numel, 0, runs=IndexRuns(starts, length, phase))]


def tensor_split(param: torch.nn.Parameter, size: int, rank: int) -> TensorSplit | None:
    """How ``param`` is split across its tensor-parallel group of ``size`` (this rank ``rank``), or None
    when it is whole on this rank (not split, or a group of one)."""
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return None
    return TensorSplit(tuple(param.shape), int(getattr(param, "partition_dim", 0)),
                       int(getattr(param, "partition_stride", 1)), size, rank)


def tp_group_of(param: torch.nn.Parameter) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel group that splits ``param``: expert parameters (Megatron's
    ``allreduce=False``) are split over the expert tensor-parallel group."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0
    if getattr(param, "allreduce", True) is False:
        return ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def split_of(param: torch.nn.Parameter) -> TensorSplit | None:
    """:func:`tensor_split` of ``param`` over its own tensor-parallel group (Megatron's parallel state is
    read only for a parameter Megatron marked as split)."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return tensor_split(param, *tp_group_of(param))
