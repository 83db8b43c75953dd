"""`faircast-ds check [CONFIG.json]`: the pre-flight finds, without launching anything, every error
initialize would raise about the section and the DeepSpeed setup around it; its exit status says it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import DIST, ROOT, cpu_env

from faircast_ds.tools import cli

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
    assert "the DeepSpeed config's fair_cast section (banner: origin=config): mode=dither seed=3" in out
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
    assert status == 0 and "FAIRCAST_DS_CONFIG (inline JSON) (banner: origin=FAIRCAST_DS_CONFIG): mode=nearest" in out
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
from faircast_ds.deepspeed.check import _predicted_optimizer
from faircast_bench.builders import tiny_qwen3
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


# ---- every refusal initialize raises, found by the check ---------------------------------------------
# What initialize refuses, from reading the attach path: faircast_ds/deepspeed/support.py's
# check_supported (run on DeepSpeed's parsed config before the engine is built: each `yield` below),
# adapters/registry.py (the built optimizer's class: ZeRO stage 0's FP16_Optimizer/FP16_UnfusedOptimizer,
# MiCS_Optimizer), compat.release_problem (the release range) and the section itself (config.py,
# config_origin.py: FairCastConfigError). tests/deepspeed_tests/test_initialize.py sees initialize raise each of them on
# its worker's configs; the check must report each, from the same config, with the same words.
# Not from a config, so not the check's to find: a non-finite weight (NonFiniteWeightError at the first
# step's cast; the check reports the policy, on_nonfinite=error, instead: test_the_nonfinite_policy_is_reported),
# ranks that disagree or lack Fair Cast (per node: launch/preflight.py), a release whose optimizer
# internals moved (compat.require_internals, on the built optimizer), a parameter without a name.
sys.path.insert(0, str(DIST))
from initialize_worker import CASES as INITIALIZE_CONFIGS  # noqa: E402
from test_initialize import EXPECTED as INITIALIZE_RAISES  # noqa: E402

NOT_FROM_A_CONFIG = {"nonfinite"}
SUPPORT_YIELDS = {  # words of each refusal check_supported yields -> the cases that raise it
    "outside": ["unverified_deepspeed"],
    "fp16.enabled": ["fp16"],
    "bf16 is not enabled": ["no_bf16"],
    "grad_accum_dtype fp32": ["bf16_optimizer_name_clash"],
    "torch_autocast": ["torch_autocast"],
    "NVMe offload": ["nvme_param_offload", "nvme_optimizer_offload"],
    "SuperOffload": ["super_offload"],
    "ZenFlow": ["zenflow"],
    "low-precision master weights": ["low_precision_masters"],
    "zero_quantized_weights": ["quantized_weights", "quantized_nontrainable_weights"],
    "hierarchical partitioning": ["hpz"],
}
# refusals of releases other than the installed one, their config made as such a release reads it
OTHER_RELEASES = {
    # 0.18.0 - 0.18.4 build FP16_UnfusedOptimizer for BF16_Optimizer's config (compat.bf16_optimizer_buildable)
    "bf16_optimizer_name_clash": ("bf16 + zero_optimization.stage 1 + data_types.grad_accum_dtype fp32",
                                  {"zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}}),
    # before 0.19.8 mics_shard_size > 0 builds MiCS_Optimizer (0.19.8's own parser refuses the key)
    "mics": ("optimizer would be MiCS_Optimizer", {"zero_optimization": {"stage": 3, "mics_shard_size": 2}}),
}


def error_blocks(out: str) -> list[str]:
    """Each ERROR line of the check's output with its continuation lines."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in out.splitlines():
        if line.startswith("  ERROR "):
            current = [line]
            blocks.append(current)
        elif current is not None and line.startswith(" " * 9):
            current.append(line)
        else:
            current = None
    return ["\n".join(block) for block in blocks]


