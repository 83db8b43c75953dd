"""Free what a finished DeepSpeed engine holds, for a job that trains several engines in one process.

After ``engine.destroy()`` something still references a ZeRO-3 engine's optimizer here (DeepSpeed 0.19.8 on
CPU with Fair Cast attached; found by measuring, not yet traced to its owner), so its fp32 masters, AdamW's
moments, gradient partitions and parameter partitions stay in memory: ~0.7 GB per engine per rank for a
42M-parameter model, enough for the pretrained job's third engine to run the machine out of memory. This
drops the tensors themselves, whoever still holds the objects.
"""
from __future__ import annotations

from typing import Any

import torch


def _drop_tensors(obj: Any) -> None:
    for name, value in list(vars(obj).items()):
        if isinstance(value, torch.Tensor):
            setattr(obj, name, None)
        elif isinstance(value, list) and any(isinstance(v, torch.Tensor) for v in value):
            value.clear()
        elif isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            for inner in value:
                if any(isinstance(v, torch.Tensor) for v in inner):
                    inner.clear()


@torch.no_grad()
def release(engine: Any) -> None:
    """Call after ``engine.destroy()``: empty the optimizer's state and buffers and the parameters' storage."""
    try:
        from faircast_ds import get_fair_cast

        fc = get_fair_cast(engine)
    except Exception:  # noqa: BLE001 - nothing attached, or already detached
        fc = None
    if fc is not None:  # Fair Cast's own buffers (the last served bits, staging, diagnostics' samples)
        for part in (getattr(fc, "caster", None), getattr(fc, "adapter", None), getattr(fc, "diagnostics", None)):
            if part is not None and hasattr(part, "__dict__"):
                _drop_tensors(part)
    optimizer = getattr(engine, "optimizer", None)
    inner = getattr(optimizer, "optimizer", None)
    for opt in (inner, optimizer):
        if isinstance(opt, torch.optim.Optimizer):
            opt.state.clear()
            for group in opt.param_groups:
                group["params"] = []
    for obj in (optimizer, inner):
        if obj is not None:
            _drop_tensors(obj)
    module = getattr(engine, "module", None)
    if module is not None:
        for p in module.parameters():
            if hasattr(p, "ds_tensor"):
                p.ds_tensor = torch.empty(0, dtype=p.dtype)
            p.data = torch.empty(0, dtype=p.dtype)
