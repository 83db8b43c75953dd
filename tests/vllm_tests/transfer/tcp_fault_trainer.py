"""tests/dist/fault_trainer.py with the TCP route named (same arguments): its pauses hold the TCP route's
sender (``WeightSender._send``, vLLM's HTTP client's finish), while ``ServedPush``'s default plane is the
fastest that works (shm on this host, with the secret the fault tests set)."""
from __future__ import annotations

import functools
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from faircast_ds.vllm.transfer.served_push import ServedPush  # noqa: E402

ServedPush.__init__ = functools.partialmethod(ServedPush.__init__, plane="tcp")
sys.argv[0] = str(ROOT / "tests" / "dist" / "fault_trainer.py")
runpy.run_path(sys.argv[0], run_name="__main__")
