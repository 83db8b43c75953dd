"""_util/tethered.py: a command started through it stops with its starter, whatever kills the starter, and
otherwise exits as the command did. Real processes; the oracle is /proc (which processes of the group live)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

TETHER = [sys.executable, "-m", "faircast_ds._util.tethered"]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def group_members(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                out.append(int(entry))
    return out


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_the_command_stops_when_its_starter_is_killed():
    """A starter (standing in for a trainer rank) starts a sleeper through the tether in a new session, from
    a thread, and is SIGKILLed: the sleeper's whole process group is gone soon after."""
    starter = textwrap.dedent(f"""
        import os, subprocess, sys, threading, time
        box = {{}}
        def start():
            box["p"] = subprocess.Popen({TETHER!r} + [str(os.getpid()), "--"] + {SLEEPER!r}, start_new_session=True)
        t = threading.Thread(target=start); t.start(); t.join()
        print(box["p"].pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    leader = int(proc.stdout.readline())
    try:
        assert wait_until(lambda: len(group_members(leader)) == 2, 20), "the tether and its command run"
        time.sleep(1.0)  # the starting thread is long gone: the command must still be running
        assert len(group_members(leader)) == 2
        proc.kill()
        proc.wait()
        assert wait_until(lambda: not group_members(leader), 30), f"left running: {group_members(leader)}"
    finally:
        for pid in group_members(leader):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("code", [0, 3])
def test_the_starter_sees_the_commands_exit_code(code):
    p = subprocess.run(TETHER + [str(os.getpid()), "--", sys.executable, "-c", f"import sys; sys.exit({code})"],
                       start_new_session=True, timeout=60)
    assert p.returncode == code


def test_a_stop_sent_to_the_group_ends_as_the_command_ended():
    p = subprocess.Popen(TETHER + [str(os.getpid()), "--"] + SLEEPER, start_new_session=True)
    assert wait_until(lambda: len(group_members(p.pid)) == 2, 20)
    os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(30) == -signal.SIGTERM
    assert wait_until(lambda: not group_members(p.pid), 10)


def test_bad_usage_is_named():
    p = subprocess.run(TETHER + ["notapid", "--", "true"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "usage: python -m faircast_ds._util.tethered" in p.stderr
