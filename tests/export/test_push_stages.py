"""Timing by stage (issue 32 item 1): every update's report says where its seconds went, on both ends,
and the bench prints it. A real sender and receiver on loopback (no vLLM); the assertions are about
which stages are measured, never how long they take."""
from __future__ import annotations

import secrets
import sys
import threading

import torch

from conftest import DIST

sys.path.insert(0, str(DIST))
from export_common import plain_model  # noqa: E402

from faircast_bench.model import format_stage_table, push_stages  # noqa: E402
from faircast_ds.export.source import Stages  # noqa: E402
from faircast_ds.export.sync import WeightReceiver, WeightSender  # noqa: E402

SECRET = secrets.token_hex(16)


def test_a_sync_reports_the_trainers_and_the_engines_stages():
    rx = WeightReceiver(plain_model(seed=99), port=0, timeout=10, secret=SECRET)
    reports = []

    def serve():
        rx.accept(timeout=10)
        while (r := rx.receive(timeout=10)) is not None:
            reports.append(r)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    model = plain_model(seed=0)
    sender = WeightSender(model, port=rx.port, timeout=10, secret=SECRET)
    dense = sender.sync(version=1)
    with torch.no_grad():
        next(model.parameters()).view(-1)[:3] += 1
    delta = sender.sync(version=2)
    sender.close()
    thread.join(10)
    rx.close()
    both = {"trainer.walk", "trainer.mac", "trainer.send", "trainer.wait_ack", "trainer.acknowledge",
            "engine.receive", "engine.mac", "engine.stage", "engine.other"}
    assert both <= set(dense.stages), sorted(dense.stages)
    assert both | {"trainer.encode"} <= set(delta.stages), sorted(delta.stages)
    assert "trainer.encode" not in dense.stages  # a dense sync encodes nothing
    assert dense.stages["trainer.mac"] > 0 and dense.stages["engine.mac"] > 0  # every frame is MACed, both ends
    assert all(v >= 0 for r in (dense, delta) for v in r.stages.values())
    # the receiver's own report carries the same engine stages it sent back
    assert {"receive", "mac", "stage"} <= set(reports[0].stages)


def test_stages_accumulate_and_count_http_calls():
    s = Stages()
    with s("http.start"):
        pass
    s.add("http.start", 0.5)
    s.add("trainer.walk", 0.25)
    assert s.seconds["http.start"] >= 0.5 and s.calls["http.start"] == 2 and s.http_calls() == 2


def test_the_bench_prints_a_row_per_stage():
    def push(seconds, stages, load):
        return {"seconds": seconds, "stages": stages, "engine": {"load_seconds": load}, "http_calls": 6,
                "collectives": 8}

    pushes = [push(3.0, {"http.update": 2.0}, 1.0), push(2.0, {"http.update": 1.5, "trainer.mac": 0.4}, 1.0),
              push(3.0, {}, 1.0), push(2.5, {"http.update": 1.6, "http.weight_checker": 0.5}, 1.1),
              push(1.0, {"trainer.encode": 0.3}, 0.2), push(3.0, {"trainer.encode": 0.5}, 0.4)]
    data = {"mode": "dither", "pushes": pushes}
    stages = push_stages(data)
    assert stages["dense, no check"]["trainer.mac"] == 0.4 and stages["dense, no check"]["engine.load"] == 1.0
    assert stages["delta (median)"]["trainer.encode"] == 0.4 and stages["delta (median)"]["push"] == 2.0
    table = format_stage_table([data])
    lines = table.splitlines()
    assert any(line.startswith("http.weight_checker") and "0.500" in line for line in lines)
    assert any(line.startswith("push (whole)") and "2.000" in line for line in lines)
    assert push_stages({"mode": "x", "pushes": [{"seconds": 1.0}] * 6}) == {}  # results from before stages
