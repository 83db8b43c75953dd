"""``ZeroInit`` builds parameters in the dtype asked for, or refuses (a real ``deepspeed.zero.Init``, one rank).

DeepSpeed 0.16-0.19 on the CPU accelerator ignore ``zero.Init(dtype=torch.float32)`` under a bf16 config and
build bf16 where the accelerator reports no fp16 (``dtype or fp16 if fp16 supported else bf16`` binds as
``(dtype or fp16) if ... else bf16``); the fp32 reference of the pretrained job was built bf16 that way (and then
trained its bf16 parameters directly). Where oneDNN has fp16 (an AVX-512 FP16 CPU), the same call builds the
dtype asked for. Which of the two this CPU is comes from DeepSpeed's own accelerator (``is_fp16_supported``).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, cpu_env, free_port

WORKER = r'''
import json, os, sys, torch
import deepspeed
deepspeed.init_distributed("gloo")
from faircast_bench.zero_init import ZeroInit
out = {}
for name, cfg, dtype in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    try:
        with ZeroInit(cfg).building(dtype):
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        out[name] = sorted({str(p.ds_tensor.dtype) for p in model.parameters()} |
                           {str(p.dtype) for p in model.parameters()})
    except RuntimeError as exc:
        out[name] = "refused: " + str(exc)
from deepspeed.accelerator import get_accelerator
out["fp16 supported"] = bool(get_accelerator().is_fp16_supported())
print("RESULT " + json.dumps(out))
'''

ZERO3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


@pytest.fixture(scope="module")
def built() -> dict:
    cases = [
        ("fp32 from an fp32 config", ZERO3, "float32"),
        ("bf16 from a bf16 config", {**ZERO3, "bf16": {"enabled": True}}, "bfloat16"),
        ("fp32 from a bf16 config", {**ZERO3, "bf16": {"enabled": True}}, "float32"),
    ]
    env = cpu_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(cases)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_an_fp32_model_is_built_fp32_on_the_cpu_accelerator(built):
    assert built["fp32 from an fp32 config"] == ["torch.float32"]


def test_a_bf16_model_is_built_bf16(built):
    assert built["bf16 from a bf16 config"] == ["torch.bfloat16"]


def test_a_dtype_the_config_contradicts_is_refused_by_name(built):
    """Refused where DeepSpeed would build bf16 (no fp16 on this CPU); built as asked where it has fp16."""
    result = built["fp32 from a bf16 config"]
    if built["fp16 supported"]:
        assert result == ["torch.float32"], result
        return
    assert isinstance(result, str) and result.startswith("refused: ") and "torch.float32" in result \
        and "torch.bfloat16" in result, result
