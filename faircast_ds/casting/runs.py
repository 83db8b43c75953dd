"""A slice made of runs of a parameter: where each of its elements sits in the flattened parameter.

A tensor-parallel shard (a row-parallel weight: one run per row) is contiguous in the flat buffers but
not in the parameter, and the noise of an element is keyed by its index in the parameter. :class:`Runs`
says which: run ``r`` holds the slice's elements ``[offsets[r], offsets[r + 1])``, at parameter indices
``starts[r], starts[r] + 1, ...``. The fused kernels take the two tables and cast the whole slice in one
call (``casts.cast_into(..., runs=...)``); the eager path expands them to one index per element.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

_INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True, eq=False)
class Runs:
    """Runs of one parameter that make up a slice, in slice order. Made by :meth:`of`, which checks them.

    ``starts`` (int64, one per run): the parameter index of each run's first element; ``offsets``
    (int64, one more): where each run begins in the slice, from 0 to the slice's length."""

    starts: torch.Tensor
    offsets: torch.Tensor
    _on: dict = field(default_factory=dict, repr=False)  # device -> (offsets, starts) there

    @classmethod
    def of(cls, starts: torch.Tensor | list[int], lengths: torch.Tensor | list[int]) -> "Runs":
        """Runs from their parameter starts and their lengths (ints, or int64 tensors of one dimension):
        each start >= 0, each length >= 0, every index below 2^63."""
        starts = torch.as_tensor(starts, dtype=torch.int64).detach().cpu().contiguous()
        lengths = torch.as_tensor(lengths, dtype=torch.int64).detach().cpu().contiguous()
        if starts.dim() != 1 or lengths.shape != starts.shape:
            raise ValueError(f"runs: starts {tuple(starts.shape)} and lengths {tuple(lengths.shape)} must be "
                             "one-dimensional and of one length")
        if starts.numel() == 0:
            raise ValueError("runs: at least one run is needed")
        if bool((starts < 0).any()):
            raise ValueError(f"runs: a run starts at a negative index ({int(starts.min())})")
        if bool((lengths < 0).any()):
            raise ValueError(f"runs: a run has a negative length ({int(lengths.min())})")
        if bool((lengths > _INT64_MAX - starts).any()):
            raise ValueError("runs: a run reaches past index 2^63 - 1")
        offsets = torch.zeros(starts.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return cls(starts, offsets)

    @property
    def numel(self) -> int:
        """Elements in the slice: the runs' total length."""
        return int(self.offsets[-1])

    @property
    def count(self) -> int:
        return self.starts.numel()

    def on(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets, starts) on ``device``, copied there once."""
        device = torch.device(device)
        key = (device.type, device.index)
        tables = self._on.get(key)
        if tables is None:
            tables = (self.offsets.to(device), self.starts.to(device))
            self._on[key] = tables
        return tables

    def indices(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The parameter index of each element of the slice (int64, on ``device``): what the eager cast
        keys its noise by."""
        offsets, starts = self.on(device)
        k = torch.arange(self.numel, dtype=torch.int64, device=offsets.device)
        run = torch.searchsorted(offsets, k, right=True) - 1  # the last run starting at or before k
        return starts[run] + (k - offsets[run])
