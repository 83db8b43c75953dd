"""Sparse deltas of served weights: which elements changed, and two encodings of them.

Elements are compared by their bit patterns (so NaN payloads and -0.0 count as what they are).
A delta of one parameter is (sorted element indices, new bit patterns), sent either as
``COO`` (index array + values) or as ``BITMAP`` (one bit per element + values), whichever is
smaller; ``DENSE`` sends every element, and is what a delta sends for a parameter where it is the
smallest of the three (:func:`best`). Pure functions; no communication here.
"""
from __future__ import annotations

from typing import Sequence

import torch

DENSE, COO, BITMAP = 0, 1, 2
ENCODINGS = {DENSE: "dense", COO: "coo", BITMAP: "bitmap"}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.uint8)


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as same-width integers (a view, flattened)."""
    return t.detach().view(-1).view(_BITS[t.element_size()])


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    return _BITS[torch.empty((), dtype=dtype).element_size()]


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def changed(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Sorted indices where the bit patterns of two equal-length tensors differ."""
    return (bits_view(before) != bits_view(after)).nonzero().view(-1)


def encoded_bytes(encoding: int, numel: int, nnz: int, element_size: int) -> int:
    if encoding == DENSE:
        return numel * element_size
    if encoding == COO:
        return nnz * (torch.empty((), dtype=index_dtype(numel)).element_size() + element_size)
    return (numel + 7) // 8 + nnz * element_size


def choose(numel: int, nnz: int, element_size: int) -> int:
    """The smaller sparse encoding of ``nnz`` changes out of ``numel`` elements."""
    return min((COO, BITMAP), key=lambda e: encoded_bytes(e, numel, nnz, element_size))


def best(numel: int, nnz: int, element_size: int) -> int:
    """The smallest encoding of ``nnz`` changes out of ``numel`` elements, ``DENSE`` included: a
    parameter most of whose elements changed travels whole (a bitmap costs 1 bit per element more)."""
    if nnz >= numel:
        return DENSE
    return min((DENSE, COO, BITMAP), key=lambda e: encoded_bytes(e, numel, nnz, element_size))


