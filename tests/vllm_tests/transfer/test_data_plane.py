"""The one-host shared-memory data plane without vLLM (issue 32 item 2): the engine's end
(:class:`~faircast_ds.vllm.transfer.segment.SegmentHost`: a memfd segment, an abstract AF_UNIX socket, the
commit ledger) and trainer ranks' ends (:class:`~faircast_ds.vllm.transfer.segment.SegmentWriter`), here in
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

from faircast_ds.export import delta
from faircast_ds.export.channel import WeightSyncError
from faircast_ds.export.plane import Layout, PlaneError, coverage_problem
from faircast_ds.export.served import ParamSpec
from faircast_ds.vllm.transfer.segment import SegmentHost, SegmentWriter, find_segments, socket_name

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
    """A host and ``world`` writers over one set of full tensors (each rank writes its share), on one
    host (``transport="shm"``: the memfd segment), over loopback TCP (``"net"``: each rank sends) or
    through a gloo send group on loopback (``"group"``)."""

    def __init__(self, world: int = 2, seed: int = 0, timeout: float = 5.0, transport: str = "shm") -> None:
        self.transport = transport
        self.name = socket_name() if transport == "shm" else None
        self.host = SegmentHost(SPECS, self.name, timeout=timeout,
                                address=None if transport == "shm" else ("127.0.0.1", 0),
                                group="gloo" if transport == "group" else None)
        self.full = weights(seed)
        self.writers = [self.writer(rank_slices(self.full, r, world), rank=r, world=world, session="trainer-1",
                                    timeout=timeout) for r in range(world)]
        self.connect_all()

    def connect_all(self, writers=None) -> None:
        """Every writer joins at once (a send group forms only when every rank and the engine joined)."""
        errors = []

        def join(w):
            try:
                w.connect()
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=join, args=(w,)) for w in (writers or self.writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]

    def write_all(self, version: int, kind: str = "dense", base: int | None = None,
                  params: set[int] | None = None) -> None:
        params = set(range(len(SPECS))) if params is None else params
        threads = [threading.Thread(target=w.write, args=(version, kind, base, params, {})) for w in self.writers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)

    def writer(self, slices, **kwargs) -> SegmentWriter:
        return SegmentWriter(self.name, SPECS, slices, address=self.host.address, group=self.transport == "group",
                             **kwargs)

    def commit(self, version: int, params: set[int] | None = None) -> None:
        self.writers[0].commit(version, params, {})

    def close(self) -> None:
        for w in self.writers:
            w.close()
        self.host.close()


def descriptors_until_closed(raw: socket.socket) -> list[int]:
    """Every descriptor a raw AF_UNIX peer receives until the host closes (or a read fails); closes it."""
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
    return fds


@pytest.fixture(params=["shm", "net", "group"])
def plane(request):
    p = Plane(transport=request.param)
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
    # shm, group: the digest finds the bytes at the wrong place (the group's engine places each send where the
    # rank declared it, so rank 1 sends the bytes a slice over); net: the engine refuses a slice never declared
    refused = ("rank 1's write of version 2 does not match the segment" if plane.transport in ("shm", "group")
               else r"rank 1 sent a slice \[\d+, \d+, \d+\] that is not one of the slices it declared")
    with pytest.raises(PlaneError, match=refused):
        plane.commit(2)
    if plane.transport == "net":  # its connection was closed: rank 1 joins again, as PlaneRoute's reconnect does
        plane.writers[1].close()
        plane.writers[1].connect()
    with pytest.raises(PlaneError, match="no committed write of version 2"):
        plane.host.ledger.take(2)
    plane.writers[1].offset_error = 0
    with pytest.raises(PlaneError, match="dirty"):  # the next update must be dense
        plane.writers[0].write(3, "delta", 1, {2}, {})
    plane.write_all(3)
    plane.commit(3)
    assert same(plane.host.views(), plane.full)


def test_the_commit_waits_for_every_rank(plane):
    plane.host.ledger  # rank 0 writes and commits; rank 1 never reports
    plane.writers[0].write(1, "dense", None, set(range(len(SPECS))), {})
    began = time.monotonic()
    plane.host.timeout = 0.5
    with pytest.raises(PlaneError, match=r"ranks \[1\] did not report"):
        plane.commit(1)
    assert time.monotonic() - began < 30  # bounded (not a speed claim)
    with pytest.raises(PlaneError, match="no committed write"):
        plane.host.ledger.take(1)


def test_a_rank_that_vanishes_before_its_report_fails_the_write(plane):
    plane.writers[0].write(1, "dense", None, set(range(len(SPECS))), {})
    plane.writers[1].channel.close()  # rank 1's connection ends: no report will come
    with pytest.raises(PlaneError, match=r"rank.* 1 .*(vanished|gone)"):
        plane.commit(1)


def test_a_local_process_without_the_secret_gets_no_descriptor_and_writes_nothing(plane, monkeypatch):
    if plane.transport != "shm":
        pytest.skip("the descriptor is the shm plane's; the other planes' intruders: test_net_plane_refuses_*")
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
    fds = descriptors_until_closed(raw)
    assert fds == [], "the segment's descriptor went to an unauthenticated peer"
    deadline = time.monotonic() + 20
    while plane.host.refused < 2 and time.monotonic() < deadline:  # the host's thread logs the refusal
        time.sleep(0.05)
    assert plane.host.refused >= 2 and plane.host.ledger.writes == writes
    assert same(views, before)


def test_a_second_trainer_is_refused_while_the_first_is_connected(plane):
    other = plane.writer(rank_slices(weights(5), 0, 1), rank=0, world=1, session="trainer-2")
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
    from faircast_ds.vllm.transfer.segment import SegmentHost
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
        writer.write(1, "dense", None, {0}, {})
        writer.commit(1, None, {})
        holders = find_segments()
        assert any(h.startswith(f"{proc.pid} ") for h in holders), holders  # the engine holds it ...
        assert not any(h.startswith(f"{os.getpid()} ") for h in holders), holders  # ... the writer no longer
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        with pytest.raises(WeightSyncError):  # the trainer's next write fails clearly
            writer.write(2, "dense", None, {0}, {})
        writer.close()
        # the engine's and this process's (another faircast engine on the machine may hold its own)
        assert [h for h in find_segments() if h.split()[0] in (str(proc.pid), str(os.getpid()))] == []
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
        fds = descriptors_until_closed(raw)
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


def test_net_plane_slices_larger_than_a_chunk_arrive_whole(monkeypatch):
    """Slices of several chunks (the chunk made small here) land bit for bit, each rank on its own
    connection; a delta that carries one parameter leaves every other byte of the segment alone."""
    from faircast_ds.vllm.transfer import segment as shm

    monkeypatch.setattr(shm, "CHUNK_BYTES", 24)  # the embedding's rank slices are 296 bytes: 13 chunks
    p = Plane(transport="net")
    try:
        views = p.host.views()
        p.write_all(1)
        p.commit(1)
        assert same(views, p.full)
        with torch.no_grad():
            p.full["embed.weight"][30, 7] += 1  # rank 1's half
        before = {k: v.clone() for k, v in views.items()}
        p.write_all(2, "delta", 1, {0})
        p.commit(2, {0})
        assert same(views, p.full)
        assert all(torch.equal(bits(views[k]), bits(before[k])) for k in views if k != "embed.weight")
    finally:
        p.close()


def test_net_plane_refuses_peers_without_the_secret_and_garbage(monkeypatch):
    """The TCP listener: a peer sending garbage, and one with another secret, are refused at the
    handshake; neither writes a byte; the rightful ranks then write and commit."""
    from faircast_ds.export.channel import client_handshake, resolve_secret

    p = Plane(transport="net")
    try:
        host, port = p.host.address
        raw = socket.create_connection((host, port), timeout=5)
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"\0" * 64)
        raw.settimeout(5)
        try:
            while raw.recv(4096):
                pass
        except OSError:
            pass
        raw.close()
        with monkeypatch.context() as mp:
            mp.setenv("FAIRCAST_DS_SYNC_SECRET", secrets.token_hex(16))
            intruder = socket.create_connection((host, port), timeout=5)
            with pytest.raises(WeightSyncError):
                client_handshake(intruder, resolve_secret(), timeout=5, peer="the plane")
            intruder.close()
        deadline = time.monotonic() + 20
        while p.host.refused < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.host.refused >= 2 and p.host.ledger.writes == 0
        p.write_all(1)
        p.commit(1)
        assert same(p.host.views(), p.full)
    finally:
        p.close()


def _sparse_write(p: Plane, version: int, base: int, params: set[int], before: dict[str, torch.Tensor]) -> list[int]:
    """Every rank writes a delta of ``params`` with its slices' change lists, computed here from ``before``
    (the test's own comparison of bit patterns). Returns each rank's bytes sent."""
    sent = [0] * len(p.writers)

    def one(r: int) -> None:
        w = p.writers[r]
        old = rank_slices(before, r, len(p.writers))
        masks = [bits(v) != bits(o) for (_, _, v), (_, _, o) in zip(w.slices, old)]
        lists = {}  # the change lists ServedPush sends, from this test's own comparison of bits
        for k, ((i, _, v), m) in enumerate(zip(w.slices, masks)):
            if i in params and delta.best(v.numel(), int(m.sum()), v.element_size()) == delta.COO:
                where = m.nonzero().view(-1)
                lists[k] = (where.to(delta.index_dtype(v.numel())), bits(v)[where])
        sent[r] = w.write(version, "delta", base, params, {}, changes=lists)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(p.writers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return sent


@pytest.mark.parametrize("chunk", [None, 8])
def test_net_plane_deltas_carry_each_slices_changed_elements_only(monkeypatch, chunk):
    """A net-plane delta sends a slice's changed elements where an index list is its smallest encoding: one
    element of rank 0's half of the embedding as an index and a value; rank 1's half, 21 of its 148
    elements changed (a list would be smaller than the slice, a bitmap smaller still), and rank 0's half of
    proj.weight (every element changed) whole; rank 1's half of proj.weight (none changed) as an empty list.
    The segment then holds every rank's bits (the oracle: the ranks' own tensors), every other byte as it
    was, and fewer bytes crossed than the slices hold; with 8-byte chunks every part spans several frames."""
    from faircast_ds.vllm.transfer import segment as seg

    if chunk:
        monkeypatch.setattr(seg, "CHUNK_BYTES", chunk)
    p = Plane(transport="net")
    try:
        views = p.host.views()
        p.write_all(1)
        p.commit(1)
        before_full = {k: v.clone() for k, v in p.full.items()}
        before_segment = {k: v.clone() for k, v in views.items()}
        with torch.no_grad():
            embed = p.full["embed.weight"].view(-1)
            embed[5] += 1  # rank 0's half (elements 0..147): one change
            embed[150:300:7] += 1  # rank 1's half (148..295): 150, 157, ..., 290: 21 changes
            p.full["proj.weight"].view(-1)[:52] += 1  # rank 0's half of proj.weight, every element
        sent = _sparse_write(p, 2, 1, {0, 2}, before_full)
        p.commit(2, {0, 2})
        assert same(views, p.full)
        assert all(torch.equal(bits(views[k]), bits(before_segment[k])) for k in ("norm.weight", "bias"))
        # rank 0: 1 index + value (6 bytes), proj.weight whole (104); rank 1: its embedding half whole (296), nothing
        assert sent == [6 + 104, 296]
        assert p.host.ledger.take(2).sent == sum(sent)
    finally:
        p.close()


def test_a_net_plane_delta_commit_lists_the_elements_its_change_lists_wrote():
    """The commit of a net-plane delta lists, per carried parameter, the flat indices the ranks' change
    lists wrote (what the engine writes in place and checks the rows and columns of) — the oracle: the
    test's own comparison of bits; None for a parameter a rank sent a slice of whole; nothing (None) for a
    dense commit. The shm plane lists nothing: its ranks write the segment themselves."""
    p = Plane(transport="net")
    try:
        p.write_all(1)
        p.commit(1)
        assert p.host.ledger.take(1).listed is None
        before = {k: v.clone() for k, v in p.full.items()}
        with torch.no_grad():
            p.full["embed.weight"].view(-1)[[5, 200]] += 1  # one element in each rank's half (148 each)
            p.full["proj.weight"].view(-1)[[1, 60]] += 1  # one in each half (52 each): change lists
        _sparse_write(p, 2, 1, {0, 2}, before)
        p.commit(2, {0, 2})
        listed = p.host.ledger.take(2).listed
        expected = {i: sorted((bits(p.full[SPECS[i].name]) != bits(before[SPECS[i].name])).nonzero().view(-1).tolist())
                    for i in (0, 2)}
        assert {i: sorted(t.tolist()) for i, t in listed.items()} == expected == {0: [5, 200], 2: [1, 60]}
        before = {k: v.clone() for k, v in p.full.items()}
        with torch.no_grad():
            p.full["embed.weight"].view(-1)[7] += 1
            p.full["proj.weight"].view(-1)[:52] += 1  # rank 0's half of proj.weight whole
        _sparse_write(p, 3, 2, {0, 2}, before)
        p.commit(3, {0, 2})
        listed = p.host.ledger.take(3).listed
        assert listed[0].tolist() == [7] and listed[2] is None
    finally:
        p.close()
    p = Plane(transport="shm")
    try:
        p.write_all(1)
        p.commit(1)
        p.host.ledger.take(1)
        with torch.no_grad():
            p.full["proj.weight"][3, 4] += 1
        p.write_all(2, "delta", 1, {2})
        p.commit(2, {2})
        assert p.host.ledger.take(2).listed is None
    finally:
        p.close()


def _raw_changes(p: Plane, header: dict, first: torch.Tensor, values: torch.Tensor) -> None:
    """Rank 0 opens a delta of version 2 and sends one ``changes`` message as given (a hostile or broken
    rank speaking the protocol with the right secret); rank 1 writes its part honestly."""
    w = p.writers[0]
    w.channel.send_json({"type": "begin", "version": 2, "kind": "delta", "base": 1})
    assert w.channel.recv_json()["ok"] is True
    w.channel.send_json({"type": "changes", "index": 0, "start": 0, "numel": 148, **header})
    for part in (first, values):
        if part.numel():
            w.channel.send_tensor(part.view(torch.uint8))
    try:
        p.writers[1].write(2, "delta", 1, {0}, {})
    except PlaneError as exc:  # the engine may already have failed the write when rank 1 begins
        assert "already failed" in str(exc)


@pytest.mark.parametrize("case, header, first, values, refused", [
    ("indices not increasing", {"encoding": "coo", "count": 2}, torch.tensor([9, 3], dtype=torch.int32),
     torch.tensor([1, 2], dtype=torch.int16), "not strictly increasing"),
    ("an index past the slice", {"encoding": "coo", "count": 1}, torch.tensor([148], dtype=torch.int32),
     torch.tensor([1], dtype=torch.int16), "out of range"),
    ("a bitmap (not a change list's encoding)", {"encoding": "bitmap", "count": 1},
     torch.zeros(0), torch.zeros(0), "malformed change list"),
    ("a list larger than the slice", {"encoding": "coo", "count": 100}, torch.zeros(0), torch.zeros(0),
     "malformed change list"),
    ("an unknown encoding", {"encoding": "zip", "count": 1}, torch.zeros(0), torch.zeros(0),
     "malformed change list"),
])
def test_net_plane_refuses_broken_change_lists(case, header, first, values, refused):
    """A change list the engine cannot apply whole is refused by name, ends the rank's connection, and
    the write does not commit; the segment then takes no delta, and the next dense write is served."""
    p = Plane(transport="net")
    try:
        p.write_all(1)
        p.commit(1)
        p.host.ledger.take(1)
        _raw_changes(p, header, first, values)
        with pytest.raises((PlaneError, WeightSyncError), match=refused):  # rank 0 hears it as the session's end
            p.commit(2, {0})
        p.writers[0].close()
        p.writers[0].connect()
        with pytest.raises(PlaneError, match="dirty"):
            p.writers[0].write(3, "delta", 1, {0}, {})
        p.write_all(3)
        p.commit(3)
        assert same(p.host.views(), p.full)
    finally:
        p.close()


def test_net_plane_refuses_change_lists_in_a_dense_write():
    p = Plane(transport="net")
    try:
        w = p.writers[0]
        w.channel.send_json({"type": "begin", "version": 1, "kind": "dense", "base": None})
        assert w.channel.recv_json()["ok"] is True
        w.channel.send_json({"type": "changes", "index": 0, "start": 0, "numel": 148, "encoding": "coo", "count": 0})
        try:
            p.writers[1].write(1, "dense", None, set(range(len(SPECS))), {})
        except PlaneError as exc:  # the engine may already have failed the write when rank 1 begins
            assert "already failed" in str(exc)
        with pytest.raises((PlaneError, WeightSyncError), match="not a delta"):
            p.commit(1)
    finally:
        p.close()


# ---------------------------------------------------------------------------------------------
# across two hosts: the engine's end in one network namespace, two trainer ranks in the other

_NET_HOST = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    from pathlib import Path
    from faircast_ds.vllm.transfer.segment import SegmentHost
    import importlib.util
    spec = importlib.util.spec_from_file_location("data_plane_test", {module!r})
    t = importlib.util.module_from_spec(spec); spec.loader.exec_module(t)
    SPECS = t.SPECS
    out = Path({out!r})
    host = SegmentHost(SPECS, address=({addr!r}, {port}), timeout=60, group={group!r})
    (out / "ready").write_text("1")
    deadline = time.monotonic() + 120
    for version in (1, 2):
        while host.ledger.commits < version:
            assert time.monotonic() < deadline, "no commit of version %d" % version
            time.sleep(0.02)
        host.ledger.take(version)
        torch.save({{k: v.clone() for k, v in host.views().items()}}, out / f"segment{{version}}.pt")
        (out / f"seen{{version}}").write_text("1")
    host.close()
""")

