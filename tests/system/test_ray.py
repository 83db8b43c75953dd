"""Ray, as OpenRLHF lays out a job (issue 24 item 7): two DeepSpeed ZeRO-3 ranks as Ray actors, the
``fair_cast`` section only in the job's runtime environment (``FAIRCAST_DS_CONFIG``), a vLLM engine as
a Ray actor with the ``faircast`` weight-transfer backend, and updates through vLLM's
``RayVLLMWeightSyncClient``: after a dense and two delta updates the engine computes with the served
bits, each element equal to the oracle's cast of DeepSpeed's fp32 master at that step
(``faircast_ds.casting.reference`` through tests/served_oracle.py), read back from the kernels by the actors'
own code (tests/dist/ray_actors.py).

One local Ray instance for the module (3 CPUs, an 80 MiB object store, no dashboard, loopback),
shut down at the end; every wait on an actor is bounded (``ray.get(..., timeout=...)``).
"""
from __future__ import annotations

import json
import secrets
import shutil
import sys
import tempfile

import pytest
import torch
from conftest import DIST, ROOT, free_port
from served_oracle import check_snapshot, rn_fraction

ray = pytest.importorskip("ray", reason="ray is installed by launch/setup.d/50-ray.sh")
sys.path.insert(0, str(DIST))
import ray_actors  # noqa: E402

SECTION = {"mode": "stochastic", "seed": 5}
START_S, STEP_S = 600, 300  # bounds on one actor call: start (DeepSpeed init, vLLM start) and one round


def canonical(bits: torch.Tensor) -> torch.Tensor:
    """bf16 bits with ±0 and subnormals as +0: the CPU kernels flush them, so they cannot be read back."""
    bits = bits.reshape(-1)
    return torch.where((bits & 0x7F80) == 0, torch.zeros_like(bits), bits)


def engine_differences(engine_bits: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    problems = sorted(set(engine_bits) ^ set(expected))
    problems = [f"{n}: only one side has it" for n in problems]
    for name, want in expected.items():
        if name not in engine_bits:
            continue
        got, want = canonical(engine_bits[name]), canonical(want)
        if got.shape != want.shape:
            problems.append(f"{name}: engine holds {tuple(got.shape)} elements, {tuple(want.shape)} expected")
            continue
        bad = int((got != want).sum())
        if bad:
            problems.append(f"{name}: {bad} of {want.numel()} elements differ from the oracle")
    return problems


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A local Ray instance with the job's runtime environment, the engine actor and two DeepSpeed rank
    actors; torn down (actors killed, Ray shut down) however the test ends."""
    from faircast_bench.builders import tiny_qwen3

    out = tmp_path_factory.mktemp("ray_job")
    engine_dir = out / "engine_model"
    tiny_qwen3(seed=1, **ray_actors.MODEL).save_pretrained(engine_dir)  # other weights than the trainer's: the dense update must replace all
    temp = tempfile.mkdtemp(prefix="fcray", dir="/tmp")  # Ray's socket paths must stay short
    env_vars = {"FAIRCAST_DS_CONFIG": json.dumps(SECTION), "FAIRCAST_DS_SYNC_SECRET": secrets.token_hex(16),
                "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "PYTHONPATH": f"{ROOT}:{DIST}", "PYTHONUNBUFFERED": "1"}
    ray.init(address="local", num_cpus=3, object_store_memory=80 << 20, include_dashboard=False,
             _node_ip_address="127.0.0.1", _temp_dir=temp, log_to_driver=False,
             runtime_env={"env_vars": env_vars})
    actors = []
    try:
        engine = ray.remote(num_cpus=1)(ray_actors.EngineActor).remote(str(engine_dir))
        port = free_port()
        ranks = [ray.remote(num_cpus=1)(ray_actors.TrainerRank).remote(r, 2, port) for r in range(2)]
        actors = [engine, *ranks]
        yield {"engine": engine, "ranks": ranks, "engine_dir": engine_dir}
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def on_all(ranks, method: str, *args, timeout: float = STEP_S):
    return ray.get([getattr(r, method).remote(*args) for r in ranks], timeout=timeout)


def test_ray_actors_engine_holds_served_bits_after_dense_and_delta_updates(job):
    engine, ranks = job["engine"], job["ranks"]
    infos = on_all(ranks, "build", timeout=START_S)
    for info in infos:  # the section reached every rank through the runtime environment only
        assert info == {"config_has_section": False, "attached": True, "origin": "FAIRCAST_DS_CONFIG",
                        "mode": "stochastic", "seed": 5, "zero_stage": 3}, info
    before = ray.get(engine.kernel_bits.remote(), timeout=START_S)
    on_all(ranks, "connect", engine, 120.0)

    kinds = []
    for step in (1, 2, 3):
        assert on_all(ranks, "step") == [step, step]
        snap = on_all(ranks, "snapshot")[0]
        expected = check_snapshot(snap, SECTION["mode"], SECTION["seed"])  # served bits == oracle's cast
        assert rn_fraction(snap) > 0.05  # the oracle's cast is telling apart from round-to-nearest
        if step == 1:  # the engine started from other weights: a dense update has to replace nearly all
            stale = sum(int((canonical(before[n]) != canonical(b)).sum()) for n, b in expected.items())
            assert stale > 0.9 * sum(b.numel() for b in expected.values()), stale
        reports = on_all(ranks, "push")
        assert reports[0] == reports[1]
        report = reports[0]
        kinds.append(report["kind"])
        assert report["version"] == step
        assert ray.get(engine.weight_version.remote(), timeout=STEP_S) == str(step)
        problems = engine_differences(ray.get(engine.kernel_bits.remote(), timeout=STEP_S), expected)
        assert not problems, f"after update {step} ({report['kind']}):\n" + "\n".join(problems[:20])
        if report["kind"] == "delta":  # a delta carries what changed, not the model
            assert 0 < report["changed"] < report["numel"], report
    assert kinds == ["dense", "delta", "delta"]
    tokens = ray.get(engine.generate.remote([[3, 4, 5, 6], [7, 8, 9, 10]], [1, 2], 4), timeout=STEP_S)
    assert [len(t) for t in tokens] == [4, 4]
    on_all(ranks, "close")
