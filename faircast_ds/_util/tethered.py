"""Run a command that does not outlive the process that started it.

    python -m faircast_ds._util.tethered PARENT_PID -- COMMAND [ARGS...]

A server started in its own session (so that one ``killpg`` stops it and everything it spawns) is not
stopped when its starter is killed outright: a trainer rank killed for memory left its ``vllm serve`` running,
holding gigabytes, and the job's retry was killed for memory in turn. Started through this module as the
session's leader, the command runs as a child in the same process group; when ``PARENT_PID`` is gone (the
starter died, whatever killed it) the whole group gets SIGTERM, then SIGKILL after ``GRACE`` seconds.

A SIGTERM or SIGINT sent to the group (a normal stop) reaches the command directly; this process then waits for
it and exits the way it did (the same code, or killed by the same signal), so the starter sees the command's
own exit status. The parent is polled every ``POLL`` seconds: no signal from the kernel is needed (Linux's
parent-death signal follows the starting *thread*, and servers are started from threads).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL = 0.5
GRACE = 20.0


def alive(pid: int) -> bool:
    """Whether ``pid`` still exists (a zombie counts as gone: it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _exit_like(code: int) -> None:
    if code < 0:  # killed by a signal: die of the same one
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def _stop_group() -> None:
    for sig, wait in ((signal.SIGTERM, GRACE), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(0, sig) if sig == signal.SIGKILL else _signal_others(sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _others():
            time.sleep(0.2)


def _others() -> list[int]:
    """The other live processes of this process group."""
    me, group = os.getpid(), os.getpgrp()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == group:
            out.append(int(entry))
    return out


def _signal_others(sig: int) -> None:
    for pid in _others():
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        sys.exit("usage: python -m faircast_ds._util.tethered PARENT_PID -- COMMAND [ARGS...]")
    parent, command = int(argv[0]), argv[2:]
    stopping = {"signal": None}

    def on_stop(sig: int, _frame) -> None:  # the group was told to stop: the command got it too
        stopping["signal"] = sig

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    child = subprocess.Popen(command)
    while True:
        code = child.poll()
        if code is not None:
            if stopping["signal"] is None:
                _signal_others(signal.SIGTERM)  # what the command left running in the group
            _exit_like(code)
        if not alive(parent):
            print(f"[tethered] parent {parent} is gone: stopping {command[0]} and its process group",
                  file=sys.stderr, flush=True)
            _stop_group()
            _exit_like(child.wait())
        time.sleep(POLL)


if __name__ == "__main__":
    main()
