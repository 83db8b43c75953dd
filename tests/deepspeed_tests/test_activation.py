"""Fair Cast arrives without code changes: the interpreter-start hook, HF Trainer/Accelerate."""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import DIST, ROOT, cpu_env, deepspeed_launch


def test_hook_is_installed_with_the_package_and_imports_nothing_heavy():
    code = ("import sys; from faircast_ds.deepspeed import autoload as _autoload; "
            "print(any(isinstance(f, _autoload._EngineWatcher) for f in sys.meta_path), "
            "'torch' in sys.modules, 'deepspeed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cpu_env(), cwd="/")
    assert out.stdout.split() == ["True", "False", "False"], out
    # the .pth ran at interpreter start: the watcher is there before any faircast_ds import
    pre = subprocess.run([sys.executable, "-c", "import sys; print([type(f).__name__ for f in sys.meta_path])"],
                         capture_output=True, text=True, env=cpu_env(), cwd="/")
    assert "_EngineWatcher" in pre.stdout, "faircast-ds.pth is not installed: run `pip install -e .`"
    off = subprocess.run([sys.executable, "-c", "import sys; print([type(f).__name__ for f in sys.meta_path])"],
                         capture_output=True, text=True, env=cpu_env(FAIRCAST_DS_AUTOLOAD="0"), cwd="/")
    assert "_EngineWatcher" not in off.stdout


HOOK_ACTIVE = "  ok     faircast-ds autoload hook: active (engines with a section attach as they are built)"
HOOK_OFF = "  note   faircast-ds autoload hook: NOT active (FAIRCAST_DS_AUTOLOAD=0): call faircast_ds.install() "


def test_console_command_reports_the_hook():
    """The installed ``faircast-ds`` command states the hook's state in its exact line (a substring test
    for "active" would pass on "NOT active"): active as installed, off under FAIRCAST_DS_AUTOLOAD=0."""
    out = subprocess.run(["faircast-ds", "check"], capture_output=True, text=True, env=cpu_env(), cwd=ROOT)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and HOOK_ACTIVE in lines and "NOT active" not in out.stdout, out
    assert lines[-1] == "ready: nothing found that would stop Fair Cast at initialize (exit 0)", out
    off = subprocess.run(["faircast-ds", "check"], capture_output=True, text=True,
                         env=cpu_env(FAIRCAST_DS_AUTOLOAD="0"), cwd=ROOT)
    off_lines = off.stdout.splitlines()
    assert off.returncode == 0 and HOOK_ACTIVE not in off_lines, off
    assert [line for line in off_lines if line.startswith(HOOK_OFF)], off.stdout


@pytest.mark.slow
def test_hf_trainer_script_gets_fair_cast_from_its_deepspeed_config(tmp_path):
    """Served bits, bit for bit: after each of the Trainer's 3 steps and one engine.step() outside
    it, every element is the oracle's cast of its fp32 master (tests/served_oracle.py) with the
    config's mode and seed at the step the Trainer (then DeepSpeed) counted, and every Linear's
    forward at step k multiplied by the bits served after k steps (the initial weights at step 0)."""
    import torch
    from served_oracle import check_forward, check_snapshot, rn_fraction

    modes = ("stochastic", "nearest")
    with ThreadPoolExecutor(len(modes)) as pool:  # two 1-rank launches: one core each
        for done in [pool.submit(deepspeed_launch, DIST / "hf_trainer_script.py", 1, tmp_path / mode,
                                 FAIR_CAST_MODE=mode) for mode in modes]:
            done.result()
    changed = {}
    for mode in modes:
        out = tmp_path / mode
        log = (out / "launch.log").read_text()
        assert f"[fair_cast] active: mode={mode} zero_stage=3 seed=7 local_shard_elements=25088" in log
        result = json.loads((out / "hf_trainer.json").read_text())
        assert result["engine"] == "DeepSpeedEngine"
        changed[mode] = result["changed"] / result["numel"]
        record = torch.load(out / "hf_trainer.pt", weights_only=False)
        snaps = record["snapshots"]
        assert [(s["step"], s["ds_step"]) for s in snaps] == [(1, 1), (2, 2), (3, 3), (4, 4)]
        expected = {0: record["initial"]}
        for snap in snaps:
            expected[snap["step"]] = check_snapshot(snap, mode, seed=7)
        if mode == "stochastic":
            assert rn_fraction(snaps[-1]) > 0.05  # the oracle's cast is not round-to-nearest here
        check_forward(record["tap"], expected, {"train": 15}, steps=[0, 1, 2, 3])  # 2 x 7 Linear + lm_head
    # the same script, step and data: stochastic rounding changes far more served weights than RN
    assert changed["stochastic"] > 1.3 * changed["nearest"], changed
