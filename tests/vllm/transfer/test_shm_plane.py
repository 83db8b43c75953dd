"""The one-host shared-memory data plane without vLLM (issue 32 item 2): the engine's end
(:class:`~faircast_ds.vllm.transfer.shm.SegmentHost`: a memfd segment, an abstract AF_UNIX socket, the
commit ledger) and trainer ranks' ends (:class:`~faircast_ds.vllm.transfer.shm.SegmentWriter`), here in
one process (ranks on threads) or, for the faults, in processes of their own.

The oracle is the ranks' own source tensors: after a commit every element of the segment must hold
their bits (compared with torch.equal on integer views, no plane code); a refused write must leave a
segment that takes no delta. Seconds each; no wall-clock assertion.
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from conftest import ROOT, cpu_env

from faircast_ds.export.channel import WeightSyncError
from faircast_ds.export.plane import Layout, PlaneError, coverage_problem
from faircast_ds.export.served import ParamSpec
from faircast_ds.export.stages import Stages
from faircast_ds.vllm.transfer.shm import MEMFD_NAME, SegmentHost, SegmentWriter, find_segments, socket_name

SECRET = secrets.token_hex(16)
SPECS = [ParamSpec("embed.weight", (37, 8), torch.bfloat16), ParamSpec("norm.weight", (8,), torch.bfloat16),
         ParamSpec("proj.weight", (8, 13), torch.bfloat16), ParamSpec("bias", (5,), torch.float32)]


@pytest.fixture(autouse=True)
def secret_env(monkeypatch):
    monkeypatch.setenv("FAIRCAST_DS_SYNC_SECRET", SECRET)
    monkeypatch.delenv("FAIRCAST_DS_SYNC_SECRET_FILE", raising=False)


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g).to(s.dtype) for s in SPECS}


def rank_slices(full: dict[str, torch.Tensor], rank: int, world: int) -> list[tuple[int, int, torch.Tensor]]:
    """Rank ``rank``'s contiguous share of every parameter (views of ``full``), as ZeRO partitions."""
    out = []
    for i, s in enumerate(SPECS):
        flat = full[s.name].view(-1)
        share = -(-flat.numel() // world)
        lo, hi = min(rank * share, flat.numel()), min((rank + 1) * share, flat.numel())
        if hi > lo:
            out.append((i, lo, flat[lo:hi]))
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


class Plane:
    """A host and ``world`` writers over one set of full tensors (each rank writes its share)."""

    def __init__(self, world: int = 2, seed: int = 0, timeout: float = 5.0) -> None:
        self.name = socket_name()
        self.host = SegmentHost(SPECS, self.name, timeout=timeout)
        self.full = weights(seed)
        self.writers = [SegmentWriter(self.name, SPECS, rank_slices(self.full, r, world), rank=r, world=world,
                                      session="trainer-1", timeout=timeout) for r in range(world)]
        for w in self.writers:
            w.connect()

    def write_all(self, version: int, kind: str = "dense", base: int | None = None,
                  params: set[int] | None = None) -> None:
        params = set(range(len(SPECS))) if params is None else params
        threads = [threading.Thread(target=w.write, args=(version, kind, base, params, Stages())) for w in self.writers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)

    def commit(self, version: int, params: set[int] | None = None) -> None:
        self.writers[0].commit(version, params, Stages())

    def close(self) -> None:
        for w in self.writers:
            w.close()
        self.host.close()


@pytest.fixture
def plane():
    p = Plane()
    yield p
    p.close()


def test_ranks_write_their_slices_in_place_and_a_delta_carries_only_its_parameters(plane):
    views = plane.host.views()
    plane.write_all(1)
    plane.commit(1)
    assert same(views, plane.full)
    assert plane.host.ledger.take(1).params == set(range(len(SPECS)))
    with torch.no_grad():
        plane.full["proj.weight"][3, 4] += 1  # one element of one parameter
    before = {k: v.clone() for k, v in views.items()}
    plane.write_all(2, "delta", 1, {2})
    plane.commit(2, {2})
    assert same(views, plane.full)
    assert all(torch.equal(bits(views[k]), bits(before[k])) for k in views if k != "proj.weight")
    assert plane.host.ledger.take(2).params == {2}


def test_a_rank_writing_at_the_wrong_offset_is_refused_and_the_segment_takes_no_delta(plane):
    plane.write_all(1)
    plane.commit(1)
    plane.host.ledger.take(1)
    plane.writers[1].offset_error = 1  # rank 1 writes every slice one element too far
    plane.write_all(2)
    with pytest.raises(PlaneError, match="rank 1's write of version 2 does not match the segment"):
        plane.commit(2)
    with pytest.raises(PlaneError, match="no committed write of version 2"):
        plane.host.ledger.take(2)
    plane.writers[1].offset_error = 0
    with pytest.raises(PlaneError, match="dirty"):  # the next update must be dense
        plane.writers[0].write(3, "delta", 1, {2}, Stages())
    plane.write_all(3)
    plane.commit(3)
    assert same(plane.host.views(), plane.full)


def test_the_commit_waits_for_every_rank(plane):
    plane.host.ledger  # rank 0 writes and commits; rank 1 never reports
    plane.writers[0].write(1, "dense", None, set(range(len(SPECS))), Stages())
    began = time.monotonic()
    plane.host.timeout = 0.5
    with pytest.raises(PlaneError, match=r"ranks \[1\] did not report"):
        plane.commit(1)
    assert time.monotonic() - began < 30  # bounded (not a speed claim)
    with pytest.raises(PlaneError, match="no committed write"):
        plane.host.ledger.take(1)


def test_a_rank_that_vanishes_before_its_report_fails_the_write(plane):
    plane.writers[0].write(1, "dense", None, set(range(len(SPECS))), Stages())
    plane.writers[1].channel.close()  # rank 1's connection ends: no report will come
    with pytest.raises(PlaneError, match=r"rank.* 1 .*(vanished|gone)"):
        plane.commit(1)


def test_a_local_process_without_the_secret_gets_no_descriptor_and_writes_nothing(plane, monkeypatch):
    plane.write_all(1)
    plane.commit(1)
    views = plane.host.views()
    before = {k: v.clone() for k, v in views.items()}
    writes = plane.host.ledger.writes
    # an intruder speaking the protocol with another secret
    monkeypatch.setenv("FAIRCAST_DS_SYNC_SECRET", secrets.token_hex(16))
    intruder = SegmentWriter(plane.name, SPECS, rank_slices(weights(9), 0, 1), rank=0, world=1, session="intruder")
    with pytest.raises(WeightSyncError, match="(?i)secret"):
        intruder.connect()
    # and a raw peer that skips the handshake and just asks: it must get no descriptor
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.settimeout(5)
    raw.connect("\0" + plane.name)
    raw.sendall(b'{"type":"begin","version":9,"kind":"dense","base":null}' * 4)
    fds = []
    try:
        while True:
            data, got, _, _ = socket.recv_fds(raw, 4096, 4)
            fds += got
            if not data:
                break
    except OSError:
        pass
    raw.close()
    assert fds == [], "the segment's descriptor went to an unauthenticated peer"
    deadline = time.monotonic() + 20
    while plane.host.refused < 2 and time.monotonic() < deadline:  # the host's thread logs the refusal
        time.sleep(0.05)
    assert plane.host.refused >= 2 and plane.host.ledger.writes == writes
    assert same(views, before)


def test_a_second_trainer_is_refused_while_the_first_is_connected(plane):
    other = SegmentWriter(plane.name, SPECS, rank_slices(weights(5), 0, 1), rank=0, world=1, session="trainer-2")
    with pytest.raises(WeightSyncError, match="already serving another trainer"):
        other.connect()


def test_digest_samples_stay_inside_slices_of_any_length():
    from faircast_ds.export.plane import _sample_positions

    for n in (1, 15, 16, 17, 2**24 + 1, 77_791_232, 3 * 2**31 + 7):  # float positions overrun past 2^24
        p = _sample_positions(n)
        assert int(p.min()) == 0 and int(p.max()) == n - 1 and bool((p[1:] > p[:-1]).all())


def test_layout_and_coverage():
    layout = Layout.of(SPECS)
    assert all(o % 64 == 0 for o in layout.offsets)
    ends = [o + s.numel * s.dtype.itemsize for o, s in zip(layout.offsets, SPECS)]
    assert all(e <= o for e, o in zip(ends, layout.offsets[1:])) and ends[-1] <= layout.nbytes
    ok = {0: [(2, 0, 50)], 1: [(2, 50, 54)]}
    assert coverage_problem(layout, ok, {2}) is None
    assert "gap" in coverage_problem(layout, {0: [(2, 0, 50)], 1: [(2, 51, 53)]}, {2})
    assert "overlap" in coverage_problem(layout, {0: [(2, 0, 51)], 1: [(2, 50, 54)]}, {2})
    assert "cover 50 of 104" in coverage_problem(layout, {0: [(2, 0, 50)]}, {2})
    with pytest.raises(ValueError, match="outside"):
        layout.span(2, 100, 5)


_HOST = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {root!r})
    from faircast_ds.export.served import ParamSpec
    from faircast_ds.vllm.transfer.shm import SegmentHost
    host = SegmentHost([ParamSpec("w", (1024,), torch.bfloat16)], {name!r}, timeout=5)
    print("ready", flush=True)
    time.sleep(600)
