"""ZeRO-1/2 and BF16_Optimizer on the runtime route: the cast takes the place of DeepSpeed's own copy of
the fp32 partition into the bf16 one, inside ``step()``. One 2-rank launch (tests/dist/copy_site_worker.py):

- each group's partition is written once per step, by the cast: DeepSpeed's copy runs as a copy of a
  tensor onto itself; with CPU offload the cast writes DeepSpeed's pinned buffer, and DeepSpeed's one
  copy takes it to the served partition;
- the served bits are the oracle's (``faircast_ds.casting.reference``), and the change count is the number of
  served bits that differ from those served before the step (taken in the same pass, against the bits
  the cast overwrites);
- a release whose step no longer reaches the wrapped copy site is stopped by the guard.
"""
from __future__ import annotations

import json

import pytest

from conftest import DIST, deepspeed_launch

pytestmark = pytest.mark.slow
CASES = ("zero2/dither", "zero2+offload/dither", "zero1/dither", "bf16_optimizer/dither", "zero2/error_feedback")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("copy_site")
    deepspeed_launch(DIST / "copy_site_worker.py", 2, out)
    return [json.loads((out / f"copy_site_rank{r}.json").read_text()) for r in (0, 1)]


def cases(ranks, name):
    for report in ranks:
        assert name not in report["errors"], report["errors"][name]
        yield report["cases"][name]


@pytest.mark.parametrize("name", CASES)
def test_each_partition_is_written_once_by_the_cast(ranks, name):
    for c in cases(ranks, name):
        staged = {int(k) for k, v in c["offload_staging"].items() if v}
        for s in c["steps"]:
            # one cast per group, into what DeepSpeed's copy writes: the pinned buffer with offload, else the partition
            assert sorted(x["key"] for x in s["casts"]) == sorted(c["groups"]), s["casts"]
            for x in s["casts"]:
                assert x["into"] == ("staging" if x["key"] in staged else "served"), s["casts"]
            real = [w for w in s["writes"] if not w["noop"]]
            noops = [w for w in s["writes"] if w["noop"]]
            # DeepSpeed's copy of each group still runs, onto itself (the master's without offload, else the buffer's)
            assert sorted(w["into"] for w in noops) == sorted(
                f"staging{k}" if k in staged else f"master{k}" for k in c["groups"]), s["writes"]
            # and nothing else writes the partition, but DeepSpeed's one copy of the pinned buffer to it; the
            # buffer is refreshed from the partition once, in the first step after something else wrote that
            # (here: the cast at initialize), for the change count
            want = sorted([(f"served{k}", f"staging{k}") for k in staged]
                          + [(f"staging{k}", f"served{k}") for k in staged if s["step"] == 1])
            assert sorted((w["into"], w["from"]) for w in real) == want, s["writes"]


@pytest.mark.parametrize("name", CASES)
def test_served_bits_are_the_cast_and_the_count_is_what_changed(ranks, name):
    for c in cases(ranks, name):
        assert [s["step"] for s in c["steps"]] == [1, 2, 3]
        for s in c["steps"]:
            assert s["oracle_mismatches"] == 0, s["step"]
            assert s["stats_changed"] == s["observed_changed"], s
            assert s["observed_changed"] > 0
        assert c["guard_steps_checked"] == 3


def test_a_moved_copy_site_is_stopped_by_the_guard(ranks):
    for report in ranks:
        moved = report["moved_site"]
        assert moved["raised"], moved
        assert "ran without Fair Cast's cast" in moved["message"] and "DeepSpeed" in moved["message"]
