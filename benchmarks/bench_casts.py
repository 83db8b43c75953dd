"""Cost of the fp32 -> bf16 casts against a plain bf16.copy_ of the same tensor, eager and fused.

    python benchmarks/bench_casts.py [--quick] [--threads N] [--no-eager] [--json PATH]

The same as ``faircast-ds bench`` (the code is faircast_ds/tools/bench/casts.py); measured tables are
kept in benchmarks/results/.
"""
from __future__ import annotations

import sys

from faircast_ds.tools.bench.casts import main

if __name__ == "__main__":
    sys.exit(main())
