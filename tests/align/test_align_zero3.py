"""Alignment under DeepSpeed ZeRO-3: partitioned parameters, gathered by hooks during forward.

The test runs this file as a one-rank CPU DeepSpeed job in a subprocess (a process group must not
leak into the pytest process); the worker prints one JSON line of findings.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_alignment_under_zero3_matches_the_reference_and_reverts():
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["partitioned"]  # ZeRO-3 really took the parameters away from the modules
    assert found["logits_equal_reference"]
    assert found["grads_equal_reference"]
    assert found["removed_equals_hf"]


def _worker() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_grad

    from faircast_ds.align import align_model, reference_logits
    from faircast_ds.align.meter import token_logprobs
    from faircast_bench.builders import alignment_lm, token_ids

    model, ids = alignment_lm("qwen3"), token_ids()
    hf_logits = reference_logits(model, ids, "hf")
    expected = reference_logits(model, ids, "sglang")
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(-token_logprobs(expected, ids).mean(), list(model.parameters()))
    expected_grads = dict(zip(names, grads, strict=True))

    deepspeed.init_distributed(dist_backend="gloo")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # partition even norms
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    partitioned = all(p.numel() == 0 for p in engine.module.parameters())

    handle = align_model(engine.module, "sglang")
    logits = engine(input_ids=ids).logits
    engine.backward(-token_logprobs(logits, ids).mean())
    grads_equal = all(
        torch.equal(safe_get_full_grad(p).to(expected_grads[n].dtype), expected_grads[n])
        for n, p in engine.module.named_parameters()
    )
    handle.remove()
    with torch.no_grad():
        removed = engine(input_ids=ids).logits
    print(
        json.dumps(
            {
                "partitioned": partitioned,
                "logits_equal_reference": torch.equal(logits, expected),
                "grads_equal_reference": grads_equal,
                "removed_equals_hf": torch.equal(removed, hf_logits),
            }
        )
    )


if __name__ == "__main__":
    _worker()
