"""A stand-in for pdsh, for tests: DeepSpeed's default multi-node launcher runs
``pdsh -S -f FANOUT -w host1,host2 COMMAND...`` and relies on ssh to start COMMAND on every host.
Here every host is a network namespace on this machine (FAKE_PDSH_NETNS="host1=netns1,host2=netns2"):
COMMAND runs in a fresh environment, as over ssh, inside that namespace and a UTS namespace named
after the host, with pdsh's ``%n`` (the host's index in -w) substituted, output prefixed "host: ".
Exit status: the largest of the hosts' (pdsh -S).

What it does not test: ssh itself, pdsh's fan-out, remote file systems.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading


def parse(argv: list[str]) -> tuple[list[str], str]:
    hosts: list[str] = []
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        flag = argv[i]
        if flag == "-S":
            i += 1
        elif flag in ("-f", "-w"):
            if flag == "-w":
                hosts = argv[i + 1].split(",")
            i += 2
        else:
            raise SystemExit(f"multinode_pdsh: unsupported option {flag}")
    return hosts, " ".join(argv[i:])


def relay(host: str, stream) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(host.encode() + b": " + line)
        sys.stdout.buffer.flush()


def main() -> int:
    hosts, command = parse(sys.argv[1:])
    netns = dict(item.split("=", 1) for item in os.environ["FAKE_PDSH_NETNS"].split(","))
    login_env = {k: os.environ[k] for k in ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG") if k in os.environ}
    procs, relays = [], []
    for index, host in enumerate(hosts):
        remote = command.replace("%n", str(index))
        argv = ["ip", "netns", "exec", netns[host], "unshare", "--uts", "bash", "-c",
                f"hostname {shlex.quote(host)} && exec bash -c {shlex.quote(remote)}"]
        proc = subprocess.Popen(argv, env=login_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        procs.append(proc)
        relays.append(threading.Thread(target=relay, args=(host, proc.stdout), daemon=True))
        relays[-1].start()
    codes = [p.wait() for p in procs]  # the caller bounds the whole job
    for t in relays:
        t.join(timeout=5)
    return max((c if c >= 0 else 128 - c) for c in codes)


if __name__ == "__main__":
    sys.exit(main())