def mask_to_bitmap(mask: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """A bool (or 0/1) mask as the protocol's little-endian bitmap (uint8): ``width`` bytes, zero-padded
    (default: ``ceil(len / 8)``). At most one byte per element of scratch, no index list."""
    flat = mask.reshape(-1)
    width = (flat.numel() + 7) // 8 if width is None else int(width)
    if width * 8 < flat.numel():
        raise ValueError(f"a bitmap of {width} bytes cannot hold {flat.numel()} elements")
    padded = torch.zeros(width * 8, dtype=torch.uint8, device=flat.device)
    padded[:flat.numel()] = flat.to(torch.uint8)
    return (padded.view(-1, 8) * _WEIGHTS.to(flat.device)).sum(dim=1, dtype=torch.uint8)


def bitmap_to_mask(bitmap: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` bits of a little-endian bitmap as a bool mask (no check of the bits past it)."""
    return (bitmap.reshape(-1, 1) & _WEIGHTS.to(bitmap.device)).ne(0).view(-1)[:length]


def pack_bits(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """A little-endian bitmap (uint8) with the given element indices set."""
    mask = torch.zeros(numel, dtype=torch.bool)
    mask[indices] = True
    return mask_to_bitmap(mask)


def unpack_bits(bitmap: torch.Tensor, numel: int) -> torch.Tensor:
    """Sorted indices of the set bits; raises ValueError if a bit past ``numel`` is set."""
    bits = bitmap_to_mask(bitmap, bitmap.numel() * 8)
    if bits.numel() != (numel + 7) // 8 * 8:
        raise ValueError(f"bitmap of {bitmap.numel()} bytes for {numel} elements")
    if bool(bits[numel:].any()):
        raise ValueError("bitmap has bits set past the end of the parameter")
    return bits.nonzero().view(-1)


def check_indices(indices: torch.Tensor, numel: int) -> None:
    """Raise ValueError unless ``indices`` are strictly increasing and inside ``[0, numel)``."""
    if indices.numel() == 0:
        return
    if int(indices[0]) < 0 or int(indices[-1]) >= numel:
        raise ValueError(f"element index out of range [0, {numel})")
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise ValueError("element indices are not strictly increasing")


def apply(target: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """Write bit patterns ``values`` at ``indices`` of ``target`` (in place, on the target's device)."""
    bits_view(target)[indices.to(target.device)] = values.to(target.device)


def count_bits(bitmap: torch.Tensor, numel: int) -> int:
    """How many bits a bitmap of ``numel`` elements sets (without listing them: at most one byte per
    element of scratch); raises ValueError for a wrong size or a bit set past ``numel``."""
    if bitmap.numel() != (numel + 7) // 8:
        raise ValueError(f"bitmap of {bitmap.numel()} bytes for {numel} elements")
    if numel % 8 and int(bitmap[-1]) >> (numel % 8):
        raise ValueError("bitmap has bits set past the end of the parameter")
    return int(_POPCOUNT[bitmap.to(torch.int32)].sum(dtype=torch.int64))


def same_bits(target: torch.Tensor, encoding: int, first: torch.Tensor | None, values: torch.Tensor) -> bool:
    """Whether writing one parameter's payload (``encoding``: :data:`COO`, :data:`BITMAP` or whole) into
    ``target`` would leave every bit as it is (nothing is written)."""
    flat = bits_view(target)
    values = values.to(target.device)
    if encoding == COO:
        return torch.equal(flat[first.to(target.device)], values)
    if encoding == BITMAP:
        mask = bitmap_to_mask(first, flat.numel())
        return torch.equal(flat[mask.to(target.device)], values)
    return torch.equal(flat, values.view(-1))


def touched_lines(shape: Sequence[int], encoding: int,
                  first: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a 2-D parameter of ``shape`` and one payload for it (``encoding``, and ``first``: its indices or
    bitmap): (rows, columns) holding an element the payload writes, as sorted int64 indices — those a
    change list (:data:`COO`) or a bitmap names; every row and column for a whole payload, which a delta
    sends only when nearly every element changed (:func:`best`), so nothing is compared. None for a shape
    that is not 2-D. One pass over the indices or the bitmap, no sort; the parameter itself is not read."""
    if len(shape) != 2:
        return None
    rows, cols = (int(d) for d in shape)
    if encoding == COO:
        index = first.to(torch.int64)
        row_hit = torch.zeros(rows, dtype=torch.bool)
        col_hit = torch.zeros(cols, dtype=torch.bool)
        row_hit[index // cols] = True
        col_hit[index % cols] = True
    elif encoding == BITMAP and cols % 64 == 0:  # each row whole 8-byte words: read the bitmap, not a mask
        words = first[:rows * cols // 8].contiguous().view(torch.int64).view(rows, cols // 64)
        row_hit = words.ne(0).any(1)
        column_bytes = _or_rows(words).view(torch.uint8)  # byte j, bit b: column 8 j + b (little-endian)
        col_hit = (column_bytes.reshape(-1, 1) & _WEIGHTS).ne(0).view(-1)
    elif encoding == BITMAP:
        mask = bitmap_to_mask(first, rows * cols).view(rows, cols)
        row_hit, col_hit = mask.any(1), mask.any(0)
    else:
        return torch.arange(rows), torch.arange(cols)
    return row_hit.nonzero().view(-1), col_hit.nonzero().view(-1)


def _or_rows(t: torch.Tensor) -> torch.Tensor:
    """The bitwise OR of an integer tensor's rows (halving: about one read of ``t``)."""
    while t.shape[0] > 1:
        half = t.shape[0] // 2
        top = t[:half] | t[half:2 * half]
        if t.shape[0] % 2:
            top[0] |= t[-1]
        t = top
    return t[0]


def apply_bitmap(target: torch.Tensor, bitmap: torch.Tensor, values: torch.Tensor) -> None:
    """Write bit patterns ``values`` at the set bits of ``bitmap`` of ``target``, in index order (in place,
    on the target's device; a bool mask of one byte per element is the only scratch)."""
    flat = bits_view(target)
    mask = bitmap_to_mask(bitmap, flat.numel())
    flat.masked_scatter_(mask.to(target.device), values.to(target.device))