""")


def test_no_segment_outlives_the_engine_that_made_it_after_a_sigkill():
    name = socket_name()
    proc = subprocess.Popen([sys.executable, "-c", _HOST.format(root=str(ROOT), name=name)], env=cpu_env(),
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        full = {"w": torch.randn(1024).to(torch.bfloat16)}
        writer = SegmentWriter(name, [ParamSpec("w", (1024,), torch.bfloat16)], [(0, 0, full["w"])], rank=0,
                               world=1, session="s")
        writer.connect()
        writer.write(1, "dense", None, {0}, Stages())
        writer.commit(1, None, Stages())
        holders = find_segments()
        assert any(h.startswith(f"{proc.pid} ") for h in holders), holders  # the engine holds it ...
        assert not any(h.startswith(f"{os.getpid()} ") for h in holders), holders  # ... the writer no longer
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        with pytest.raises(WeightSyncError):  # the trainer's next write fails clearly
            writer.write(2, "dense", None, {0}, Stages())
        writer.close()
        assert [h for h in find_segments() if MEMFD_NAME] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def test_a_peer_that_never_proves_the_secret_never_gets_the_descriptor(monkeypatch):
    """A bare engine end, no trainer: a raw local peer and an intruder with another secret each get
    refused, and no descriptor arrives on either connection."""
    name = socket_name()
    host = SegmentHost(SPECS, name, timeout=5)
    try:
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.settimeout(5)
        raw.connect("\0" + name)
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"\0" * 64)
        fds = []
        try:
            while True:
                data, got, _, _ = socket.recv_fds(raw, 4096, 4)
                fds += got
                if not data:
                    break
        except OSError:
            pass
        raw.close()
        monkeypatch.setenv("FAIRCAST_DS_SYNC_SECRET", secrets.token_hex(16))
        intruder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        intruder.settimeout(5)
        intruder.connect("\0" + name)
        from faircast_ds.export.channel import client_handshake, resolve_secret

        with pytest.raises(WeightSyncError):
            client_handshake(intruder, resolve_secret(), timeout=5, peer="the plane")
        try:
            _, got, _, _ = socket.recv_fds(intruder, 4096, 4)
            fds += got
        except OSError:
            pass
        intruder.close()
        assert fds == [], "the segment's descriptor went to a peer that never proved the secret"
        assert host.ledger.writes == 0
    finally:
        host.close()
