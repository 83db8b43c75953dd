"""Export and weight sync without DeepSpeed: the safetensors writer, delta encodings, atomic
publication under SIGKILL, and the sync channel's refusals and failure handling with real sender
processes that are killed or stalled mid-update. (DeepSpeed runs: tests/export/test_export_zero.py; the
channel's authentication and hostile input: tests/export/test_sync_security.py.)"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import DIST, ROOT, cpu_env
from torch.utils._python_dispatch import TorchDispatchMode

from faircast_ds.export import WeightReceiver, WeightSender, WeightSyncError, atomic, delta
from faircast_ds.export.channel import connect
from faircast_ds.export.safetensors_stream import (
    SafetensorsFile,
    TensorEntry,
    plan_shards,
    read_header,
    read_tensor,
    shard_file_names,
)
from faircast_ds.export.sync import PROTOCOL, SyncAborted, spec_list

sys.path.insert(0, str(DIST))
from export_common import digest, plain_model  # noqa: E402

# ---------------------------------------------------------------- safetensors writer

def test_streamed_safetensors_match_the_reference_reader(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "b.f32": torch.randn(7, generator=g),
        "c.i64": torch.arange(6).reshape(2, 3),
        "d.scalar": torch.tensor(2.5, dtype=torch.float16),
        "e.empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "f.bool": torch.tensor([True, False, True]),
    }
    tensors["a.bf16"][0, 0] = float("nan")
    tensors["a.bf16"][0, 1] = -0.0
    entries = [TensorEntry(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    path = str(tmp_path / "x.safetensors")
    f = SafetensorsFile(path, entries, metadata={"faircast_version": "7"})
    for n, t in tensors.items():
        f.write(n, t)
    f.close()
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for n, t in tensors.items():
        assert loaded[n].dtype == t.dtype and loaded[n].shape == t.shape
        assert torch.equal(loaded[n].view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), n
    with safe_open(path, "pt") as sf:
        assert sf.metadata() == {"format": "pt", "faircast_version": "7"}
    start, header = read_header(path)
    assert start % 8 == 0
    for n, t in tensors.items():
        assert torch.equal(read_tensor(path, start, header[n]).reshape(-1).view(torch.uint8),
                           t.reshape(-1).view(torch.uint8))
    assert f.sha256 == hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_writer_refuses_out_of_order_and_incomplete_files(tmp_path):
    entries = [TensorEntry("a", (2,), torch.float32), TensorEntry("b", (2,), torch.float32)]
    f = SafetensorsFile(str(tmp_path / "x.safetensors"), entries)
    with pytest.raises(ValueError, match="expected a"):
        f.write("b", torch.zeros(2))
    with pytest.raises(ValueError, match="expected a \\[2\\] torch.float32"):
        f.write("a", torch.zeros(3))
    f.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="1 tensors never written, first 'b'"):
        f.close()


def test_shards_follow_order_and_size():
    entries = [TensorEntry(str(i), (n,), torch.bfloat16) for i, n in enumerate([10, 10, 30, 5, 5])]
    shards = plan_shards(entries, max_shard_bytes=40)
    assert [[e.name for e in s] for s in shards] == [["0", "1"], ["2"], ["3", "4"]]
    assert shard_file_names(3) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert shard_file_names(1) == ["model.safetensors"]


# ---------------------------------------------------------------- delta encodings

def test_changed_compares_bit_patterns():
    before = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16)
    after = torch.tensor([-0.0, 1.0, float("nan"), 2.015625], dtype=torch.bfloat16)
    assert delta.changed(before, after).tolist() == [0, 3]  # -0.0 is a change, the same NaN is not


@pytest.mark.parametrize("density", (0.0005, 0.01, 0.2, 1.0))
def test_sparse_encodings_round_trip(density):
    g = torch.Generator().manual_seed(1)
    numel = 10_003
    before = torch.randn(numel, generator=g).to(torch.bfloat16)
    after = before.clone()
    mask = torch.rand(numel, generator=g) < density
    after[mask] = torch.randn(int(mask.sum()), generator=g).to(torch.bfloat16)
    idx = delta.changed(before, after)
    vals = delta.bits_view(after)[idx]
    for encoding in (delta.COO, delta.BITMAP):
        target = before.clone()
        decoded = idx if encoding == delta.COO else delta.unpack_bits(delta.pack_bits(idx, numel), numel)
        delta.check_indices(decoded, numel)
        delta.apply(target, decoded, vals)
        assert torch.equal(delta.bits_view(target), delta.bits_view(after))
    chosen = delta.choose(numel, idx.numel(), 2)
    cheaper = min(delta.encoded_bytes(e, numel, idx.numel(), 2) for e in (delta.COO, delta.BITMAP))
    assert delta.encoded_bytes(chosen, numel, idx.numel(), 2) == cheaper
    # COO: 6 bytes per change; the bitmap wins above 1/32 of the elements changed
    assert chosen == (delta.BITMAP if idx.numel() * 4 > (numel + 7) // 8 else delta.COO)


@pytest.mark.parametrize("numel,width", [(1, None), (8, None), (13, None), (10_003, None), (13, 4), (0, 2)])
def test_the_one_bitmap_codec_matches_numpys_little_endian_packbits(numel, width):
    import numpy as np

    mask = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) < 0.3
    want = np.packbits(mask.numpy().astype(np.uint8), bitorder="little")  # the oracle: numpy, not our code
    if width is not None:
        want = np.concatenate([want, np.zeros(width - want.size, dtype=np.uint8)])
    got = delta.mask_to_bitmap(mask, width)
    assert got.dtype == torch.uint8 and got.numpy().tobytes() == want.tobytes()
    assert torch.equal(delta.bitmap_to_mask(got, numel), mask)
    if numel:
        assert torch.equal(delta.pack_bits(mask.nonzero().view(-1), numel), got[:(numel + 7) // 8])
    with pytest.raises(ValueError, match="cannot hold"):
        delta.mask_to_bitmap(torch.ones(17, dtype=torch.bool), 2)


def test_malformed_indices_are_rejected():
    with pytest.raises(ValueError, match="out of range"):
        delta.check_indices(torch.tensor([1, 10]), 10)
    with pytest.raises(ValueError, match="strictly increasing"):
        delta.check_indices(torch.tensor([3, 3]), 10)
    bitmap = delta.pack_bits(torch.tensor([1, 9]), 16)
    with pytest.raises(ValueError, match="past the end"):
        delta.unpack_bits(bitmap, 9)


# ---------------------------------------------------------------- atomic export under SIGKILL

class Proc:
    """A child process whose stdout lines are read by a thread, so every wait is bounded."""

    def __init__(self, args: list[str]) -> None:
        self.p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=cpu_env(), cwd=ROOT)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, token: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.p.poll() is not None and self.lines.empty():
                    break
                continue
            self.seen.append(line)
            if token in line:
                return line
        self.kill()
        raise AssertionError(f"no {token!r} from the child within {timeout}s; output:\n" + "\n".join(self.seen[-40:]))

    def json_lines(self) -> list[dict]:
        self.finish()
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return [json.loads(line) for line in self.seen if line.startswith("{")]

    def finish(self, timeout: float = 60) -> int:
        try:
            return self.p.wait(timeout=timeout)
        finally:
            self.kill()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.p.poll() is None:
            self.p.send_signal(sig)
            if sig == signal.SIGKILL:
                self.p.wait(timeout=10)


@pytest.fixture
def procs():
    started: list[Proc] = []

    def start(script: str, *args: str) -> Proc:
        proc = Proc([str(DIST / script), *args])
        started.append(proc)
        return proc

    yield start
    for proc in started:  # never leave a child behind
        proc.kill()


def snapshot(target: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(target.iterdir())}


def beside(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p.name != target.name)


def write_export(procs, target: Path, seed: int, pause: str = "none") -> Proc:
    proc = procs("export_writer.py", str(target), "--seed", str(seed), "--pause", pause)
    if pause == "none":
        proc.wait_for("DONE")
        assert proc.finish() == 0
    else:
        proc.wait_for("PAUSED")
        proc.kill(signal.SIGKILL)  # the writer dies mid-write, without warning
    return proc


def test_a_killed_writer_never_leaves_a_half_written_export(tmp_path, procs):
    target = tmp_path / "exports" / "policy"
    write_export(procs, target, seed=1, pause="data")  # the very first export dies: nothing is published
    assert not target.exists()
    assert beside(target) and all(n.startswith(".policy.tmp-") for n in beside(target))

    write_export(procs, target, seed=1)  # a complete export; the dead writer's leftovers are cleaned
    assert beside(target) == []
    first = snapshot(target)
    manifest = json.loads((target / "faircast_export.json").read_text())
    assert manifest["version"] == 1 and len(manifest["files"]) >= 2
    assert {f: m["sha256"] for f, m in manifest["files"].items()} == {f: first[f] for f in manifest["files"]}

    for pause in ("data", "publish"):  # killed while writing weights, and after the last fsync before the rename
        write_export(procs, target, seed=2, pause=pause)
        assert snapshot(target) == first, f"killed at {pause}: the previous export changed"
        (left,) = beside(target)
        partial = set(os.listdir(target.parent / left))
        if pause == "data":  # really killed mid-write: a second weight file started, no manifest yet
            assert any("-00002-of-" in f for f in partial) and "faircast_export.json" not in partial
        else:
            assert set(first) == partial
        atomic.remove_stale(target)

    from safetensors.torch import load_file

    loaded = {}
    for f in sorted(target.glob("*.safetensors")):
        loaded.update(load_file(f))
    model = plain_model(seed=1)
    assert digest((n, loaded[n]) for n, _ in model.named_parameters()) == digest(model.named_parameters())

    write_export(procs, target, seed=3)
    assert json.loads((target / "faircast_export.json").read_text())["version"] == 3
    assert beside(target) == []


def test_without_an_atomic_exchange_the_previous_version_survives_a_crash(tmp_path, monkeypatch):
    target = tmp_path / "policy"
    for version in ("v1", "v2"):
        with atomic.AtomicDirectory(target) as d:
            (d / "weights").write_text(version)
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)  # the move-aside path from now on
    assert (target / "weights").read_text() == "v2" and beside(target) == []
    # a writer that died between moving the old version aside and renaming the new one in
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    aside = tmp_path / f".policy.old-{dead.pid}-x"
    aside.mkdir()
    os.rename(target, aside / "previous")
    assert not target.exists()
    atomic.remove_stale(target)  # what the next writer does first
    assert (target / "weights").read_text() == "v2" and beside(target) == []


def test_a_failed_export_raises_and_publishes_nothing(tmp_path, monkeypatch):
    from faircast_ds.export import ExportError, safetensors_stream, save_hf

    target = tmp_path / "policy"
    save_hf(plain_model(seed=1), target, version=1)
    before = snapshot(target)
    write = safetensors_stream.SafetensorsFile.write
    calls = []

    def failing_write(self, name, tensor):
        calls.append(name)
        if len(calls) == 4:
            raise OSError(28, "No space left on device")
        write(self, name, tensor)

    monkeypatch.setattr(safetensors_stream.SafetensorsFile, "write", failing_write)
    with pytest.raises(ExportError, match="nothing was published: writing 2.weight: .*No space left on device"):
        save_hf(plain_model(seed=2), target, version=2)
    assert snapshot(target) == before and beside(target) == []


# ---------------------------------------------------------------- weight sync: refusals and failures

def tiny(seed: int = 0, **kw) -> torch.nn.Module:
    return plain_model(seed=seed, **kw)


class Serving:
    """A receiver's accept/receive loop in a thread; outcomes and exceptions are recorded, every wait
    bounded."""

    def __init__(self, rx: WeightReceiver, sessions: int = 1, accept_timeout: float = 60, idle: float = 60) -> None:
        self.rx, self.events = rx, []
        self.thread = threading.Thread(target=self._run, args=(sessions, accept_timeout, idle), daemon=True)
        self.thread.start()

    def _run(self, sessions: int, accept_timeout: float, idle: float) -> None:
        for _ in range(sessions):
            try:
                self.rx.accept(timeout=accept_timeout)
                while (report := self.rx.receive(timeout=idle)) is not None:
                    self.events.append(report)
                self.events.append("closed")
            except WeightSyncError as exc:
                self.events.append((exc, time.monotonic()))

    def join(self, timeout: float = 60) -> list:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the receiver hung"
        return self.events


@pytest.fixture
def receiver():
    made = []

    def make(model=None, **kw) -> WeightReceiver:
        rx = WeightReceiver(model if model is not None else tiny(seed=99), host="127.0.0.1", port=0, **kw)
        made.append(rx)
        return rx

    yield make
    for rx in made:
        rx.close()


def test_mismatched_sender_process_is_refused_with_a_clear_error(receiver, procs):
    rx = receiver(timeout=30)
    before = digest(rx.targets.items())
    serving = Serving(rx)
    sender = procs("export_sender.py", "--port", str(rx.port), "--intermediate", "48")
    assert sender.finish() == 3
    (error,) = [line["error"] for line in sender.json_lines()]
    (event,) = serving.join()
    exc = event[0]
    assert type(exc) is WeightSyncError and "model mismatch" in str(exc)
    for message in (error, str(exc)):  # both sides name the parameters and both shapes
        assert "2.weight: sender [48, 32] torch.bfloat16, receiver [64, 32] torch.bfloat16" in message
    assert "refused this sender" in error
    assert rx.version is None and digest(rx.targets.items()) == before


def test_dtype_and_protocol_mismatches_are_refused(receiver):
    rx = receiver(model=tiny(seed=99).float(), timeout=30)
    serving = Serving(rx, sessions=2)
    with pytest.raises(WeightSyncError, match="0.weight: sender \\[101, 32\\] torch.bfloat16, receiver "
                                              "\\[101, 32\\] torch.float32"):
        WeightSender(tiny(), port=rx.port, timeout=30).sync(version=1)
    channel = connect("127.0.0.1", rx.port, timeout=30)
    channel.send_json({"type": "hello", "protocol": PROTOCOL + 1, "params": spec_list(rx.specs)})
    reply = channel.recv_json()
    channel.close()
    assert not reply["ok"] and "protocol mismatch" in reply["error"]
    assert [type(e[0]) for e in serving.join()] == [WeightSyncError, WeightSyncError]


def test_versions_must_not_go_back(receiver):
    rx = receiver(timeout=30)
    serving = Serving(rx, sessions=3)
    model = tiny()
    sender = WeightSender(model, port=rx.port, timeout=30)
    sender.sync(version=5)
    with pytest.raises(WeightSyncError, match="versions must not decrease within a session"):
        sender.sync(version=4)
    stale = WeightSender(model, port=rx.port, timeout=30)  # e.g. an old trainer process still running
    with pytest.raises(WeightSyncError, match="update version 3 is older than the weights served \\(version 5\\); "
                                              "a stale sender"):
        stale.sync(version=3)
    rx.allow_rollback = True  # a trainer resumed from an earlier checkpoint, on purpose
    resumed = WeightSender(model, port=rx.port, timeout=30)
    assert resumed.sync(version=3).kind == "dense"
    resumed.close()
    events = serving.join()
    assert rx.version == 3 and events[-1] == "closed"


def raw_session(rx: WeightReceiver):
    channel = connect("127.0.0.1", rx.port, timeout=30)
    channel.send_json({"type": "hello", "protocol": PROTOCOL, "params": spec_list(rx.specs)})
    assert channel.recv_json()["ok"]
    return channel


def test_delta_against_other_weights_and_incomplete_updates_are_refused_whole(receiver):
    rx = receiver(timeout=30)
    serving = Serving(rx, sessions=2)
    before = digest(rx.targets.items())
    channel = raw_session(rx)
    channel.send_json({"type": "update", "kind": "delta", "version": 2, "base": 1})
    reply = channel.recv_json()
    assert not reply["ok"] and "delta against version 1 but this receiver serves version None" in reply["error"]
    channel.close()
    channel = raw_session(rx)  # a dense update that ends after 3 of 14 parameters
    channel.send_json({"type": "update", "kind": "dense", "version": 2, "base": None})
    assert channel.recv_json()["ok"]
    for index, (name, t) in enumerate(list(tiny(seed=4).named_parameters())[:3]):
        channel.send_tensor(torch.tensor([index, delta.DENSE, t.numel()]))
        channel.send_tensor(delta.bits_view(t.data))
    channel.send_tensor(torch.tensor([-1, 0, 3]))
    ack = channel.recv_json()
    channel.close()
    assert not ack["ok"] and "without ['2.weight'" in ack["error"]
    events = serving.join()
    assert "missing 11 parameter(s)" in str(events[-1][0])
    assert rx.version is None and digest(rx.targets.items()) == before  # nothing of it was applied


def test_a_second_sender_is_refused_while_one_is_connected(receiver):
    rx = receiver(timeout=30)
    serving = Serving(rx)
    first = WeightSender(tiny(), port=rx.port, timeout=30)
    first.sync(version=1)
    with pytest.raises(WeightSyncError, match="already serving another sender"):
        WeightSender(tiny(), port=rx.port, timeout=30).sync(version=2)
    first.close()
    assert serving.join()[-1] == "closed"


def listening_addresses(pid: int) -> set[str]:
    """Local addresses of the TCP sockets process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                addr = fields[1].split(":")[0]
                raw = bytes.fromhex(addr)[::-1] if table == "tcp" else bytes.fromhex(addr)
                found.add(".".join(map(str, raw)) if table == "tcp" else addr)
    return found


