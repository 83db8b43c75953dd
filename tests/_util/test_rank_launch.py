"""tests/conftest.py's rank launcher (``start_ranks``, ``supervise``), which starts most test workers: each rank gets
the environment DeepSpeed's launcher gives it, and the first rank to fail takes the others down and gives the
launch its code, as the `deepspeed` runner does."""
from __future__ import annotations

import json
import time

import pytest
from conftest import start_ranks, supervise

RANK_SCRIPT = '''
import json, os, sys, time
rank = int(os.environ["RANK"])
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES")
with open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], **{k: os.environ[k] for k in keys}}, f)
if os.environ.get("FAIL_RANK") == str(rank):
    time.sleep(0.5)
    sys.exit(3)
time.sleep(float(os.environ.get("SLEEP", "0")))
'''


def launch(tmp_path, ranks: int, timeout: float = 60, **env: str) -> tuple[int, float, str]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    began = time.monotonic()
    with open(tmp_path / "launch.log", "w") as log:
        code = supervise(start_ranks(script, ranks, 29999, ["--x", "1"], log, {"OUT_DIR": str(tmp_path), **env}), log,
                         timeout)
    return code, time.monotonic() - began, (tmp_path / "launch.log").read_text()


def test_each_rank_gets_the_launchers_environment_and_arguments(tmp_path):
    code, _, log = launch(tmp_path, 3)
    assert code == 0
    for rank in range(3):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {"argv": [f"--local_rank={rank}", "--x", "1"], "RANK": str(rank), "LOCAL_RANK": str(rank),
                        "WORLD_SIZE": "3", "LOCAL_SIZE": "3", "CROSS_RANK": "0", "CROSS_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "CUDA_VISIBLE_DEVICES": "0,1,2"}
        assert f"rank {rank} (pid" in log and "exits with return code = 0" in log


def test_the_first_failing_rank_takes_the_others_down_and_gives_its_code(tmp_path):
    code, took, log = launch(tmp_path, 2, FAIL_RANK="1", SLEEP="120")  # rank 0 would sleep 2 minutes
    assert code == 3 and took < 30, (code, took)
    assert "rank 1" in log and "exits with return code = 3" in log
    assert "exits with return code = -9" in log  # rank 0, killed


def test_a_launch_past_its_timeout_is_killed_and_raises(tmp_path):
    import subprocess

    with pytest.raises(subprocess.TimeoutExpired):
        launch(tmp_path, 2, timeout=2, SLEEP="120")

