"""Change marks: one bit per served element, set by the cast itself wherever it writes other bits than
the element held (issue 32 item 4). A delta push reads them instead of comparing against a copy of
the bits it last sent: 1 bit per shard element between pushes instead of 2 bytes.

Layout: one little-endian bitmap per flat served buffer (bit ``j`` of byte ``b`` is element
``8 * b + j``), its length rounded up to whole 32-bit words (the Triton kernel ORs words; the C++
kernel and the eager path OR bytes: the same bits). The kernels take the whole flat buffer's bitmap
and the bit of the slice's first element (``mark_base``) and OR ``1`` at every element whose bits
they changed; they never clear one.

:class:`ChangeMarks` keeps the bitmaps of one caster's flat buffers and finds the bits of any
contiguous view into them (:meth:`ChangeMarks.mask`), which is how a served-weight reader's slices
(views of the same buffers) are looked up. A new bitmap starts all ones ("changed since the last
acknowledged version": none was acknowledged yet); :meth:`ChangeMarks.invalidate` sets every bit
again when something other than the cast wrote served bits (a checkpoint load, a restore), and
:meth:`ChangeMarks.clear` zeroes them when an engine acknowledged everything the buffers hold.
Pure torch; no communication here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch

_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.uint8)


def bitmap_bytes(numel: int) -> int:
    """Bytes of the bitmap of ``numel`` elements: whole 32-bit words."""
    return -(-int(numel) // 32) * 4


def new_bitmap(numel: int, device: torch.device | str = "cpu", *, fill: bool = True) -> torch.Tensor:
    """A bitmap for ``numel`` elements, every bit set (``fill``) or clear; the bits past ``numel`` clear."""
    bits = torch.zeros(bitmap_bytes(numel), dtype=torch.uint8, device=device)
    if fill:
        set_range(bits, 0, numel)
    return bits


def set_range(bits: torch.Tensor, start: int, numel: int) -> None:
    """Set bits ``[start, start + numel)``."""
    if numel <= 0:
        return
    end = start + numel
    first, last = start // 8, (end - 1) // 8
    if first == last:
        bits[first] |= ((1 << (end - start)) - 1) << (start % 8)
        return
    bits[first] |= (0xFF << (start % 8)) & 0xFF
    if last > first + 1:
        bits[first + 1:last] = 0xFF
    bits[last] |= (1 << (end - 8 * last)) - 1


def or_mask(bits: torch.Tensor, base: int, mask: torch.Tensor) -> None:
    """OR a bool mask into ``bits`` at bits ``[base, base + len(mask))`` (the eager cast's marks)."""
    flat = mask.reshape(-1).to(bits.device)
    n = flat.numel()
    if n == 0 or not bool(flat.any()):
        return
    lead = base % 8
    first = base // 8
    width = -(-(lead + n) // 8)
    padded = torch.zeros(width * 8, dtype=torch.uint8, device=bits.device)
    padded[lead:lead + n] = flat.to(torch.uint8)
    packed = (padded.view(-1, 8) * _WEIGHTS.to(bits.device)).sum(dim=1, dtype=torch.uint8)
    bits[first:first + width] |= packed


def read_mask(bits: torch.Tensor, start: int, numel: int) -> torch.Tensor:
    """Bits ``[start, start + numel)`` as a bool mask (one byte per element of scratch)."""
    first = start // 8
    width = -(-(start % 8 + numel) // 8)
    window = bits[first:first + width].reshape(-1, 1)
    return (window & _WEIGHTS.to(bits.device)).ne(0).view(-1)[start % 8:start % 8 + numel]


def read_indices(bits: torch.Tensor, start: int, numel: int) -> torch.Tensor:
    """The set bits of ``[start, start + numel)`` as sorted int64 offsets from ``start``. Scans one byte
    per 8 elements and expands only the bytes with a bit set: no byte-per-element scratch."""
    if numel <= 0:
        return torch.zeros(0, dtype=torch.int64, device=bits.device)
    first, lead = start // 8, start % 8
    window = bits[first:first + -(-(lead + numel) // 8)]
    hot = window.nonzero().view(-1)
    if hot.numel() == 0:
        return hot
    row_bit = (window[hot].reshape(-1, 1) & _WEIGHTS.to(bits.device)).nonzero()  # (hot byte, bit) pairs, in order
    at = hot[row_bit[:, 0]] * 8 + row_bit[:, 1] - lead
    return at[(at >= 0) & (at < numel)]


def count_range(bits: torch.Tensor, start: int, numel: int) -> int:
    """How many of bits ``[start, start + numel)`` are set (whole bytes by a popcount table)."""
    if numel <= 0:
        return 0
    end = start + numel
    lo, hi = -(-start // 8), end // 8  # whole bytes inside the range
    if lo >= hi:
        return int(read_mask(bits, start, numel).sum())
    total = int(_POPCOUNT.to(bits.device)[bits[lo:hi].long()].sum(dtype=torch.int64))
    if start < 8 * lo:
        total += int(read_mask(bits, start, 8 * lo - start).sum())
    if end > 8 * hi:
        total += int(read_mask(bits, 8 * hi, end - 8 * hi).sum())
    return total


@dataclass
class _Flat:
    ptr: int  # data_ptr of the served buffer's first element
    numel: int
    element_size: int
    bits: torch.Tensor


class ChangeMarks:
    """The change marks of one caster's flat served buffers (see the module docstring)."""

    def __init__(self) -> None:
        self._flats: dict[Hashable, _Flat] = {}

    def for_cast(self, key: Hashable, served: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The bitmap the cast of flat buffer ``key`` (``served``, flat) ORs into, on ``device`` (where the
        kernel runs). Made all ones the first time, and again when the buffer moved or changed size."""
        flat = self._flats.get(key)
        ptr, numel = served.data_ptr(), served.numel()
        if flat is None or flat.numel != numel or flat.bits.device != torch.device(device):
            flat = _Flat(ptr, numel, served.element_size(), new_bitmap(numel, device))
            self._flats[key] = flat
        elif flat.ptr != ptr:  # the same buffer reallocated: what it held is unknown
            flat.ptr = ptr
            set_range(flat.bits, 0, numel)
        return flat.bits

    def mark_all(self, key: Hashable) -> None:
        flat = self._flats.get(key)
        if flat is not None:
            set_range(flat.bits, 0, flat.numel)

    def invalidate(self) -> None:
        """Every element counts as changed (something other than the cast wrote served bits)."""
        for flat in self._flats.values():
            set_range(flat.bits, 0, flat.numel)

    def clear(self) -> None:
        """Nothing changed since now (an engine acknowledged what the buffers hold)."""
        for flat in self._flats.values():
            flat.bits.zero_()

    def _locate(self, values: torch.Tensor) -> tuple[_Flat, int] | None:
        if not values.is_contiguous():
            return None
        ptr, size = values.data_ptr(), values.element_size()
        for flat in self._flats.values():
            end = flat.ptr + flat.numel * flat.element_size
            if flat.element_size == size and flat.ptr <= ptr and ptr + values.numel() * size <= end \
                    and (ptr - flat.ptr) % size == 0:
                return flat, (ptr - flat.ptr) // size
        return None

    def _require(self, values: torch.Tensor) -> tuple[_Flat, int]:
        found = self._locate(values)
        if found is None:
            raise KeyError("these values are not a view into a buffer the cast marks")
        return found

    def covers(self, values: torch.Tensor) -> bool:
        """Whether ``values`` is a contiguous view into one of the marked buffers."""
        return self._locate(values) is not None

    def mask(self, values: torch.Tensor) -> torch.Tensor:
        """Which elements of ``values`` (a view into a marked buffer) changed since the last clear."""
        flat, at = self._require(values)
        return read_mask(flat.bits, at, values.numel()).to(values.device)

    def indices(self, values: torch.Tensor) -> torch.Tensor:
        """Which elements of ``values`` changed since the last clear, as sorted int64 indices into it."""
        flat, at = self._require(values)
        return read_indices(flat.bits, at, values.numel()).to(values.device)

    def count(self, values: torch.Tensor) -> int:
        """How many elements of ``values`` changed since the last clear."""
        flat, at = self._require(values)
        return count_range(flat.bits, at, values.numel())

    @property
    def nbytes(self) -> int:
        return sum(f.bits.numel() for f in self._flats.values())

    def __len__(self) -> int:
        return len(self._flats)


class MarkSet:
    """The change marks of every caster of one attach (one per adapter), read as one, and claimed by
    at most one consumer at a time: :meth:`clear` is "that consumer's engine acknowledged everything",
    so two engines with their own acknowledged versions cannot share one set (the second one keeps
    its own baseline instead)."""

    def __init__(self, parts: list[ChangeMarks]) -> None:
        self.parts = parts
        self._owner = None  # a weak reference to the consumer that clears

    def claim(self, owner: object) -> bool:
        """Make ``owner`` the one consumer; False if another live one holds the set."""
        import weakref

        held = self._owner() if self._owner is not None else None
        if held is not None and held is not owner:
            return False
        self._owner = weakref.ref(owner)
        return True

    def release(self, owner: object) -> None:
        if self._owner is not None and self._owner() is owner:
            self._owner = None

    def _part(self, values: torch.Tensor) -> ChangeMarks:
        for part in self.parts:
            if part.covers(values):
                return part
        raise KeyError("these values are not a view into a buffer the cast marks")

    def covers(self, values: torch.Tensor) -> bool:
        return any(part.covers(values) for part in self.parts)

    def mask(self, values: torch.Tensor) -> torch.Tensor:
        return self._part(values).mask(values)

    def indices(self, values: torch.Tensor) -> torch.Tensor:
        return self._part(values).indices(values)

    def count(self, values: torch.Tensor) -> int:
        return self._part(values).count(values)

    def clear(self) -> None:
        for part in self.parts:
            part.clear()

    def invalidate(self) -> None:
        for part in self.parts:
            part.invalidate()

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)
