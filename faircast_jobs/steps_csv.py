"""Reading a GRPO run's steps.csv: one row per (mode, seed, step), numbers parsed.

Its own module so that the report, the endpoints and the findings read the CSV the same way without
importing one another.
"""

from __future__ import annotations

import csv
import math

_BOOLS = {"True": 1.0, "False": 0.0}  # engine_weights_equal


def read_csv(path: str) -> list[dict]:
    """The rows of a steps.csv with numbers parsed (for re-plotting or re-tabulating a run)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key, value in row.items():
            if key != "mode":
                row[key] = _BOOLS[value] if value in _BOOLS else float(value) if value not in ("", "nan") else math.nan
    return rows
