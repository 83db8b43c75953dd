"""The trainer's one entry point, ServedPush: what it refuses before it talks to any engine (each refusal
names the option), the plane it picks where none is named, and whole pushes in this process against the
engine's real end of the plane (:func:`~faircast_ds.vllm.transfer.planes.Plane.open_host`, the segment and
its ledger) behind vLLM's weight-transfer calls, with no vLLM (:class:`SegmentServer`). The oracle is the
model's own bf16 bits, compared as integers with what the stand-in engine loaded at each finish. The same
pushes against a real ``vllm serve``: test_vllm_faults.py."""
from __future__ import annotations

import secrets
import threading
from types import SimpleNamespace

import pytest
import torch

from faircast_ds.export.channel import WeightSyncError
from faircast_ds.export.served import ParamSpec
from faircast_ds.vllm.transfer import ServedPush, VllmServer, planes

SECRET = secrets.token_hex(16)


def model():
    return torch.nn.Linear(4, 4).to(torch.bfloat16)


@pytest.fixture(autouse=True)
def no_secret_file(monkeypatch):
    monkeypatch.delenv("FAIRCAST_DS_SYNC_SECRET_FILE", raising=False)


@pytest.mark.parametrize("kwargs, words", [
    ({"plane": "nccl"}, "ServedPush: the plane is 'shm', 'net' or 'group', not 'nccl' (None: the fastest that works)"),
    ({"plane": "tcp"}, "ServedPush: the plane is 'shm', 'net' or 'group', not 'tcp': the TCP push (rank 0 alone over "
                       "one channel) is gone, CHANGELOG.md: shm on one host, net or group across hosts"),
    ({"plane": "group", "check_columns": -2}, "check_columns must be a non-negative integer, got -2"),
    ({"plane": "shm", "check_columns": -1}, "check_columns must be a non-negative integer, got -1"),
    ({"plane": "net", "check_columns": "8"}, "check_columns must be a non-negative integer, got '8'"),
    ({"plane": "shm", "port": 29650}, "port: not an option of plane 'shm'"),
    ({"verify": "sampled"}, "verify must be True, False or 'full', got 'sampled'"),
    ({"verify": 1}, "verify must be True, False or 'full', got 1"),
    ({"inplace": "no"}, "inplace must be True or False, got 'no'"),
])
def test_options_that_do_not_fit_the_plane_are_refused_by_name(kwargs, words):
    with pytest.raises(ValueError) as err:
        ServedPush(model(), "http://127.0.0.1:9", **kwargs)
    assert words in str(err.value)


def test_rank_zero_needs_the_server():
    with pytest.raises(ValueError, match="needs the server"):
        ServedPush(model(), None)


def test_an_unreachable_engine_is_a_clear_error():
    from conftest import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(WeightSyncError, match=r"did not open the faircast shm plane: .*(?i:connect|refused)"):
        ServedPush(model(), url, plane="shm", timeout=5.0, verify=False)


def test_a_server_under_a_launcher_runs_the_launcher_first_and_needs_its_port(tmp_path):
    """VllmServer(launcher=...) (the benchmark's cross-host row: ``ip netns exec NS``): the command starts
    with the launcher, which is given the whole server command; without an explicit port it is refused.
    The launcher here records its arguments and exits 3, so no server starts."""
    from faircast_ds.vllm.transfer.server import ServerUnavailable, VllmServer

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="with a launcher needs an explicit port"):
        VllmServer(tmp_path / "model", launcher=["ip", "netns", "exec", "x"])
    argv = tmp_path / "argv"
    launcher = ["sh", "-c", f'printf "%s\\n" "$@" > {argv}; exit 3', "launcher"]
    with pytest.raises(ServerUnavailable, match="exited with 3 at start"):
        VllmServer(tmp_path / "model", port=9, launcher=launcher, log_path=tmp_path / "server.log", start_timeout=60)
    words = argv.read_text().splitlines()
    assert words[words.index("--") + 1:][:3] == [words[0], "-m", "vllm.entrypoints.openai.api_server"]
    assert words[1:3] == ["-m", "faircast_ds._util.tethered"]
    assert words[words.index("--host") + 1] == "127.0.0.1" and words[words.index("--port") + 1] == "9"