_NET_RANK = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    from pathlib import Path
    from faircast_ds.vllm.transfer.segment import SegmentWriter
    import importlib.util
    spec = importlib.util.spec_from_file_location("data_plane_test", {module!r})
    t = importlib.util.module_from_spec(spec); spec.loader.exec_module(t)
    SPECS, moved, rank_slices, weights = t.SPECS, t.moved, t.rank_slices, t.weights
    rank, out = {rank}, Path({out!r})

    def wait(name):
        deadline = time.monotonic() + 120
        while not (out / name).exists():
            assert time.monotonic() < deadline, name
            time.sleep(0.02)

    wait("ready")
    full = weights(0)
    w = SegmentWriter(None, SPECS, rank_slices(full, rank, 2), rank=rank, world=2, session="netns", timeout=60,
                      address=({addr!r}, {port}), group={group!r} is not None)
    w.connect()
    w.write(1, "dense", None, set(range(len(SPECS))), {{}})
    if rank == 0:
        w.commit(1, None, {{}})
    wait("seen1")
    moved(full)  # version 2: one element of proj.weight in each rank's half
    w.write(2, "delta", 1, {{2}}, {{}})
    if rank == 0:
        w.commit(2, {{2}}, {{}})
    wait("seen2")
    w.close()
""")


def moved(full: dict[str, torch.Tensor]) -> None:
    """Version 2 of ``weights(0)``: two elements of proj.weight moved (one in each rank's half)."""
    with torch.no_grad():
        full["proj.weight"][0, 1] += 1
        full["proj.weight"][7, 12] -= 1


@pytest.mark.slow
@pytest.mark.parametrize("group", [None, "gloo"], ids=["net", "group"])
def test_net_plane_across_two_network_namespaces(tmp_path, group):
    """The engine's end listens on its own host's address (namespace worker-1); two trainer ranks on the
    other host (worker-2) each send their own slices on their own connection (net), or by sends in a gloo
    group whose members bind their own host's address (group): a dense write, then a delta of one
    parameter. The segment equals the ranks' tensors bit for bit after each commit (the oracle: the
    tensors themselves, rebuilt here from the same seed)."""
    from netns import TwoHosts, need_netns

    need_netns()
    tests = str(ROOT / "tests")
    port = 29731  # inside a namespace of its own: nothing else listens there
    with TwoHosts() as hosts:
        addr = hosts.addr["worker-1"]
        fmt = dict(root=str(ROOT), tests=tests, out=str(tmp_path), addr=addr, port=port, module=__file__, group=group)
        env = cpu_env()
        env["FAIRCAST_DS_SYNC_SECRET"] = SECRET

        def start(ns: str, code: str) -> subprocess.Popen:
            return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", code], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

        procs = [start(hosts.netns["worker-1"], _NET_HOST.format(**fmt))]
        procs += [start(hosts.netns["worker-2"], _NET_RANK.format(rank=r, **fmt)) for r in (0, 1)]
        try:
            outs = []
            for p in procs:
                out, _ = p.communicate(timeout=180)
                outs.append(out)
            assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(o[-3000:] for o in outs)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(30)
    assert hosts.left() == []
    full = weights(0)
    assert same(torch.load(tmp_path / "segment1.pt"), full)
    moved(full)
    assert same(torch.load(tmp_path / "segment2.pt"), full)


def test_group_plane_ranks_form_a_new_group_after_a_failed_write():
    """The group plane after a refused write (rank 1's bytes a slice over: the digest refuses the commit):
    every rank leaves, as PlaneRoute makes them after a failed push, joins again, and a new send group
    forms (the engine's second); a dense write through it commits the ranks' bits."""
    p = Plane(transport="group")
    try:
        p.write_all(1)
        p.commit(1)
        p.writers[1].offset_error = 1
        p.write_all(2)
        with pytest.raises(PlaneError, match="rank 1's write of version 2 does not match the segment"):
            p.commit(2)
        p.writers[1].offset_error = 0
        assert p.host.rendezvous.generations == 1
        for w in p.writers:
            w.close()
        p.connect_all()
        assert p.host.rendezvous.generations == 2
        with torch.no_grad():
            p.full["embed.weight"][0, 0] += 1
        p.write_all(3)
        p.commit(3)
        assert same(p.host.views(), p.full)
    finally:
        p.close()


@pytest.mark.parametrize("message, refused", [
    ({"type": "sends", "params": [0]}, "rank 0 announced sends outside an open write"),
    ({"type": "piece", "index": 0, "start": 0, "numel": 1}, "unexpected message 'piece' from rank 0"),
])
def test_group_plane_refuses_sends_outside_a_write_and_the_net_planes_messages(message, refused):
    """An authenticated rank that announces sends with no write open, or speaks the net plane's messages to
    a group engine, ends its connection with the reason; nothing is received into the segment."""
    p = Plane(transport="group")
    try:
        views = p.host.views()
        before = {k: v.clone() for k, v in views.items()}
        p.writers[0].channel.send_json(message)
        with pytest.raises(WeightSyncError, match=refused):
            p.writers[0].channel.recv_json()
        assert same(views, before)
    finally:
        p.close()


def test_group_plane_descriptions_that_are_not_a_group_are_refused_by_name():
    from faircast_ds.export.send_group import build, check_info

    good = {"host": "127.0.0.1", "port": 29500, "prefix": "x/", "size": 3, "backend": "gloo", "timeout": 5.0}
    assert check_info(good) is None
    for key, value, words in [("backend", "mpi", "backend 'mpi' is not one of"), ("port", 0, "port 0"),
                              ("size", True, "size is True"), ("host", None, "host is None")]:
        assert words in check_info({**good, key: value})
    with pytest.raises(PlaneError, match="described its send group oddly: backend 'mpi'"):
        build({**good, "backend": "mpi"}, 0, "127.0.0.1")


def test_group_plane_refuses_a_slice_of_another_dtype_before_any_byte_moves():
    """A rank whose slice is not the engine's dtype (float32 values for a bf16 parameter) is refused by
    name before it announces its sends, so the engine posts no receive of the wrong size (gloo would
    abort the engine's process on an oversized message)."""
    p = Plane(transport="group")
    try:
        p.write_all(1)
        p.commit(1)
        w = p.writers[1]
        index, start, values = w.slices[0]
        w.slices[0] = (index, start, values.float()[: values.numel() // 2])  # the same bytes, other elements
        with pytest.raises(PlaneError, match=r"its slice of embed.weight is torch.float32, the engine's layout says "
                                             r"torch.bfloat16"):
            w.write(2, "dense", None, set(range(len(SPECS))), {})
    finally:
        p.close()


# ---------------------------------------------------------------- no shared secret: one host, one user
def test_without_a_secret_the_shm_plane_takes_processes_of_its_own_user(monkeypatch):
    """Neither end holds a secret: the shm plane's ends take each other because the kernel says they run
    as one user (SO_PEERCRED); the ranks write and commit, bit for bit. The planes that cross a network
    refuse to start without one, by name."""
    monkeypatch.delenv("FAIRCAST_DS_SYNC_SECRET", raising=False)
    p = Plane(transport="shm")
    try:
        p.write_all(1)
        p.commit(1)
        assert same(p.host.views(), p.full)
        assert not p.writers[0].channel.authenticated  # integrity only: nobody proved a secret
    finally:
        p.close()
    for transport in ("net", "group"):
        with pytest.raises(WeightSyncError, match=f"the {transport} weight plane needs a shared secret on both ends"):
            SegmentHost(SPECS, address=("127.0.0.1", 0), group="gloo" if transport == "group" else None, timeout=5)


def test_without_a_secret_a_process_of_another_user_gets_no_descriptor(monkeypatch):
    """A process of another user (this test's root drops to nobody in a child) connects to a secretless shm
    host: the host refuses it before reading a byte, no descriptor arrives, nothing is written; and a
    writer of this user reaching a host of another user refuses it (the same check on the writer's side,
    asked of a socket whose peer is the child)."""
    assert os.getuid() == 0, "this test starts a process of another user: run the suite as root (as CI does)"
    monkeypatch.delenv("FAIRCAST_DS_SYNC_SECRET", raising=False)
    name = socket_name()
    host = SegmentHost(SPECS, name, timeout=5)
    try:
        child = textwrap.dedent(f"""
            import json, os, socket, sys
            sys.path.insert(0, {str(ROOT)!r})
            import torch
            from faircast_ds.export.channel import client_handshake
            from faircast_ds.export.served import ParamSpec
            specs = {[[s.name, list(s.shape), str(s.dtype)] for s in SPECS]!r}
            os.setgid(65534); os.setuid(65534)  # imports done as root; from here on, nobody
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect("\\0{name}")
            fds = []
            try:  # the protocol as a trainer rank speaks it, without a secret (as the host holds none)
                ch = client_handshake(s, None, timeout=10, peer="the plane")
                ch.send_json({{"type": "hello", "protocol": 1, "session": "intruder", "rank": 0, "world": 1,
                               "params": specs, "slices": []}})
                ch.recv_json()
                ch.send_json({{"type": "begin", "version": 9, "kind": "dense", "base": None}})
                ch.recv_json()
                _, fds, _, _ = socket.recv_fds(s, 1, 4)
            except Exception as exc:
                print("refused:", type(exc).__name__, exc, file=sys.stderr)
            print(len(fds))
        """)
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "0", "the segment's descriptor went to a process of another user"
        deadline = time.monotonic() + 20
        while host.refused < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert host.refused == 1 and host.ledger.writes == 0
    finally:
        host.close()
    # the writer's side: an engine end of another user (a child listening as nobody) is refused by name
    other = socket_name()
    listener = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, socket, time
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind("\\0{other}")
        os.setgid(65534); os.setuid(65534)
        s.listen(1)
        print("listening", flush=True)
        conn, _ = s.accept()
        time.sleep(30)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "listening"
        writer = SegmentWriter(other, SPECS, rank_slices(weights(0), 0, 1), rank=0, world=1, session="s", timeout=5)
        with pytest.raises(WeightSyncError, match=r"the engine's plane at @.* runs as user 65534, not this "
                                                  r"process's 0, and no shared secret is set"):
            writer.connect()
    finally:
        listener.kill()
        listener.wait(30)


def test_an_engine_with_a_secret_refuses_a_trainer_without_one(monkeypatch):
    """The engine holds the secret, the trainer none (or the other way round): the handshake refuses,
    naming the secret, and nothing is written."""
    p = Plane(transport="shm")  # the host and its writers hold SECRET
    try:
        monkeypatch.delenv("FAIRCAST_DS_SYNC_SECRET", raising=False)
        bare = SegmentWriter(p.name, SPECS, rank_slices(weights(9), 0, 1), rank=0, world=1, session="bare", timeout=5)
        with pytest.raises(WeightSyncError, match="requires the shared secret and this sender has none"):
            bare.connect()
        assert p.host.ledger.writes == 0
    finally:
        p.close()
    name = socket_name()
    host = SegmentHost(SPECS, name, timeout=5)  # no secret on the engine now
    try:
        monkeypatch.setenv("FAIRCAST_DS_SYNC_SECRET", SECRET)
        keyed = SegmentWriter(name, SPECS, rank_slices(weights(9), 0, 1), rank=0, world=1, session="k", timeout=5)
        with pytest.raises(WeightSyncError, match="holds no shared secret and this sender does"):
            keyed.connect()
        assert host.ledger.writes == 0
    finally:
        host.close()


def test_a_write_of_a_version_not_newer_than_the_last_is_refused_before_it_begins(plane):
    """Versions only increase within a session: an older version, or the same one again (other bits under a
    version the engine already holds), is refused at begin, naming why; the segment stays clean (a delta on
    the last version is still taken)."""
    plane.write_all(5)
    plane.commit(5)
    plane.host.ledger.take(5)
    for version, why in ((3, r"update version 3 is older than the weights served \(version 5\)"),
                         (5, "update version 5 is the version the engine already holds; versions must increase")):
        with pytest.raises(PlaneError, match=why):
            plane.writers[0].write(version, "dense", None, set(range(len(SPECS))), {})
    assert plane.host.ledger.segment_version == 5 and plane.host.ledger.writes == 1
    with torch.no_grad():
        plane.full["norm.weight"][2] += 1
    plane.write_all(6, "delta", 5, {1})
    plane.commit(6, {1})
    assert same(plane.host.views(), plane.full)
