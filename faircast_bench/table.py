"""Plain-text tables for the benchmarks' reports: columns padded to their widest cell, a ruler under the head."""

from __future__ import annotations


def columns(lines: list[tuple[str, ...]]) -> list[str]:
    """Rows as left-aligned columns, a ruler under the first (the head)."""
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in lines]
    table.insert(1, "  ".join("-" * w for w in widths))
    return table