def test_the_channel_listens_on_loopback_only(receiver):
    rx = receiver(timeout=30)
    serving = Serving(rx)
    sender = WeightSender(tiny(), port=rx.port, timeout=30)
    sender.sync(version=1)  # both ends live in this process: the receiver's socket is the only listener
    addresses = listening_addresses(os.getpid())
    sender.close()
    serving.join()
    assert addresses == {"127.0.0.1"}


def test_sender_killed_mid_update_leaves_the_previous_weights_and_a_new_sender_recovers(receiver, procs):
    rx = receiver(timeout=30)
    serving = Serving(rx, sessions=2)
    sender = procs("export_sender.py", "--port", str(rx.port), "--versions", "1,2", "--pause-in", "2")
    v1 = json.loads(sender.wait_for('"version": 1'))
    sender.wait_for("PAUSED")  # version 2 is on the wire, 5 parameters sent
    sender.kill(signal.SIGKILL)
    deadline = time.monotonic() + 300  # a liveness limit only: what ended the session is read from the error
    while not serving.events or not isinstance(serving.events[-1], tuple):
        assert time.monotonic() < deadline, "the receiver did not notice the dead sender"
        time.sleep(0.05)
    exc, _ = serving.events[-1]
    assert isinstance(exc, SyncAborted) and "mid-update (version 2, 5 of" in str(exc)
    # detected by the broken connection, not by the receiver's 30 s timeout ("went silent for 30.0s")
    assert re.search(r"closed the connection|reset by peer", str(exc)) and "went silent" not in str(exc), str(exc)
    assert rx.version == 1 and "update was discarded" in rx.last_error
    assert digest(rx.targets.items()) == v1["digest"], "the receiver's weights changed"
    assert v1["kind"] == "dense"
    # the restarted trainer connects to the same receiver and delivers
    again = procs("export_sender.py", "--port", str(rx.port), "--versions", "3,4", "--seed", "5")
    assert again.finish() == 0
    lines = again.json_lines()
    assert [(x["version"], x["kind"]) for x in lines] == [(3, "dense"), (4, "delta")]
    serving.join()
    assert rx.version == 4 and digest(rx.targets.items()) == lines[-1]["digest"]


