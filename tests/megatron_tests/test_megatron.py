"""Fair Cast for Megatron-Core's DistributedOptimizer (faircast_ds.megatron) and
patches/megatron-core-0.16.1-fair-cast.patch.

Unit tests run on a hand-built stand-in of the optimizer's range bookkeeping (no Megatron needed).
With megatron-core 0.16.1 installed, the real DDP + DistributedOptimizer runs on 2 CPU ranks over gloo
(tests/dist/megatron_cpu.py stands in for three CUDA-only calls that are not on the cast path), once
on the runtime route and once on a patched copy of Megatron-Core, and the served bits are compared.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import DIST, ROOT, cpu_env, free_port, run_logged

from faircast_ds.casting.bits import bf16_bits
from faircast_ds.casting.rules import cast
from faircast_ds.config.section import FairCastConfig
from faircast_ds.megatron.adapters import MegatronAdapter
from faircast_ds.megatron.shards import low_precision_shards, param_shard
from faircast_ds.shard.caster import ShardCaster

PATCH = ROOT / "patches" / "megatron-core-0.16.1-fair-cast.patch"


def megatron_dir() -> Path | None:
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0])
    return path if (path / "core" / "optimizer" / "distrib_optimizer.py").exists() else None


def megatron_version() -> str | None:
    path = megatron_dir()
    if path is None:
        return None
    scope: dict = {}
    exec((path / "core" / "package_info.py").read_text(), scope)
    return scope["__version__"]


needs_megatron = pytest.mark.skipif(megatron_version() != "0.16.1",
                                    reason="needs megatron-core 0.16.1 (pip install megatron-core==0.16.1)")


def R(start: int, end: int) -> SimpleNamespace:  # noqa: N802 - Megatron's Range: start, end, size
    return SimpleNamespace(start=start, end=end, size=end - start)


class FakeDistributedOptimizer:
    """The bookkeeping a DistributedOptimizer keeps for rank 1 of 2, over one bucket of 64 elements:
    ``w`` (6x5, buffer [0, 30)) and ``b`` (5, buffer [30, 35)) in bf16, ``s`` (3, buffer [35, 38)) in fp32;
    rank 1 owns buffer [32, 64): the last 3 of ``b`` and all of ``s`` (the rest is padding)."""

    def __init__(self) -> None:
        self.w = torch.nn.Parameter(torch.zeros(6, 5, dtype=torch.bfloat16))
        self.b = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
        self.s = torch.nn.Parameter(torch.zeros(3))
        self.param_data = torch.zeros(64, dtype=torch.bfloat16)
        self.fp32_data = torch.zeros(64)
        self.is_stub_optimizer = False
        self.model_float16_groups = [[self.b]]
        self.model_fp32_groups = [[self.s]]
        self.main_b = torch.tensor([0.1234567, -2.5e-3, 7.77], dtype=torch.float32)
        self.main_s = torch.tensor([1.0 + 2**-20, 2.0, 3.0])
        self.shard_fp32_from_float16_groups = [[self.main_b]]
        self.shard_fp32_groups = [[self.main_s]]
        self.model_param_gbuf_map = {self.b: (0, "bf16", 0), self.s: (1, "fp32", 0)}
        self.gbuf_ranges = [
            {"bf16": [{"param_map": {self.b: {"param": R(2, 5), "gbuf_world_in_bucket": R(32, 35)}}}]},
            {"fp32": [{"param_map": {self.s: {"param": R(0, 3), "gbuf_world_in_bucket": R(35, 38)}}}]},
        ]
        self.buffers = [SimpleNamespace(buckets=[SimpleNamespace(param_data=self.param_data)]),
                        SimpleNamespace(buckets=[SimpleNamespace(param_data=self.fp32_data)])]
        self.names = {self.w: "layer.weight", self.b: "layer.bias", self.s: "scale"}


def test_shard_ranges_map_to_parameter_names_and_indices():
    opt = FakeDistributedOptimizer()
    ((shard, main, served),) = list(low_precision_shards(opt, opt.names))
    got = (shard.name, shard.start, shard.numel, shard.buffer, shard.bucket, shard.offset)
    assert got == ("layer.bias", 2, 3, 0, 0, 32)
    assert shard.key == ("layer.bias", 2)
    assert [(s.name, s.start, s.numel, s.offset) for s in shard.slices()] == [("layer.bias", 2, 3, 0)]
    assert main is opt.main_b
    assert served.data_ptr() == opt.param_data[32:].data_ptr() and served.numel() == 3  # a view, not a copy
    with pytest.raises(ValueError, match="differ in length"):
        param_shard("x", R(0, 4), R(10, 13), 0, 0)


def test_runtime_refresh_casts_into_the_param_buffer_and_copies_fp32():
    opt = FakeDistributedOptimizer()
    adapter = MegatronAdapter(opt, ShardCaster(FairCastConfig(mode="stochastic", seed=9)), opt.names)
    adapter.install()
    assert opt._copy_main_params_to_model_params == adapter.refresh
    for step in (1, 2, 3):
        opt._copy_main_params_to_model_params()
        want = cast(opt.main_b, "stochastic", seed=9, step=step, name="layer.bias", start=2)
        assert torch.equal(bf16_bits(opt.param_data[32:35]), bf16_bits(want))
    assert torch.equal(opt.fp32_data[35:38], opt.main_s)  # fp32 parameters: copied exactly
    assert not opt.param_data[:32].any() and not opt.param_data[35:].any()  # nothing outside the owned range
    assert adapter.local_numel() == 3 and adapter.caster.step == 3


def test_error_feedback_residual_is_per_shard():
    opt = FakeDistributedOptimizer()
    adapter = MegatronAdapter(opt, ShardCaster(FairCastConfig(mode="error_feedback")), opt.names)
    adapter.install()
    residual = torch.zeros(3)
    for _ in range(4):
        opt._copy_main_params_to_model_params()
        want = cast(opt.main_b, "error_feedback", seed=0, step=0, name="layer.bias", start=2, residual=residual)
        assert torch.equal(bf16_bits(opt.param_data[32:35]), bf16_bits(want))
    assert torch.equal(adapter.caster.residuals[("layer.bias", 2)], residual)


@pytest.fixture(scope="module")
def patched_megatron(tmp_path_factory) -> Path:
    path = megatron_dir()
    if path is None or megatron_version() != "0.16.1":
        pytest.skip("needs megatron-core 0.16.1 installed")
    site = tmp_path_factory.mktemp("patched_megatron")
    shutil.copytree(path, site / "megatron")
    for dry_run in (True, False):
        if shutil.which("patch"):
            cmd = ["patch", "-p1", "--forward", "-d", str(site), "-i", str(PATCH)] + (["--dry-run"] if dry_run else [])
        else:  # git apply works outside a repository too
            cmd = ["git", "apply", *(["--check"] if dry_run else []), str(PATCH)]
        proc = subprocess.run(cmd, cwd=site, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


def load_param_cast(site: Path):
    spec = importlib.util.spec_from_file_location("megatron.core.optimizer.param_cast",
                                                  site / "megatron/core/optimizer/param_cast.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports torch only
    return module


def test_patch_applies_and_routes_the_copy_through_one_hook_call(patched_megatron):
    source = (patched_megatron / "megatron/core/optimizer/distrib_optimizer.py").read_text()
    calls = re.findall(r"(?<![\w.])copy_main_params_to_model_params\(", source)
    assert len(calls) == 2  # the main->model copy and the MXFP8 param-buffer copy
    assert "shard_model_param.data.copy_(shard_main_param)" not in source
    param_cast = load_param_cast(patched_megatron)
    main, dst = torch.tensor([1.0 + 2**-9, 3.0]), torch.zeros(2, dtype=torch.bfloat16)
    shard = param_cast.MainParamShard(torch.nn.Parameter(torch.zeros(2)), R(0, 2), main, dst)
    param_cast.copy_main_params_to_model_params("opt", [shard])
    assert torch.equal(dst, main.to(torch.bfloat16))
    calls = []
    assert param_cast.set_main_param_cast_hook(lambda o, s: calls.append((o, len(s))) or False) is None
    param_cast.copy_main_params_to_model_params("opt", [shard, shard])
    assert calls == [("opt", 2)]
    param_cast.set_main_param_cast_hook(None)


def test_hook_route_casts_routed_optimizers_and_passes_others_on(patched_megatron, monkeypatch):
    from faircast_ds.megatron import hook

    param_cast = load_param_cast(patched_megatron)
    monkeypatch.setitem(sys.modules, "megatron.core.optimizer.param_cast", param_cast)
    monkeypatch.setattr(hook, "_installed", {})
    from faircast_ds.shard.routes import ROUTES, Route

    try:
        opt, other = FakeDistributedOptimizer(), FakeDistributedOptimizer()
        adapter = MegatronAdapter(opt, ShardCaster(FairCastConfig(mode="dither", seed=4)), opt.names)
        ROUTES.add(opt, Route(adapter, hook.ROUTE))
        hook.connect(adapter)
        shards = [param_cast.MainParamShard(opt.b, R(2, 5), opt.main_b, opt.param_data[32:35]),
                  param_cast.MainParamShard(opt.s, R(0, 3), opt.main_s, opt.fp32_data[35:38])]
        param_cast.copy_main_params_to_model_params(opt, shards)
        want = cast(opt.main_b, "dither", seed=4, step=1, name="layer.bias", start=2)
        assert torch.equal(bf16_bits(opt.param_data[32:35]), bf16_bits(want)) and adapter.caster.step == 1
        assert torch.equal(opt.fp32_data[35:38], opt.main_s)
        # an optimizer nobody routed keeps Megatron's copy
        param_cast.copy_main_params_to_model_params(other, [param_cast.MainParamShard(
            other.b, R(2, 5), other.main_b, other.param_data[32:35])])
        assert torch.equal(other.param_data[32:35], other.main_b.to(torch.bfloat16))
        adapter.install()  # the runtime route too: refused, rather than casting twice
        with pytest.raises(RuntimeError, match="cast twice"):
            param_cast.copy_main_params_to_model_params(opt, shards)
    finally:
        param_cast.set_main_param_cast_hook(None)


@needs_megatron
def test_unsupported_megatron_setups_are_refused():
    from faircast_ds.megatron import attach
    from faircast_ds.shard.adapter import UnsupportedSetupError

    with pytest.raises(UnsupportedSetupError, match="only DistributedOptimizer"):
        attach(FakeDistributedOptimizer(), {"mode": "stochastic"}, route="runtime")
    assert attach(FakeDistributedOptimizer(), {"enabled": False}) is None
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    unsupported = object.__new__(DistributedOptimizer)  # the checks read only the configs and the chunks
    unsupported.config = SimpleNamespace(bf16=False, fp16=True, use_precision_aware_optimizer=True,
                                         optimizer_cpu_offload=False, fp8_recipe="mxfp8",
                                         reuse_grad_buf_for_mxfp8_param_ag=False)
    unsupported.ddp_config = SimpleNamespace(use_megatron_fsdp=True)
    # two chunks whose parameters have one name (not a virtual pipeline's, whose layer numbers are global):
    # the noise id would not name one element
    unsupported.model_chunks = [torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)]
    with pytest.raises(UnsupportedSetupError) as refused:
        attach(unsupported, {"mode": "stochastic"}, route="runtime")
    for setting in ("bf16=True", "use_precision_aware_optimizer", "fp8", "use_megatron_fsdp", "one full parameter"):
        assert setting in str(refused.value), setting


@pytest.fixture(scope="module")
def megatron_runs(patched_megatron, tmp_path_factory):
    """tests/dist/megatron_worker.py on 2 CPU ranks: the runtime route and the hook route, side by side."""
    runs = {route: tmp_path_factory.mktemp(f"megatron_{route}") for route in ("runtime", "hook")}

    def launch(route: str) -> None:
        path = [str(patched_megatron), str(ROOT)] if route == "hook" else [str(ROOT)]
        env = cpu_env(ROUTE=route, OUT_DIR=str(runs[route]), PYTHONPATH=os.pathsep.join(path))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(DIST / "megatron_worker.py")]
        run_logged(cmd, runs[route] / "launch.log", env=env, timeout=600)

    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(launch, r) for r in runs]:
            done.result()
    return runs


def _reports(runs, route):
    return [json.loads((runs[route] / f"report_rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_megatron_served_bits_are_the_cast_of_the_fp32_shards(megatron_runs, patched_megatron):
    for route in ("runtime", "hook"):
        reports = _reports(megatron_runs, route)
        assert reports[0]["megatron_file"].startswith(str(patched_megatron)) == (route == "hook")
        assert any(r["cases"]["stochastic"]["split_param"] for r in reports), "no parameter was cut between ranks"
        for r in reports:
            for mode, case in r["cases"].items():
                assert case["exact_replay"], f"{route}/{mode}: a rank's shard is not cast(main shard)"
                assert case["full_is_cast_of_full_master"], f"{route}/{mode}: gathered bits depend on the sharding"
                if mode == "megatron":
                    continue
                assert case["caster_step"] == 3 and case["route"] == route
                assert case["replaced_at_runtime"] == (route == "runtime")
                assert case["hook_calls"] == (3 if route == "hook" else 0), (route, mode, case)
        # stochastic changes more served weights per step than round-to-nearest at this learning rate
        c = reports[0]["cases"]
        assert min(c["stochastic"]["changed"][1:]) > 2 * max(c["nearest"]["changed"][1:]), c


@pytest.mark.slow
def test_megatron_routes_agree_and_nearest_is_megatrons_own_copy(megatron_runs):
    runtime = torch.load(megatron_runs["runtime"] / "bits.pt")
    hook = torch.load(megatron_runs["hook"] / "bits.pt")
    assert runtime.keys() == hook.keys()
    for mode in runtime:
        for step, (a, b) in enumerate(zip(runtime[mode], hook[mode]), start=1):
            for name in a:
                assert torch.equal(a[name], b[name]), f"{mode} step {step}: {name}"
    for a, b in zip(runtime["nearest"], runtime["megatron"]):  # Fair Cast's nearest is Megatron's copy, bit for bit
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], b[n]) for a, b in zip(runtime["stochastic"], runtime["nearest"]) for n in a)
    losses = {route: {m: c["losses"] for m, c in _reports(megatron_runs, route)[0]["cases"].items()}
              for route in ("runtime", "hook")}
    assert losses["runtime"] == losses["hook"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stochastic", "error_feedback"])
def test_megatron_checkpoint_resumes_bitwise(megatron_runs, mode):
    """Fair Cast's entry in Megatron-Core's dist_checkpointing (faircast_ds.megatron.checkpoint): fresh objects
    loading the step-3 checkpoint serve the saved bits and take steps 4-6 exactly as the run that never
    stopped (served copy, main params, residual, on both ranks); without the entry error_feedback is refused
    and stochastic recovers from (mode, seed, step); with the residual back at zero the run diverges."""
    for rank in (0, 1):
        case = json.loads((megatron_runs["runtime"] / f"checkpoint_rank{rank}.json").read_text())[mode]
        assert case["restored_equal_saved"], (rank, case)
        assert case["continued_equal"] == [True, True, True], (rank, case)
        if mode == "error_feedback":
            assert case["residual_nonzero"] > 500, case  # the comparison covers a real residual
            assert not case["without_entry"]["ok"] and "on_missing_state" in case["without_entry"]["message"]
            assert not case["zero_residual_continued_equal"], "a zero residual must show: the test would not see a loss"
        else:
            assert case["without_entry"] == {"ok": True, "continued_equal": True}, case