@pytest.mark.parametrize("case", sorted(set(INITIALIZE_RAISES) - NOT_FROM_A_CONFIG))
def test_the_check_finds_every_refusal_initialize_raises(tmp_path, capsys, monkeypatch, case):
    """Each config tests/deepspeed_tests/test_initialize.py sees initialize refuse: the check exits 1 with an ERROR that
    names the same exception and carries the same words as initialize's message."""
    import deepspeed

    kind, words = INITIALIZE_RAISES[case]
    if case == "unverified_deepspeed":  # the worker's good config, on a release outside the range
        monkeypatch.setattr(deepspeed, "__version__", "0.99.0")
        config = {**GOOD, "fair_cast": {"mode": "stochastic"}}
    else:
        config = INITIALIZE_CONFIGS[case]
    status, out = check(tmp_path, capsys, config)
    assert status == 1, out
    blocks = [b for b in error_blocks(out) if words in b]
    assert blocks, f"{case}: no ERROR with {words!r}:\n{out}"
    assert f"initialize would raise {kind}" in blocks[0], blocks[0]
    assert out.rstrip().endswith("(exit 1)")


@pytest.mark.parametrize("case", sorted(OTHER_RELEASES))
def test_the_check_finds_the_refusals_of_other_releases(tmp_path, capsys, monkeypatch, case):
    """Refusals the installed release cannot reach, with the config read as that release reads it."""
    from deepspeed.runtime import config as ds_config_module

    from faircast_ds.deepspeed import compat

    words, extra = OTHER_RELEASES[case]
    if case == "bf16_optimizer_name_clash":
        monkeypatch.setattr(compat, "bf16_optimizer_buildable", lambda: False)
    else:
        parse = ds_config_module.DeepSpeedConfig.__init__

        def parse_as_before_0198(self, cfg, *args, **kwargs):  # 0.16.9/0.18.9 config.py: mics_shard_size kept
            zero = dict(cfg.get("zero_optimization", {}))
            mics = zero.pop("mics_shard_size", -1)
            parse(self, {**cfg, "zero_optimization": zero}, *args, **kwargs)
            self.mics_shard_size = mics

        monkeypatch.setattr(ds_config_module.DeepSpeedConfig, "__init__", parse_as_before_0198)
    status, out = check(tmp_path, capsys, {**GOOD, **extra, "fair_cast": {}})
    blocks = [b for b in error_blocks(out) if words in b]
    assert status == 1 and blocks and "initialize would raise UnsupportedSetupError" in blocks[0], out
    if case == "mics":
        assert "MiCS partitions differently and is not verified" in blocks[0]


def test_the_refusal_list_is_every_refusal_support_py_yields():
    """Each ``yield`` of support._problems has its words in SUPPORT_YIELDS, and each of their cases is
    checked above: a refusal added to support.py without a case here fails."""
    import ast
    import inspect

    from faircast_ds.deepspeed import support

    source = inspect.getsource(support._problems)
    yields = [ast.get_source_segment(source, node) for node in ast.walk(ast.parse(source))
              if isinstance(node, ast.Yield)]
    assert len(yields) == len(SUPPORT_YIELDS), yields
    for text in yields:
        found = [words for words in SUPPORT_YIELDS if words in text]
        assert len(found) == 1, (text, found)
        for case in SUPPORT_YIELDS[found[0]]:
            assert case in INITIALIZE_RAISES or case in OTHER_RELEASES, case


def test_the_nonfinite_policy_is_reported(tmp_path, capsys):
    """A non-finite weight is found by the first step's cast, not in a config: the check states what
    the section will do with one."""
    for policy in ("error", "propagate"):
        status, out = check(tmp_path, capsys, {**GOOD, "fair_cast": {"mode": "dither", "on_nonfinite": policy}})
        assert status == 0, out
        assert f"(banner: origin=config): mode=dither seed=0 on_nonfinite={policy} diagnostics.every=10" in out