def test_stalled_sender_times_out_and_the_weights_stay(receiver, procs):
    rx = receiver(timeout=3)
    before = digest(rx.targets.items())
    serving = Serving(rx)
    sender = procs("export_sender.py", "--port", str(rx.port), "--versions", "1", "--pause-in", "1")
    sender.wait_for("PAUSED")  # alive, connected, silent
    (event,) = serving.join(timeout=300)  # a liveness limit only
    exc, _ = event
    assert isinstance(exc, SyncAborted) and "mid-update (version 1, 5 of 14" in str(exc)
    assert "went silent for 3.0s" in str(exc), str(exc)  # ended by the receiver's 3 s timeout, nothing else
    assert rx.version is None and digest(rx.targets.items()) == before


# ---------------------------------------------------------------- the delta's size and rank 0's memory

class LargestAllocation(TorchDispatchMode):
    """The largest storage any torch op allocated while active (bytes): an output whose storage is none
    of its inputs' (views and in-place results are not allocations)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_in = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in flat_in if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def perturb(model: torch.nn.Module, fractions: dict[str, float], seed: int = 3) -> None:
    """Flip the low mantissa bit of the given fraction of each named parameter's elements (a chosen
    random subset; 0.0 leaves a parameter untouched)."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, fraction in fractions.items():
            bits = params[name].data.view(-1).view(torch.int16)
            pick = torch.randperm(bits.numel(), generator=g)[:round(fraction * bits.numel())]
            bits[pick] ^= 1


