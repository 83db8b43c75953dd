"""The trainer's one entry point, ServedPush: what it refuses before it talks to any engine (each refusal
names the option), and that ``plane`` picks the route. No server is started: every case fails or is
decided before the first connection."""
from __future__ import annotations

import pytest
import torch

from faircast_ds.vllm.transfer import ServedPush


def model():
    return torch.nn.Linear(4, 4).to(torch.bfloat16)


@pytest.mark.parametrize("kwargs, words", [
    ({"plane": "nccl"}, "plane must be one of ('tcp', 'shm', 'net', 'group'), not 'nccl'"),
    ({"plane": "group", "check_columns": -2}, "check_columns must be a non-negative integer, got -2"),
    ({"plane": "shm", "check_columns": -1}, "check_columns must be a non-negative integer, got -1"),
    ({"plane": "net", "check_columns": "8"}, "check_columns must be a non-negative integer, got '8'"),
    ({"plane": "shm", "port": 29650}, "port: not an option of plane 'shm'"),
    ({"plane": "tcp", "secret": "s" * 32}, "secret: an option of planes 'shm', 'net' and 'group'"),
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


@pytest.mark.parametrize("plane, module, route", [("tcp", "tcp_route", "TcpRoute"), ("shm", "plane_route", "PlaneRoute"),
                                                  ("net", "plane_route", "PlaneRoute"),
                                                  ("group", "plane_route", "PlaneRoute")])
def test_the_plane_picks_the_route(plane, module, route, monkeypatch):
    """The route's own constructor is reached (and its first call to the engine fails: nothing listens)."""
    import importlib

    module = importlib.import_module(f"faircast_ds.vllm.transfer.{module}")
    reached = []
    real = getattr(module, route).__init__

    def spy(self, *args, **kwargs):
        reached.append(route)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(getattr(module, route), "__init__", spy)
    with pytest.raises(Exception):  # noqa: B017 - whatever the refused connection raises
        ServedPush(model(), "http://127.0.0.1:9", plane=plane, timeout=2.0)
    assert reached == [route]


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


# ---------------------------------------------------------------- the default plane: the fastest that works
@pytest.fixture
def routes(monkeypatch):
    """The routes ServedPush builds, stood in for: each records which route and plane it was built for, and
    answers a push with a bare report."""
    from faircast_ds.export.source import ServedReport
    from faircast_ds.vllm.transfer.plane_route import PlaneRoute
    from faircast_ds.vllm.transfer.tcp_route import TcpRoute

    reached: list = []

    def stand_in(kind):
        def init(self, model, server, **kwargs):
            reached.append((kind, kwargs.get("plane")))
            self.server, self.last_check = server, None
        return init

    def push(self, version, **kwargs):
        return ServedReport(version=version, kind="dense", params=1, changed=16, numel=16, bytes=32, seconds=0.0)

    for cls, kind in ((PlaneRoute, "plane_route"), (TcpRoute, "tcp_route")):
        monkeypatch.setattr(cls, "__init__", stand_in(kind))
        monkeypatch.setattr(cls, "push", push)
    monkeypatch.delenv("FAIRCAST_DS_SYNC_SECRET_FILE", raising=False)
    return reached


@pytest.mark.parametrize("url", ["http://127.0.0.1:9", "http://localhost:9"])
def test_the_default_plane_for_a_server_on_this_host_is_shm_and_the_report_says_why(routes, monkeypatch, url):
    monkeypatch.setenv("FAIRCAST_DS_SYNC_SECRET", "s" * 32)
    push = ServedPush(model(), url)
    assert routes == [("plane_route", "shm")]
    report = push.push(3)
    assert report.plane == push.plane == "shm"
    assert report.plane_choice == push.plane_choice and "runs on this host: shm" in report.plane_choice


def test_the_default_plane_for_a_server_on_another_host_is_net_and_the_report_says_why(routes, monkeypatch):
    monkeypatch.setenv("FAIRCAST_DS_SYNC_SECRET", "s" * 32)
    push = ServedPush(model(), "http://192.0.2.7:8000")  # TEST-NET-1: an address of no host here
    assert routes == [("plane_route", "net")]
    report = push.push(3)
    assert report.plane == "net" and "(192.0.2.7) is not on the host of every rank: net" in report.plane_choice


def test_without_a_shared_secret_the_default_for_a_server_on_this_host_is_tcp(routes, monkeypatch):
    monkeypatch.delenv("FAIRCAST_DS_SYNC_SECRET", raising=False)
    push = ServedPush(model(), "http://127.0.0.1:9")
    assert routes == [("tcp_route", None)]
    assert push.push(3).plane == "tcp" and "no shared secret" in push.plane_choice


def test_a_named_plane_is_taken_as_named_and_the_report_says_so(routes, monkeypatch):
    monkeypatch.setenv("FAIRCAST_DS_SYNC_SECRET", "s" * 32)
    for plane, route in (("tcp", "tcp_route"), ("shm", "plane_route"), ("net", "plane_route"), ("group", "plane_route")):
        routes.clear()
        push = ServedPush(model(), "http://192.0.2.7:8000", plane=plane)
        report = push.push(1)
        assert routes == [(route, None if plane == "tcp" else plane)]
        assert (report.plane, report.plane_choice, push.plane_choice) == (plane, None, None)


def test_an_option_of_another_plane_than_the_chosen_one_names_the_choice(routes, monkeypatch):
    monkeypatch.setenv("FAIRCAST_DS_SYNC_SECRET", "s" * 32)
    with pytest.raises(ValueError, match=r"port: not an option of plane 'shm' \(ServedPush chose it: the server"):
        ServedPush(model(), "http://127.0.0.1:9", port=29650)
