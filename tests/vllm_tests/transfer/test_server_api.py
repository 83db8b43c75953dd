"""VllmServer's public face for vLLM's weight-transfer API: every endpoint a push drives is a method of
:class:`~faircast_ds.vllm.transfer.server.VllmServer` (the HTTP path and body are vLLM's own), and no module
of the package outside server.py posts through its private ``_post``. No server is started: ``requests.post``
is recorded."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from faircast_ds.vllm.transfer.server import ServerUnavailable, VllmServer

ROOT = Path(__file__).resolve().parents[3]


class Answer:
    def __init__(self, status: int = 200, body: bytes = b"") -> None:
        self.status_code, self.content, self.text = status, body, body.decode()

    def json(self):
        import json

        return json.loads(self.content)


@pytest.fixture
def posted(monkeypatch):
    import requests

    calls: list[tuple[str, object]] = []

    def post(url, json=None, timeout=None):
        calls.append((url, json))
        return Answer()

    monkeypatch.setattr(requests, "post", post)
    return calls


@pytest.mark.parametrize("call, path, body", [
    (lambda s: s.init_weight_transfer_engine({"plane": "shm", "port": 0}), "init_weight_transfer_engine",
     {"init_info": {"plane": "shm", "port": 0}}),
    (lambda s: s.start_weight_update(), "start_weight_update", None),
    (lambda s: s.update_weights({"version": 3, "check": "sampled"}), "update_weights",
     {"update_info": {"version": 3, "check": "sampled"}}),
    (lambda s: s.finish_weight_update("3"), "finish_weight_update", {"weight_version": "3"}),
    (lambda s: s.finish_weight_update(), "finish_weight_update", None),
    (lambda s: s.update_weight_version("4"), "update_weight_version", {"new_version": "4"}),
    (lambda s: s.shutdown_weight_transfer_engine(), "shutdown_weight_transfer_engine", None),
    (lambda s: s.reset_prefix_cache(), "reset_prefix_cache", None),
])
def test_each_weight_transfer_route_posts_vllms_path_and_body(posted, call, path, body):
    call(VllmServer(url="http://127.0.0.1:9/"))
    assert posted == [(f"http://127.0.0.1:9/{path}", body)]


def test_abandoning_a_session_a_dead_trainer_left_open_is_an_abandon_update_then_a_finish(posted):
    VllmServer(url="http://h:1").abandon_weight_update()
    assert posted == [("http://h:1/update_weights", {"update_info": {"abandon": True}}),
                      ("http://h:1/finish_weight_update", None)]


def test_a_refused_route_raises_with_its_path_and_status(monkeypatch):
    import requests

    monkeypatch.setattr(requests, "post", lambda url, json=None, timeout=None: Answer(400, b"no session"))
    with pytest.raises(ServerUnavailable, match=r"POST /start_weight_update: HTTP 400: no session"):
        VllmServer(url="http://h:1").start_weight_update()


def private_post_calls(source: str) -> list[int]:
    """Lines where code calls a ``._post`` attribute."""
    return [n.lineno for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "_post"]


def test_the_private_post_scan_finds_one():
    assert private_post_calls("x = 1\nself.server._post('update_weights', {})\n") == [2]
    assert private_post_calls("self.server.update_weights({})\ngetattr(c, '_post')\n") == []


def test_no_module_outside_server_py_posts_through_vllm_servers_private_post():
    offenders = [f"{path.relative_to(ROOT)}:{line}" for path in sorted((ROOT / "faircast_ds").rglob("*.py"))
                 if path.name != "server.py" or path.parent.name != "transfer"
                 for line in private_post_calls(path.read_text())]
    assert not offenders, "call VllmServer's public methods:\n" + "\n".join(offenders)


def test_the_root_exports_servedpush_and_vllmserver_lazily():
    """``from faircast_ds import ServedPush, VllmServer`` gives the push's classes; ``import faircast_ds`` alone
    loads neither their modules nor vLLM (a fresh interpreter, so this suite's imports do not count)."""
    import subprocess
    import sys

    code = ("import sys, faircast_ds\n"
            "assert not [m for m in sys.modules if m.startswith('faircast_ds.vllm') or m == 'vllm'], sys.modules\n"
            "from faircast_ds import ServedPush, VllmServer\n"
            "from faircast_ds.vllm.transfer import served_push, server\n"
            "assert ServedPush is served_push.ServedPush and VllmServer is server.VllmServer\n"
            "assert {'ServedPush', 'VllmServer'} <= set(faircast_ds.__all__)\n"
            "assert 'vllm' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


class _Started(Exception):
    """Raised by the stand-in Popen: the server process is not started."""


@pytest.fixture
def server_env(monkeypatch, tmp_path):
    """The environment VllmServer hands its server process (Popen recorded, nothing started)."""
    from faircast_ds.vllm.transfer import server as module

    (tmp_path / "config.json").write_text("{}")
    for name in ("FAIRCAST_VLLM_CPU_GEMM", "FAIRCAST_VLLM_CPU_GEMM_CACHE", "FAIRCAST_VLLM_SPIN_S"):
        monkeypatch.delenv(name, raising=False)
    seen = {}

    def popen(cmd, **kw):
        seen.update(kw["env"])
        raise _Started

    monkeypatch.setattr(module.subprocess, "Popen", popen)

    def start(**kw):
        seen.clear()
        with pytest.raises(_Started):
            VllmServer(tmp_path, log_path=tmp_path / "server.log", **kw)
        return dict(seen)

    return start


def test_the_server_process_gets_the_products_copies_and_spin_it_is_given(server_env):
    env = server_env(gemm="fp32", gemm_cache=True, spin_s=0)
    assert (env["FAIRCAST_VLLM_CPU_GEMM"], env["FAIRCAST_VLLM_CPU_GEMM_CACHE"], env["FAIRCAST_VLLM_SPIN_S"]) == \
        ("fp32", "1", "0.0")
    env = server_env()  # the defaults: vLLM's products, no copies, vLLM's spin
    assert (env["FAIRCAST_VLLM_CPU_GEMM"], env["FAIRCAST_VLLM_CPU_GEMM_CACHE"]) == ("native", "0")
    assert "FAIRCAST_VLLM_SPIN_S" not in env


def test_spin_none_is_vllms_own_whatever_this_process_exported(server_env, monkeypatch):
    monkeypatch.setenv("FAIRCAST_VLLM_SPIN_S", "0")
    monkeypatch.setenv("FAIRCAST_VLLM_CPU_GEMM_CACHE", "1")
    env = server_env()
    assert "FAIRCAST_VLLM_SPIN_S" not in env and env["FAIRCAST_VLLM_CPU_GEMM_CACHE"] == "0"
    assert server_env(spin_s=0.5)["FAIRCAST_VLLM_SPIN_S"] == "0.5"


@pytest.mark.parametrize("kw, message", [
    ({"gemm_cache": True}, "gemm_cache is True \\(with gemm='fp32'\\) or False, not True with gemm='native'"),
    ({"gemm": "fp32", "gemm_cache": 1}, "gemm_cache is True"),
    ({"spin_s": -1}, "spin_s is a number of seconds >= 0 or None, not -1"),
    ({"spin_s": True}, "spin_s is a number of seconds >= 0 or None, not True"),
    ({"spin_s": float("inf")}, "spin_s is a number of seconds >= 0 or None, not inf"),
])
def test_bad_engine_settings_are_named_before_anything_starts(tmp_path, kw, message):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"VllmServer: {message}"):
        VllmServer(tmp_path, log_path=tmp_path / "server.log", **kw)
    assert not (tmp_path / "server.log").exists()
