"""``python3 -m faircast_bench``: the casts alone, or ``--model`` for a real architecture under DeepSpeed."""
import sys

from faircast_bench.casts import main

sys.exit(main())
