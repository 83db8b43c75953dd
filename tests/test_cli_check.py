"""`faircast-ds check [CONFIG.json]`: the pre-flight finds, without launching anything, every error
initialize would raise about the section and the DeepSpeed setup around it; its exit status says it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, cpu_env
from faircast_ds import cli

GOOD = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}


def check(tmp_path, capsys, config: dict | str | None):
    path = None
    if config is not None:
        path = tmp_path / "ds.json"
        path.write_text(config if isinstance(config, str) else json.dumps(config))
    status = cli.main(["check"] + ([str(path)] if path else []))
    return status, capsys.readouterr().out


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv("FAIRCAST_DS_CONFIG", raising=False)
    monkeypatch.delenv("FAIRCAST_DS_KERNELS", raising=False)


def test_no_argument_reports_the_installation(tmp_path, capsys):
    import deepspeed

    status, out = check(tmp_path, capsys, None)
    assert status == 0, out
    assert "ok     faircast-ds autoload hook: active" in out
    assert f"ok     DeepSpeed {deepspeed.__version__}: supported" in out
    assert "fused cast kernel on cpu: cpp builds and runs" in out
    assert "FAIRCAST_DS_CONFIG is unset" in out and out.rstrip().endswith("(exit 0)")


def test_a_good_config_is_ready(tmp_path, capsys):
    status, out = check(tmp_path, capsys, {**GOOD, "fair_cast": {"mode": "dither", "seed": 3}})
    assert status == 0, out
    assert "the DeepSpeed config's fair_cast section (banner: source=config): mode=dither seed=3" in out
    assert "optimizer is DeepSpeedZeroOptimizer_Stage3, cast by Fair Cast" in out
    assert "one without (a reference or evaluation copy) is left as DeepSpeed builds it" in out


def test_hf_trainer_auto_values_are_accepted(tmp_path, capsys):
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
           "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
           "fair_cast": {}}
    status, out = check(tmp_path, capsys, cfg)
    # bf16 "auto" is DeepSpeed's default (off) here: HF Trainer fills it from --bf16 at launch
    assert status == 1 and "bf16 is not enabled" in out, out
    cfg["bf16"] = {"enabled": True}
    status, out = check(tmp_path, capsys, cfg)
    assert status == 0, out
    assert '"auto" values (train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size, ' \
           'zero_optimization.reduce_bucket_size)' in out
    assert "optimizer is DeepSpeedZeroOptimizer, cast by Fair Cast" in out


def test_every_problem_is_listed_and_the_exit_status_says_so(tmp_path, capsys):
    cfg = {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True},
           "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8, "offload_param": {"device": "nvme",
                                                                                         "nvme_path": "/tmp"}},
           "fair_cast": {"moed": "stochastic", "seed": "12"}}
    status, out = check(tmp_path, capsys, cfg)
    assert status == 1
    assert "fair_cast.moed: unknown key (did you mean 'mode'?)" in out
    assert "fair_cast.seed: str '12' is not accepted" in out
    assert "initialize would raise UnsupportedSetupError" in out
    for setting in ("fp16.enabled", "offload_param.device nvme", "zero_hpz_partition_size > 1"):
        assert setting in out, setting
    assert "NOT READY: 2 problems above (exit 1)" in out


def test_stage0_is_refused_before_the_engine_would_be(tmp_path, capsys):
    status, out = check(tmp_path, capsys, {**GOOD, "zero_optimization": {"stage": 0}, "fair_cast": {}})
    assert status == 1 and "optimizer would be FP16_UnfusedOptimizer" in out and "use ZeRO stage 1, 2 or 3" in out


def test_where_the_section_comes_from(tmp_path, capsys, monkeypatch):
    status, out = check(tmp_path, capsys, GOOD)
    assert status == 1 and "neither" in out and "Fair Cast stays off" in out
    monkeypatch.setenv("FAIRCAST_DS_CONFIG", '{"mode": "nearest"}')
    status, out = check(tmp_path, capsys, GOOD)
    assert status == 0 and "FAIRCAST_DS_CONFIG (inline JSON) (banner: source=FAIRCAST_DS_CONFIG): mode=nearest" in out
    status, out = check(tmp_path, capsys, {**GOOD, "fair_cast": {"mode": "stochastic"}})
    assert status == 1 and "two different fair_cast sections" in out and 'fair_cast.mode: "stochastic" vs "nearest"' in out
    monkeypatch.setenv("FAIRCAST_DS_CONFIG", str(tmp_path / "missing.json"))
    status, out = check(tmp_path, capsys, None)  # no config file: the variable alone is checked
    assert status == 1 and f"FAIRCAST_DS_CONFIG={tmp_path / 'missing.json'}: no such file" in out


def test_unreadable_config_and_kernel_that_cannot_run(tmp_path, capsys, monkeypatch):
    status, out = check(tmp_path, capsys, '{"bf16": ')
    assert status == 1 and "not valid JSON" in out
    monkeypatch.setenv("FAIRCAST_DS_KERNELS", "triton")
    status, out = check(tmp_path, capsys, None)
    assert status == 1 and "fused cast kernel on cpu: FAIRCAST_DS_KERNELS=triton cannot cast cpu tensors" in out


PREDICT = r"""
import json, os, sys, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  FAIRCAST_DS_AUTOLOAD="0")
import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig
from faircast_ds.deepspeed.preflight import _predicted_optimizer
from faircast_ds.models import tiny_qwen3
out = []
for zero, types in json.loads(sys.argv[2]):
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero,
           "zero_force_ds_cpu_optimizer": False, "data_types": types}
    model = tiny_qwen3()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
    out.append([type(engine.optimizer).__name__, _predicted_optimizer(DeepSpeedConfig(cfg))])
print("RESULT", json.dumps(out))
"""


@pytest.mark.slow
def test_the_predicted_optimizer_is_the_one_deepspeed_builds(tmp_path):
    from conftest import free_port

    cases = [({"stage": 0}, {}), ({"stage": 1}, {}), ({"stage": 1}, {"grad_accum_dtype": "fp32"}),
             ({"stage": 1, "offload_optimizer": {"device": "cpu"}}, {"grad_accum_dtype": "fp32"}),
             ({"stage": 2}, {}), ({"stage": 3}, {})]
    proc = subprocess.run([sys.executable, "-c", PREDICT, str(free_port()), json.dumps(cases)], capture_output=True,
                          text=True, env=cpu_env(), cwd=ROOT, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    pairs = json.loads(line[0][len("RESULT "):])
    assert [built for built, _ in pairs] == ["FP16_UnfusedOptimizer", "DeepSpeedZeroOptimizer", "BF16_Optimizer",
                                             "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer",
                                             "DeepSpeedZeroOptimizer_Stage3"]
    for built, predicted in pairs:
        assert built == predicted


def test_an_unsupported_deepspeed_release_is_an_error(tmp_path, capsys, monkeypatch):
    import deepspeed

    monkeypatch.setattr(deepspeed, "__version__", "0.99.0")
    status, out = check(tmp_path, capsys, {**GOOD, "fair_cast": {}})
    assert status == 1 and "DeepSpeed 0.99.0 is not supported" in out, out