# ---------------------------------------------------------------- whole pushes, no vLLM
class SegmentServer(VllmServer):
    """``vllm serve`` as ServedPush reaches it: VllmServer's own methods, with its one HTTP call (``_post``)
    answered in this process over the engine's real end of the plane: ``init`` opens it as the engine does
    (planes.py), ``update`` takes rank 0's commit from the ledger, ``finish`` loads what the commit carried
    out of the segment into ``served`` (a copy, as vLLM's reload) and sets the version. ``url``: where
    ServedPush believes the server is."""

    def __init__(self, url: str = "http://127.0.0.1:9") -> None:
        super().__init__(url=url)
        self.host, self.commit = None, None
        self.served: dict[str, torch.Tensor] = {}
        self.version: str | None = None
        self.calls: list[str] = []

    def _post(self, path: str, body: dict | None = None) -> None:
        self.calls.append(path)
        if path == "init_weight_transfer_engine":
            self._post("shutdown_weight_transfer_engine")
            info = body["init_info"]
            specs = [ParamSpec(n, tuple(shape), getattr(torch, dtype.rpartition(".")[2]))
                     for n, shape, dtype in info["params"]]
            self.host = planes.plane(info["plane"]).open_host(specs, SimpleNamespace(**info), "cpu")
        elif path == "start_weight_update":
            self.commit = None
        elif path == "update_weights":
            info = body["update_info"]
            self.commit = None if info.get("abandon") else self.host.ledger.take(info["version"])
        elif path == "finish_weight_update":
            commit, self.commit = self.commit, None
            if commit is not None:
                views = self.host.views()
                names = list(views)
                for i in commit.params:
                    self.served[names[i]] = views[names[i]].clone()
            if body is not None:
                self.version = body["weight_version"]
        elif path == "update_weight_version":
            self.version = body["new_version"]
        elif path == "shutdown_weight_transfer_engine":
            if self.host is not None:
                self.host.close()
            self.host = None
        elif path != "reset_prefix_cache":
            raise AssertionError(f"ServedPush posted {path}")


def serves(server: SegmentServer, m: torch.nn.Module, version: int) -> bool:
    """The stand-in engine loaded every parameter of ``m`` bit for bit, under ``version``."""
    mine = {n: p.detach().reshape(-1).view(torch.int16) for n, p in m.named_parameters()}
    return server.version == str(version) and set(server.served) == set(mine) and all(
        torch.equal(server.served[n].reshape(-1).view(torch.int16), bits) for n, bits in mine.items())


def nudge(m: torch.nn.Module) -> None:
    with torch.no_grad():
        m.weight.view(torch.int16)[1, 2] += 1  # one bf16 spacing, one element of one parameter


@pytest.mark.parametrize("url, plane, secret", [("http://127.0.0.1:9", "shm", None),
                                                ("http://localhost:9", "shm", SECRET),
                                                ("http://192.0.2.7:8000", "net", SECRET)])
def test_the_default_plane_is_the_fastest_that_works_and_serves_dense_delta_and_nothing(monkeypatch, url, plane, secret):
    """A server on this host gets shm, with or without the shared secret (without, each end takes only
    a process of its own user); one elsewhere (192.0.2.7, TEST-NET-1: no host here) net. Every report
    names the plane and why; a dense push, a delta of one parameter, and a push that changes nothing
    (one call: the version alone) each leave the engine serving the model's bits."""
    if secret is None:
        monkeypatch.delenv("FAIRCAST_DS_SYNC_SECRET", raising=False)
    else:
        monkeypatch.setenv("FAIRCAST_DS_SYNC_SECRET", secret)
    m, server = model(), SegmentServer(url)
    push = ServedPush(m, server, timeout=10.0)
    try:
        assert push.plane == plane and push.plane_choice is not None
        why = {"shm": "runs on this host: shm", "net": "(192.0.2.7) is not on the host of every rank: net"}[plane]
        assert why in push.plane_choice
        if secret is None:
            assert "no shared secret is set, so each end takes only a process of its own user" in push.plane_choice
        dense = push.push(1)
        assert (dense.kind, dense.plane, dense.plane_choice) == ("dense", plane, push.plane_choice)
        assert serves(server, m, 1)
        nudge(m)
        delta = push.push(2)
        assert delta.kind == "delta" and delta.params == 1 and serves(server, m, 2)
        server.calls.clear()
        nothing = push.push(3)
        assert nothing.params == 0 and nothing.http_calls == 1 and server.calls == ["update_weight_version"]
        assert serves(server, m, 3)
    finally:
        push.close()


def test_a_named_plane_is_taken_as_named_and_the_report_says_so(monkeypatch):
    monkeypatch.setenv("FAIRCAST_DS_SYNC_SECRET", SECRET)
    for plane in ("shm", "net"):
        m, server = model(), SegmentServer("http://192.0.2.7:8000")
        push = ServedPush(m, server, plane=plane, timeout=10.0)
        try:
            report = push.push(1)
            assert (report.plane, report.plane_choice, push.plane_choice) == (plane, None, None)
            assert serves(server, m, 1)
        finally:
            push.close()


def test_without_a_secret_a_server_elsewhere_is_refused_naming_the_secret(monkeypatch):
    monkeypatch.delenv("FAIRCAST_DS_SYNC_SECRET", raising=False)
    with pytest.raises(WeightSyncError, match="did not open the faircast net plane: .*needs a shared secret on both "
                                              "ends: set FAIRCAST_DS_SYNC_SECRET"):
        ServedPush(model(), SegmentServer("http://192.0.2.7:8000"), timeout=10.0)


def test_an_option_of_another_plane_than_the_chosen_one_names_the_choice(monkeypatch):
    monkeypatch.setenv("FAIRCAST_DS_SYNC_SECRET", SECRET)
    with pytest.raises(ValueError, match=r"port: not an option of plane 'shm' \(ServedPush chose it: the server"):
        ServedPush(model(), SegmentServer(), port=29650)


