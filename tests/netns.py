"""Two hosts on one machine for the tests (tests/system/test_multinode.py: DeepSpeed launches across the
hosts; tests/vllm_tests/transfer/test_data_plane.py: the net plane's ranks and engine on different hosts). The
namespaces themselves are made by :mod:`faircast_bench.hosts` (the benchmarks use them too)."""
from __future__ import annotations

import pytest

from faircast_bench.hosts import (IFNAME, PREFIX, TwoHosts, available, clean_leftovers, ip,  # noqa: F401
                                           our_names, owner_alive, remove_netns)


def need_netns() -> None:
    if not available():
        pytest.skip("network namespaces need root and iproute2")
