"""What changed since the version an engine acknowledged, per local slice of the served weights: the
question every delta asks (issue 32 item 4). Two answers, one interface:

- :class:`MarksTracker`: the cast's own change marks (:mod:`faircast_ds.casting.marks`, 1 bit per
  shard element, set by the kernel that writes the served bits). Used when the reader the model's
  integration provided offers them (``reader.change_marks()``: DeepSpeed with Fair Cast attached) and
  they cover every local slice.
- :class:`BaselineTracker`: a copy of each slice's bits at the acknowledged version (2 bytes per
  element), compared against the bits now. The answer for weights no cast marks (a plain module, an
  integration that offers no marks, a second engine when the marks already serve one).

:func:`tracker_for` picks one. Both are rank-local; the collectives stay with the routes.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from faircast_ds.export import delta as delta_encoding


class BaselineTracker:
    """Changes against a kept copy of the acknowledged bits (2 bytes per local element)."""

    kind = "baseline"

    def __init__(self) -> None:
        self._baseline: list[torch.Tensor] | None = None

    def counts(self, values: Sequence[torch.Tensor]) -> list[int]:
        return [int((delta_encoding.bits_view(v) != base).sum()) for v, base in zip(values, self._require(values))]

    def mask(self, position: int, values: torch.Tensor) -> torch.Tensor:
        base = self._baseline[position] if self._baseline is not None else None
        if base is None:
            raise RuntimeError("no acknowledged version to compare against")
        return torch.ne(delta_encoding.bits_view(values), base)

    def indices(self, position: int, values: torch.Tensor) -> torch.Tensor:
        """Sorted int64 indices of the elements of slice ``position`` that changed."""
        return self.mask(position, values).nonzero().view(-1)

    def acknowledge(self, values: Sequence[torch.Tensor], positions: set[int] | None = None) -> None:
        """The engine now serves ``values``' bits (those of ``positions`` only, the others unchanged)."""
        if self._baseline is None or len(self._baseline) != len(values):
            self._baseline = [delta_encoding.bits_view(v).clone() for v in values]
            return
        for p in range(len(values)) if positions is None else positions:  # in place: no second copy
            self._baseline[p].copy_(delta_encoding.bits_view(values[p]))

    def _require(self, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self._baseline is None or len(self._baseline) != len(values):
            raise RuntimeError("no acknowledged version to compare against")
        return self._baseline

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._baseline or ())

    def close(self) -> None:
        self._baseline = None


class MarksTracker:
    """Changes read from the cast's change marks (1 bit per local element, kept by the casters)."""

    kind = "marks"

    def __init__(self, marks: Any) -> None:
        self.marks = marks

    def counts(self, values: Sequence[torch.Tensor]) -> list[int]:
        return [self.marks.count(v) for v in values]

    def mask(self, position: int, values: torch.Tensor) -> torch.Tensor:
        return self.marks.mask(values)

    def indices(self, position: int, values: torch.Tensor) -> torch.Tensor:
        return self.marks.indices(values)

    def acknowledge(self, values: Sequence[torch.Tensor], positions: set[int] | None = None) -> None:
        """The engine now serves every local bit as it is: no element changed since. (Slices a delta
        did not carry had no marks set, so clearing them all is the same.)"""
        self.marks.clear()

    @property
    def nbytes(self) -> int:
        return int(self.marks.nbytes)

    def close(self) -> None:
        self.marks.release(self)


def tracker_for(reader: Any, values: Sequence[torch.Tensor]) -> MarksTracker | BaselineTracker:
    """The cast's marks when ``reader`` offers them, they cover every one of ``values`` and no other
    consumer holds them; else a baseline."""
    offer = getattr(reader, "change_marks", None)
    marks = offer() if callable(offer) else None
    if marks is not None and all(marks.covers(v) for v in values):
        tracker = MarksTracker(marks)
        if marks.claim(tracker):
            marks.invalidate()  # nothing this consumer's engine acknowledged yet
            return tracker
    return BaselineTracker()