@pytest.mark.parametrize("plane", ["shm", "net"])
def test_a_write_that_fails_half_way_applies_nothing_and_the_next_push_is_dense(monkeypatch, plane):
    """The rank's write stops after its first slice (of two: weight and bias): the push raises a clear
    error on the trainer, the engine loads nothing and keeps its version, and the next push is dense and
    served whole."""
    monkeypatch.setenv("FAIRCAST_DS_SYNC_SECRET", SECRET)
    m, server = model(), SegmentServer()
    push = ServedPush(m, server, plane=plane, timeout=10.0)
    try:
        push.push(1)
        served = {n: t.clone() for n, t in server.served.items()}
        with torch.no_grad():
            m.weight.view(torch.int16).add_(1)
            m.bias.view(torch.int16).add_(1)

        def cut(k: int) -> None:
            if k == 1:
                raise ConnectionError("the write was cut after one slice")

        push.pause = cut
        server.calls.clear()
        with pytest.raises(WeightSyncError, match="weight update 2 not applied by the vLLM engine: rank 0: "
                                                  "ConnectionError: the write was cut after one slice"):
            push.push(2)
        assert server.calls == [] and server.version == "1"  # no vLLM call: nothing staged was loaded
        assert all(torch.equal(served[n], t) for n, t in server.served.items())
        push.pause = None
        again = push.push(3)
        assert again.kind == "dense" and serves(server, m, 3)
    finally:
        push.close()


# ---------------------------------------------------------------- the push's path through the package
def module_calls(fn) -> list[tuple[str, str]]:
    """Run ``fn`` and return, in order, every call from one module into another of ``faircast_ds`` on this
    thread (``sys.setprofile``: each Python function entered, its module against the nearest caller's in
    ``faircast_ds``; this test module is the caller ``"test"``, and the stand-in engine's calls, which are
    not the trainer's, are left out). The engine's threads are not followed."""
    import sys

    me, calls = threading.get_ident(), []

    def module(frame) -> str:
        name = frame.f_globals.get("__name__", "")
        return name.removeprefix("faircast_ds.") if name.startswith("faircast_ds") else (
            "test" if name == __name__ else "")

    def profile(frame, event, arg):
        if event != "call" or threading.get_ident() != me or not module(frame):
            return
        caller = frame.f_back
        while caller is not None and not module(caller):
            caller = caller.f_back
        edge = (module(caller) if caller is not None else "?", module(frame))
        # this test's own calls are the entry (into served_push) or the stand-in engine's (not the trainer's)
        if edge[0] != edge[1] and edge[1] != "test" and (edge[0] != "test" or edge[1].endswith("served_push")):
            calls.append(edge)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def path_of(calls: list[tuple[str, str]]) -> tuple[list[str], dict[str, set[str]], list[tuple[str, str]]]:
    """The modules entered in order, who entered each, and the calls from export/ or _util/ up into vllm/."""
    order, callers = [], {}
    for a, b in calls:
        if b not in order:
            order.append(b)
        callers.setdefault(b, set()).add(a)
    up = sorted({(a, b) for a, b in calls if a.startswith(("export.", "_util.")) and b.startswith("vllm.")})
    return order, callers, up


@pytest.mark.parametrize("plane, extra", [("shm", []), ("net", ["export.delta"])])
def test_one_push_enters_at_most_six_modules_each_from_one_place_and_never_calls_up(monkeypatch, plane, extra):
    """Issue 48's goal for the push's path, from ServedPush.push on the trainer side: a dense push and a
    delta (one element moved) enter at most six modules of the package (the shm plane, the default on
    this host: served_push, source, server, segment, channel, plane; the net plane's delta also builds
    its change lists with export.delta), each module entered from one module only (no module visited
    twice from different places), and no call runs from export/ or _util/ back up into vllm/. Printed
    with ``-s``: the path in order."""
    monkeypatch.setenv("FAIRCAST_DS_SYNC_SECRET", SECRET)
    m, server = model(), SegmentServer()
    push = ServedPush(m, server, plane=plane, timeout=10.0)
    try:
        dense = module_calls(lambda: push.push(1))
        nudge(m)
        delta = module_calls(lambda: push.push(2))
        assert serves(server, m, 2)
    finally:
        push.close()
    want = ["vllm.transfer.served_push", "export.source", "vllm.transfer.server", "vllm.transfer.segment",
            "export.channel", "export.plane"]
    for kind, calls, expected in (("dense", dense, want), ("delta", delta, want + extra)):
        order, callers, up = path_of(calls)
        print(f"{plane} {kind}: {len(order)} modules: {' -> '.join(order)}")
        assert sorted(order) == sorted(expected) and len(order) <= 6 + len(extra), order
        twice = {mod: sorted(c) for mod, c in callers.items() if len(c) > 1}
        assert not twice, f"entered from more than one module: {twice}"
        assert not up, f"calls back up the layering: {up}"
