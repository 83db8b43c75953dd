"""Error feedback's served bits in one bit per element (checkpoint format ``faircast-ds/3``).

Error feedback serves each finite master ``x`` one of its two bf16 neighbours (the rule clamps its result
between them: :mod:`faircast_ds.casting.rules`), so given ``x`` — which a load restores before Fair Cast's
state — the served pattern is ``(bits(x) >> 16) + b`` with ``b`` 0 or 1. A checkpoint keeps ``b`` packed
eight to a byte instead of the 16-bit pattern, and the load rebuilds the pattern from the restored master.

An element for which that does not hold (a non-finite master, or anything else the rule might serve) is
found when saving, by the same integer arithmetic the load uses, and kept whole as an **exception** (its
position and its 16-bit pattern), which the load writes over the rebuilt ones: the load gives back the
saved bits exactly whatever the values. The residual is kept as before (fp32, whole).
"""
from __future__ import annotations

import sys

import torch

CHUNK = 1 << 18  # elements per pass (a multiple of 8: chunks start on a byte of the packed bits); its
# temporaries, about 10 bytes an element, stay a few MiB (the save must not grow the peak by much: issue 23)
_SHIFTS = torch.arange(8, dtype=torch.uint8)


def nbytes(numel: int) -> int:
    """Bytes of packed neighbour bits for ``numel`` elements."""
    return (numel + 7) // 8


def encode(master: torch.Tensor, served: torch.Tensor, packed_out: torch.Tensor,
           chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack which neighbour each served element is into ``packed_out`` (uint8, ``nbytes(n)``, on the CPU)
    and return the exceptions: (positions (int64), their served patterns (int16))."""
    n = master.numel()
    assert chunk % 8 == 0
    where_list, bits_list = [], []
    for at in range(0, n, chunk):
        k = min(chunk, n - at)
        x = master.narrow(0, at, k)
        s = served.narrow(0, at, k).to(x.device).contiguous().view(torch.int16)
        step = torch.sub(s, _lower16(x))  # mod 2^16: 0 the lower neighbour, 1 the upper one
        bad = (step < 0) | (step > 1)
        where = torch.nonzero(bad).view(-1)
        if where.numel():
            where_list.append(where.cpu() + at)
            bits_list.append(s[where].cpu())
            step = step.masked_fill(bad, 0)
        flags = step.to(torch.uint8).cpu()
        pad = (-k) % 8
        if pad:
            flags = torch.cat([flags, torch.zeros(pad, dtype=torch.uint8)])
        packed = (flags.view(-1, 8) << _SHIFTS).sum(1, dtype=torch.uint8)
        packed_out.narrow(0, at // 8, packed.numel()).copy_(packed)
    if not where_list:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int16)
    return torch.cat(where_list), torch.cat(bits_list)


def served_bits_packed(master: torch.Tensor, packed: torch.Tensor, first: int) -> torch.Tensor:
    """The int16 patterns the flags of elements ``[first, first + numel)`` of a packed array name for
    ``master`` (exceptions not yet applied): each byte looks its eight flags up in a table, already as int16."""
    count = master.numel()
    if count == 0:
        return torch.zeros(0, dtype=torch.int16, device=master.device)
    lo, hi = first // 8, (first + count - 1) // 8 + 1
    table = _table(master.device)
    flags = table.index_select(0, packed.narrow(0, lo, hi - lo).to(master.device, torch.int64)).view(-1)
    return torch.add(_lower16(master), flags.narrow(0, first - 8 * lo, count))


_TABLES: dict[str, torch.Tensor] = {}


def _table(device: torch.device) -> torch.Tensor:
    """[256, 8] int16: the eight flags of every byte value, lowest bit first."""
    key = str(device)
    if key not in _TABLES:
        _TABLES[key] = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).to(device, torch.int16)
    return _TABLES[key]


def _lower16(master: torch.Tensor) -> torch.Tensor:
    """The lower neighbour's pattern of each fp32 master as int16: the master's upper half, read in place
    where the machine is little-endian."""
    flat = master.contiguous()
    if sys.byteorder == "little":
        return flat.view(torch.int16)[1::2]
    return (flat.view(torch.int32) >> 16).to(torch.int16)


def apply_exceptions(out16: torch.Tensor, positions: torch.Tensor, patterns: torch.Tensor) -> None:
    """Write the exceptions (positions relative to ``out16``) over rebuilt patterns."""
    if positions.numel():
        out16[positions.to(out16.device)] = patterns.to(out16.device)
