"""Two hosts on one machine: network namespaces joined by a veth pair, with addresses of their own.
Used by the benchmark's cross-host push row (``python3 -m faircast_bench --model ... --push-planes netns``),
benchmarks/data_plane.py, and the tests (tests/netns.py: the multi-node launches and the net plane across
hosts). Only the namespaces, links and addresses made here are touched, and every user removes them (a
context manager). Needs root and iproute2 (:func:`available`)."""
from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import time

from faircast_ds.export.atomic import pid_alive

PREFIX = "fcmn"  # every namespace and link made here starts with it
IFNAME = "fcnet0"  # the veth end's name inside either namespace (names are per namespace)
_serial = itertools.count()


def ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def our_names() -> tuple[list[str], list[str]]:
    """Namespaces and links (in this namespace) named here, whoever made them."""
    netns = [line.split()[0] for line in ip("netns", "list").splitlines() if line.startswith(PREFIX + "-")]
    links = re.findall(rf"^\d+: ({PREFIX}[0-9a-f]+[ab])[@:]", ip("-o", "link", "show"), flags=re.M)
    return netns, links


def owner_alive(tag: str) -> bool:
    """Whether the process that made the names with ``tag`` (its pid is in it) still runs."""
    return pid_alive(int(tag, 16) >> 8)


def remove_netns(name: str) -> None:
    """Kill what runs inside (started by whoever made it here), then delete the namespace."""
    for _ in range(50):
        pids = [int(p) for p in ip("netns", "pids", name, check=False).split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    ip("netns", "del", name, check=False)


def clean_leftovers() -> list[str]:
    """Remove namespaces and links that a crashed earlier run left, never those of a live run;
    return their names."""
    netns, links = our_names()
    removed = []
    for name in netns:
        if not owner_alive(name.split("-")[1]):
            remove_netns(name)
            removed.append(name)
    for link in links:
        if not owner_alive(link[len(PREFIX):-1]):
            ip("link", "del", link, check=False)  # fails harmlessly for a veth end already gone with its peer
            removed.append(link)
    return removed


class TwoHosts:
    """worker-1 and worker-2 (the hosts of configs/hostfile.example) as network namespaces with
    10.231.S.1 and 10.231.S.2 on a veth pair and `lo` up. A context manager: always removed."""

    HOSTS = ("worker-1", "worker-2")

    def __init__(self) -> None:
        serial = next(_serial) & 0xFF
        self.tag = f"{(os.getpid() << 8) | serial:08x}"  # the owner's pid is in every name
        self.netns = {h: f"{PREFIX}-{self.tag}-{side}" for h, side in zip(self.HOSTS, "ab")}
        self.links = {h: f"{PREFIX}{self.tag}{side}" for h, side in zip(self.HOSTS, "ab")}
        self.addr = {h: f"10.231.{serial}.{i}" for i, h in enumerate(self.HOSTS, start=1)}

    def __enter__(self) -> "TwoHosts":
        try:
            a, b = self.HOSTS
            for h in self.HOSTS:
                ip("netns", "add", self.netns[h])
            ip("link", "add", self.links[a], "type", "veth", "peer", "name", self.links[b])
            for h in self.HOSTS:
                ns = self.netns[h]
                ip("link", "set", self.links[h], "netns", ns)
                ip("-n", ns, "link", "set", self.links[h], "name", IFNAME)
                ip("-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", IFNAME)
                ip("-n", ns, "link", "set", "lo", "up")
                ip("-n", ns, "link", "set", IFNAME, "up")
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for h in self.HOSTS:
            remove_netns(self.netns[h])  # deleting a namespace deletes the veth end inside it
            ip("link", "del", self.links[h], check=False)  # an end that never moved in

    def left(self) -> list[str]:
        netns, links = our_names()
        return [n for n in netns + links if self.tag in n]


def available() -> bool:
    """Whether this process can make namespaces (root, and iproute2's ``ip``)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None