def smallest_payload(numel: int, nnz: int) -> int:
    """The bytes a parameter's update needs at best (bf16 values): whole (2 per element), an int32
    index list (4 + 2 per change), or a bitmap (1 bit per element + 2 per change)."""
    return min(2 * numel, 6 * nnz, -(-numel // 8) + 2 * nnz)


def test_a_delta_is_never_larger_than_dense_and_rank0_holds_one_parameter(receiver, monkeypatch):
    """At 97% of a parameter changed a bitmap + values (2.06 bytes per element) is larger than the
    parameter itself; the old delta also listed every change as int64 indices on rank 0 (8 bytes per
    change). The payloads must be the smallest encoding of what really changed (counted here from the
    bits themselves), and nothing the sender allocates may exceed one bf16 copy of a parameter."""
    from faircast_ds.export.channel import Channel

    rx = receiver(timeout=30)
    serving = Serving(rx)
    model = tiny()
    sender = WeightSender(model, port=rx.port, timeout=30)
    assert sender.sync(version=1).kind == "dense"
    before = {n: p.detach().clone().view(-1).view(torch.int16) for n, p in model.named_parameters()}
    fractions = {"0.weight": 0.97, "2.weight": 0.5, "3.weight": 0.01, "6.weight": 1.0, "9.weight": 0.0005}
    perturb(model, fractions)
    nnz = {n: int((p.detach().view(-1).view(torch.int16) != before[n]).sum()) for n, p in model.named_parameters()}
    assert {n for n, k in nnz.items() if k} == {n for n, f in fractions.items() if round(f * before[n].numel())}
    payloads: list[int] = []
    send = Channel.send_tensor

    def recording(self, t):
        payloads.append((t.dtype, t.numel(), t.numel() * t.element_size()))
        send(self, t)

    monkeypatch.setattr(Channel, "send_tensor", recording)
    with LargestAllocation() as seen:
        report = sender.sync(version=2)
    monkeypatch.undo()
    numels = {n: p.numel() for n, p in model.named_parameters()}
    # the sender's frames: per parameter a 24-byte triple and its payloads, then the end triple
    bodies = [b for dtype, n, b in payloads if (dtype, n) != (torch.int64, 3)]
    assert sum(bodies) == sum(smallest_payload(numels[n], k) for n, k in nnz.items() if k)
    assert report.kind == "delta" and report.params == sum(1 for k in nnz.values() if k)
    assert report.changed == sum(nnz.values())
    assert seen.largest <= 2 * max(numels.values()), f"the sender allocated {seen.largest} bytes at once"
    sender.close()
    serving.join()
    assert rx.version == 2 and digest(rx.targets.items()) == digest(model.named_parameters())


# ---------------------------------------------------------------- the served-weight source (one process)

def test_source_walks_dense_then_only_what_changed_since_the_acknowledged_version():
    """Walk order, the changed set against bits compared here, and acknowledge/abort: an unacknowledged
    walk leaves the base where it was (nothing lost), require_dense starts over."""
    from faircast_ds.export.source import ServedSource

    model = tiny()
    names = [n for n, _ in model.named_parameters()]
    source = ServedSource(model)
    walk = source.walk()
    seen = [(item.name, delta.bits_view(item.tensor).clone()) for item in walk]
    assert walk.kind == "dense" and [n for n, _ in seen] == names and source.acknowledged is None
    for (n, bits), (_, p) in zip(seen, model.named_parameters()):
        assert torch.equal(bits, p.detach().view(-1).view(torch.int16))
    with pytest.raises(ValueError, match="needs an acknowledged version"):
        source.walk("delta")
    walk.acknowledge()  # version: the walk's serial for a plain module
    acked = {n: p.detach().clone().view(-1).view(torch.int16) for n, p in model.named_parameters()}
    perturb(model, {"2.weight": 0.3, "9.weight": 0.001})
    first = source.walk(masks=True)
    items = [(i.name, i.changed, None if i.mask is None else i.mask.clone()) for i in first]
    first.abort()  # the engine did not confirm: the next walk is still against `acked`
    perturb(model, {"0.weight": 0.02}, seed=4)
    second = source.walk(masks=True, groups={"9.weight": ("8.weight", "9.weight")})
    got = {i.name: (i.changed, None if i.mask is None else i.mask.clone()) for i in second}
    oracle = {n: p.detach().view(-1).view(torch.int16) != acked[n] for n, p in model.named_parameters()}
    changed = [n for n in names if bool(oracle[n].any())]
    assert [n for n, _, _ in items] == ["2.weight", "9.weight"]
    assert list(got) == sorted(set(changed) | {"8.weight"}, key=names.index)  # 8.weight travels with 9.weight
    assert second.changed_params == changed
    for n in changed:
        count, mask = got[n]
        assert count == int(oracle[n].sum()) and torch.equal(mask, oracle[n])
    assert got["8.weight"][0] == 0
    second.acknowledge()
    quiet = source.walk()
    assert quiet.kind == "delta" and list(quiet) == []
    source.require_dense()
    assert source.walk().kind == "dense"


def test_a_sync_shows_a_changed_groups_members_to_its_caller_and_sends_only_the_changed(receiver):
    rx = receiver(timeout=30)
    serving = Serving(rx)
    model = tiny()
    sender = WeightSender(model, port=rx.port, timeout=30)
    sender.sync(version=1)
    perturb(model, {"2.weight": 0.01})
    seen: list[tuple[str, int]] = []
    report = sender.sync(version=2, groups={"2.weight": ("2.weight", "3.weight")},
                         on_param=lambda item: seen.append((item.name, item.changed)))
    assert seen == [("2.weight", round(0.01 * 2048)), ("3.weight", 0)]
    assert (report.params, report.elements) == (1, round(0.01 * 2048))
    sender.close()
    _, update, closed = serving.join()  # the dense update, this one, the end of the session
    assert (update.params, update.changed) == (1, round(0.01 * 2048)) and closed == "closed"
    assert digest(rx.targets.items()) == digest(model.named_parameters())


@pytest.mark.parametrize("encoding", ["coo", "bitmap", "whole"])
def test_same_bits_says_whether_a_payload_would_change_the_target(encoding):
    """The receiver refuses other bits under the version it serves by this predicate: payloads built
    here by hand (indices, a packed little-endian bitmap, the whole parameter) against a target."""
    target = torch.arange(20, dtype=torch.int16).view(torch.bfloat16).clone()
    bits = target.view(torch.int16)
    where = torch.tensor([1, 7, 19])

    def payload(values: torch.Tensor):
        if encoding == "coo":
            return delta.COO, where.to(torch.int32), values
        if encoding == "bitmap":
            packed = [0] * 3
            for i in where.tolist():
                packed[i // 8] |= 1 << (i % 8)
            return delta.BITMAP, torch.tensor(packed, dtype=torch.uint8), values
        full = bits.clone()
        full[where] = values
        return delta.DENSE, None, full

    assert delta.same_bits(target, *payload(bits[where].clone()))
    assert not delta.same_bits(target, *payload(bits[where] + torch.tensor([0, 1, 0], dtype=torch.int16)))
    assert torch.equal(target.view(torch.int16), torch.arange(20, dtype=torch.int16))  # nothing written


@pytest.mark.parametrize("rows, cols", [(7, 64), (33, 128), (1, 192), (9, 40)])  # odd row counts; 40: not whole words
def test_touched_lines_of_a_bitmap_or_change_list_are_the_changed_rows_and_columns(rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    for share in (0.002, 0.05, 0.3):
        mask = torch.rand(rows, cols, generator=g) < share
        mask[rows // 2, cols - 1] = True  # the last column of a middle row: the last bit of a word
        want = ([r for r in range(rows) if bool(mask[r].any())], [c for c in range(cols) if bool(mask[:, c].any())])
        flat = mask.view(-1)
        index = flat.nonzero().view(-1)
        for encoding, first in ((delta.COO, index.to(torch.int32)), (delta.BITMAP, delta.mask_to_bitmap(flat))):
            got = delta.touched_lines((rows, cols), encoding, first)
            assert (got[0].tolist(), got[1].tolist()) == want, (encoding, share)
    assert delta.touched_lines((5,), delta.COO, torch.tensor([1])) is None
