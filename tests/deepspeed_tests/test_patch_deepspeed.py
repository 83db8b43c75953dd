"""patches/deepspeed-0.19.8-fair-cast.patch: it applies to the installed DeepSpeed, its cast hook and
``fair_cast`` config behave as documented, ``faircast_ds.deepspeed.hook`` routes refreshes through it, and a
patched copy of DeepSpeed serves bitwise the same weights as the runtime route for ZeRO-1, ZeRO-2
(with CPU offload), ZeRO-3 and BF16_Optimizer — after training steps and after a load refresh.

The patch is applied to a copy of the installed package in a temporary folder; the installed
DeepSpeed is never modified.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import DIST, ROOT, cpu_env, deepspeed_launch

from faircast_ds.casting.bits import bf16_bits
from faircast_ds.casting.rules import cast
from faircast_ds.shard.routes import ROUTES, Route

PATCH = ROOT / "patches" / "deepspeed-0.19.8-fair-cast.patch"
TOUCHED = ["deepspeed/runtime/bf16_optimizer.py", "deepspeed/runtime/config.py", "deepspeed/runtime/lp_cast.py",
           "deepspeed/runtime/zero/stage3.py", "deepspeed/runtime/zero/stage_1_and_2.py"]


def installed_deepspeed() -> Path:
    spec = importlib.util.find_spec("deepspeed")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent


def apply_patch(site: Path, *, dry_run: bool) -> subprocess.CompletedProcess:
    if shutil.which("patch"):
        cmd = ["patch", "-p1", "--forward", "-d", str(site), "-i", str(PATCH)] + (["--dry-run"] if dry_run else [])
    else:  # git apply works outside a repository too
        cmd = ["git", "apply", *(["--check"] if dry_run else []), str(PATCH)]
    return subprocess.run(cmd, cwd=site, capture_output=True, text=True)


@pytest.fixture(scope="module")
def patched_site(tmp_path_factory) -> Path:
    """A folder holding a patched copy of the installed ``deepspeed`` package (mtimes kept, so the
    untouched modules' bytecode caches stay valid)."""
    import deepspeed

    if deepspeed.__version__ != "0.19.8":
        pytest.skip(f"the patch is for DeepSpeed 0.19.8, installed {deepspeed.__version__}")
    site = tmp_path_factory.mktemp("patched_site")
    shutil.copytree(installed_deepspeed(), site / "deepspeed")
    for dry_run in (True, False):
        proc = apply_patch(site, dry_run=dry_run)
        assert proc.returncode == 0, f"{'dry run' if dry_run else 'apply'} failed:\n{proc.stdout}\n{proc.stderr}"
    return site


def load_lp_cast(site: Path):
    """The patch's new module, loaded from the copy (it imports only the installed DeepSpeed's config_utils)."""
    spec = importlib.util.spec_from_file_location("deepspeed.runtime.lp_cast", site / "deepspeed/runtime/lp_cast.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_patch_touches_only_the_cast_sites_and_applies_both_ways(patched_site, tmp_path):
    files = [line.split(" b/", 1)[1] for line in PATCH.read_text().splitlines() if line.startswith("diff --git ")]
    assert files == TOUCHED
    for path in TOUCHED:  # applied: the copy now differs from the installed package exactly there
        original = installed_deepspeed().parent / path
        assert not original.exists() or original.read_text() != (patched_site / path).read_text()
    if shutil.which("git"):  # the README's other way: git apply
        shutil.copytree(installed_deepspeed() / "runtime", tmp_path / "deepspeed" / "runtime")
        proc = subprocess.run(["git", "apply", "--check", str(PATCH)], cwd=tmp_path, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    # every refresh site named in the guide goes through the hook; no fp32 -> lp copy_ is left at them
    def code(path: str) -> str:  # without comment lines (DeepSpeed keeps an old cast in one)
        lines = (patched_site / path).read_text().splitlines()
        return "\n".join(line for line in lines if not line.lstrip().startswith("#"))

    stage3 = code("deepspeed/runtime/zero/stage3.py")
    stage12 = code("deepspeed/runtime/zero/stage_1_and_2.py")
    bf16 = code("deepspeed/runtime/bf16_optimizer.py")
    assert stage3.count("cast_hp_to_lp(") == 4 and "fp16_param.data.copy_(fp32_param.data)" not in stage3
    assert stage12.count("cast_hp_to_lp(") == 3
    assert "bit16_partitions[partition_id].data.copy_(fp32_partition" not in stage12
    assert bf16.count("cast_hp_to_lp(") == 1 and "update_lp_params(after_step=True)" in bf16


def test_default_is_the_plain_copy_and_a_hook_takes_or_declines(patched_site):
    lp_cast = load_lp_cast(patched_site)
    hp = torch.tensor([1.0 + 2.0**-9, -3.3, 1e-3], dtype=torch.float32)
    lp = torch.zeros(3, dtype=torch.bfloat16)
    lp_cast.cast_hp_to_lp(lp, hp, optimizer=None, group_index=0)
    assert torch.equal(lp, hp.to(torch.bfloat16))
    seen = []

    def hook(lp_, hp_, context):
        seen.append(context)
        if context.group_index == 1:
            return False  # declined: DeepSpeed copies
        lp_.fill_(7.0)
        return True

    assert lp_cast.set_lp_cast_hook(hook) is None
    try:
        lp_cast.cast_hp_to_lp(lp, hp, optimizer="opt", group_index=0, partition_id=1, after_step=False)
        assert torch.equal(lp, torch.full((3,), 7.0, dtype=torch.bfloat16))
        lp_cast.cast_hp_to_lp(lp, hp, optimizer="opt", group_index=1)
        assert torch.equal(lp, hp.to(torch.bfloat16))
    finally:
        assert lp_cast.set_lp_cast_hook(None) is hook
    assert [(c.optimizer, c.group_index, c.partition_id, c.after_step) for c in seen] == [
        ("opt", 0, 1, False), ("opt", 1, None, True)]


def test_fair_cast_section_is_parsed_natively(patched_site):
    lp_cast = load_lp_cast(patched_site)
    assert lp_cast.get_fair_cast_config({}).enabled is False
    cfg = lp_cast.get_fair_cast_config({"fair_cast": {"mode": "dither", "seed": 3, "diagnostics": {"every": 0}}})
    assert (cfg.enabled, cfg.mode, cfg.seed) == (True, "dither", 3)
    assert cfg.model_extra == {"diagnostics": {"every": 0}}  # faircast's own keys pass through to it
    from pydantic import ValidationError

    for bad in ({"seed": -1}, {"enabled": "maybe"}, {"mode": 3}):
        with pytest.raises(ValidationError):
            lp_cast.get_fair_cast_config({"fair_cast": bad})


class _OneGroup:
    """A minimal adapter over one flat shard holding two parameters (what the real adapters describe)."""

    def __init__(self, optimizer, caster):
        from faircast_ds.shard.caster import ShardSlice

        self.optimizer, self.caster = optimizer, caster
        self.master = torch.linspace(-1, 1, 10, dtype=torch.float32) * 0.0371
        self.slices = [ShardSlice("a.weight", 4, 6, 0), ShardSlice("b.bias", 0, 4, 6)]

    def flat_groups(self):
        yield 0, self.master, torch.zeros(10, dtype=torch.bfloat16), self.slices

    def group_slices(self, key):
        return self.slices

    def previous(self, key):
        return None


def test_patched_route_casts_routed_optimizers_and_passes_others_on(patched_site, monkeypatch):
    from faircast_ds.config.section import FairCastConfig
    from faircast_ds.deepspeed import hook as patched
    from faircast_ds.shard.caster import ShardCaster

    lp_cast = load_lp_cast(patched_site)
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.lp_cast", lp_cast)
    monkeypatch.setattr(patched, "_installed", {})
    assert patched.deepspeed_has_cast_hook()
    earlier = []
    lp_cast.set_lp_cast_hook(lambda lp, hp, c: earlier.append(c.optimizer) or False)
    try:
        class Opt:
            pass

        mine, other = Opt(), Opt()
        adapter = _OneGroup(mine, ShardCaster(FairCastConfig(mode="stochastic", seed=5)))
        ROUTES.add(mine, Route(adapter, patched.ROUTE))
        patched.connect(adapter)
        assert ROUTES.get(mine).adapter is adapter and ROUTES.get(other) is None
        lp = torch.zeros(10, dtype=torch.bfloat16)
        for step in (1, 2):
            lp_cast.cast_hp_to_lp(lp, adapter.master, optimizer=mine, group_index=0, after_step=True)
            want = torch.cat([cast(adapter.master[:6], "stochastic", seed=5, step=step, name="a.weight", start=4),
                              cast(adapter.master[6:], "stochastic", seed=5, step=step, name="b.bias", start=0)])
            assert torch.equal(bf16_bits(lp), bf16_bits(want)) and adapter.caster.step == step
        lp_cast.cast_hp_to_lp(lp, adapter.master, optimizer=mine, group_index=0, after_step=False)
        assert adapter.caster.step == 2  # a load refresh casts at the current step
        lp_cast.cast_hp_to_lp(lp, adapter.master, optimizer=other, group_index=0)
        assert torch.equal(lp, adapter.master.to(torch.bfloat16)) and earlier == [other]
        ROUTES.remove(mine)
        lp_cast.cast_hp_to_lp(lp, adapter.master * 2, optimizer=mine, group_index=0)
        assert torch.equal(lp, (adapter.master * 2).to(torch.bfloat16))
    finally:
        lp_cast.set_lp_cast_hook(None)


def test_second_route_on_the_same_optimizer_is_refused(patched_site, monkeypatch):
    from faircast_ds.config.section import FairCastConfig
    from faircast_ds.deepspeed import attachment as runtime
    from faircast_ds.deepspeed import hook as patched
    from faircast_ds.shard.caster import ShardCaster

    lp_cast = load_lp_cast(patched_site)
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.lp_cast", lp_cast)
    monkeypatch.setattr(patched, "_installed", {})
    try:
        opt = object.__new__(type("Opt", (), {}))
        adapter = _OneGroup(opt, ShardCaster(FairCastConfig(mode="dither")))
        ROUTES.add(opt, Route(adapter, patched.ROUTE))
        patched.connect(adapter)
        lp = torch.zeros(10, dtype=torch.bfloat16)
        lp_cast.cast_hp_to_lp(lp, adapter.master, optimizer=opt, group_index=0)
        assert adapter.caster.step == 1 and torch.equal(bf16_bits(lp), bf16_bits(
            torch.cat([cast(adapter.master[:6], "dither", seed=0, step=0, name="a.weight", start=4),
                       cast(adapter.master[6:], "dither", seed=0, step=0, name="b.bias", start=0)])))
        # what faircast_ds.attach (the runtime route) would register for the same optimizer: refused
        with pytest.raises(RuntimeError, match="cast twice"):
            ROUTES.add(opt, Route(_OneGroup(opt, adapter.caster), runtime.ROUTE))
        assert ROUTES.get(opt).adapter is adapter
    finally:
        lp_cast.set_lp_cast_hook(None)


def test_unpatched_deepspeed_has_no_hook():
    from faircast_ds.deepspeed import hook as patched
    from faircast_ds.shard.adapter import UnsupportedSetupError

    if "deepspeed.runtime.lp_cast" in sys.modules or importlib.util.find_spec("deepspeed.runtime.lp_cast"):
        pytest.skip("the installed DeepSpeed is already patched")
    assert not patched.deepspeed_has_cast_hook()
    with pytest.raises(UnsupportedSetupError, match="no cast hook"):
        patched.connect(_OneGroup(object(), None))


def test_native_config_reaches_deepspeedconfig(patched_site):
    code = ("from deepspeed.runtime.config import DeepSpeedConfig as C\n"
            "c = C({'train_micro_batch_size_per_gpu': 1,\n"
            "       'fair_cast': {'mode': 'dither', 'seed': 3}}).fair_cast_config\n"
            "assert (c.enabled, c.mode, c.seed) == (True, 'dither', 3), c\n"
            "assert C({'train_micro_batch_size_per_gpu': 1}).fair_cast_config.enabled is False\n"
            "try:\n    C({'train_micro_batch_size_per_gpu': 1, 'fair_cast': {'seed': -1}})\n"
            "except Exception as e:\n    print('refused', type(e).__name__)\n")
    env = cpu_env(FAIRCAST_DS_AUTOLOAD="0", PYTHONPATH=os.pathsep.join([str(patched_site), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused ValidationError" in proc.stdout


@pytest.fixture(scope="module")
def route_runs(patched_site, tmp_path_factory):
    """One launch per route (2 CPU ranks), each running every case of tests/dist/patch_worker.py. The
    two run side by side: most of a launch's wall time is imports and waiting, not arithmetic."""
    runs = {route: tmp_path_factory.mktemp(f"patch_{route}") for route in ("runtime", "patched")}
    envs = {"runtime": {"ROUTE": "runtime"},
            "patched": {"ROUTE": "patched", "FAIRCAST_DS_AUTOLOAD": "0",
                        "PYTHONPATH": os.pathsep.join([str(patched_site), str(ROOT)])}}
    with ThreadPoolExecutor(2) as pool:
        launches = [pool.submit(deepspeed_launch, DIST / "patch_worker.py", 2, runs[r], **envs[r]) for r in runs]
        for launch in launches:
            launch.result()
    return runs


def _report(runs, route, rank=0):
    return json.loads((runs[route] / f"report_rank{rank}.json").read_text())


@pytest.mark.slow
def test_patched_launch_used_the_patched_copy_and_no_runtime_wrapping(route_runs, patched_site):
    for rank in (0, 1):
        r = _report(route_runs, "patched", rank)
        assert r["deepspeed_file"].startswith(str(patched_site)) and r["has_hook"]
        assert not r["engine_init_hooked"], "FAIRCAST_DS_AUTOLOAD=0 should keep the runtime route off"
        assert r["default_is_rn"], "an engine nobody attached must keep DeepSpeed's round-to-nearest copy"
        for case, c in r["cases"].items():
            if case.startswith("coexist/"):  # runtime route on the patched DeepSpeed: the hook stays out
                assert c["runtime_wrapped"] and not c["routed"] and not any(c["hook_calls"].values()), (case, c)
            else:
                assert c["routed"] and not c["runtime_wrapped"], (case, c)
                assert c["native_mode"] == case.split("/")[1], "DeepSpeed did not parse fair_cast itself"
                # one refresh per flat group after each of the 3 steps, and one per group on the load
                assert c["hook_calls"]["after_step"] == 3 * c["hook_calls"]["load"] > 0, (case, c)
            assert c["caster_step"] == 3


@pytest.mark.slow
def test_patched_deepspeed_serves_the_runtime_routes_bits(route_runs):
    runtime = torch.load(route_runs["runtime"] / "bits.pt")
    patched = torch.load(route_runs["patched"] / "bits.pt")
    assert set(patched) == set(runtime) | {f"coexist/{c}" for c in ("zero2/error_feedback", "zero3/error_feedback")}
    compared = 0
    for case, got in patched.items():
        want = runtime[case.removeprefix("coexist/")]
        for step, (g, w) in enumerate(zip(got["steps"], want["steps"]), start=1):
            assert g.keys() == w.keys()
            for name in w:
                assert torch.equal(g[name], w[name]), f"{case} step {step}: {name}"
                compared += 1
        for name in want["load"]:
            assert torch.equal(got["load"][name], want["load"][name]), f"{case} load refresh: {name}"
    assert compared == 8 * 3 * 25
    losses = {case: c["losses"] for case, c in _report(route_runs, "runtime")["cases"].items()}
    for case, c in _report(route_runs, "patched")["cases"].items():
        assert c["losses"] == losses[case.removeprefix("coexist/")], case
    # not vacuous: the mode changes the bits, and the stages agree with each other
    first = {case: runtime[case]["steps"][0] for case in runtime}
    names = list(first["zero1/stochastic"])
    assert any(not torch.equal(first["zero3/stochastic"][n], first["zero3/error_feedback"][n]) for n in names)
    assert all(torch.equal(first["zero1/stochastic"][n], first["zero3/stochastic"][n]) for n in names)
