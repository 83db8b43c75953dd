"""Helpers shared by the distributed test workers (run under the `deepspeed` runner, not pytest)."""
from __future__ import annotations

import gc
import json
import math
import os
import sys
from typing import Any

import torch

from faircast_bench.builders import tiny_qwen3  # noqa: F401  (the one tiny model, re-exported for the workers)


def freeze_the_imports() -> None:
    """Take everything imported so far out of the garbage collector's walks (gc.freeze, after one collection).

    A worker holds ~430k tracked objects once torch, DeepSpeed and transformers' Qwen3 are imported, and every
    full gc.collect() walks them all (~0.4-1 s on the suite's 2-core CPUs): DeepSpeed runs two in each ZeRO-3
    engine's initialization (zero/utils.py defragment, a forced see_memory_usage) and several workers one after
    each engine they drop; in the releases launch they were ~45% of the ranks' CPU time (py-spy). Frozen
    objects are never collected (they are the imported modules and what they hold, alive to the end anyway);
    everything made afterwards, the engines included, is collected as before. The engine-building workers call
    it first thing under ``if __name__ == "__main__"``, once their imports are done."""
    import transformers

    _ = transformers.Qwen3ForCausalLM, transformers.Qwen3Config  # the lazy modules tiny_qwen3 builds from, imported
    gc.collect()
    gc.freeze()


# Every optimizer class Fair Cast handles, with and without CPU offload.
STAGES: dict[str, dict[str, Any]] = {
    "zero3": {"zero_optimization": {"stage": 3}},
    "zero3+offload": {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                            "offload_param": {"device": "cpu"}}},
    "zero2": {"zero_optimization": {"stage": 2}},
    "zero2+offload": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "zero1": {"zero_optimization": {"stage": 1}},
    "zero1+offload": {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
    "bf16_optimizer": {"zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}},
}


def ds_config(mode: str | None, *, seed: int = 1234, persistence: int = 40, stage: str = "zero3",
              **fair_cast: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
        "zero_force_ds_cpu_optimizer": False,  # CPU offload with a torch optimizer
    }
    for key, value in STAGES[stage].items():
        cfg[key] = dict(value)
    if cfg["zero_optimization"]["stage"] == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = persistence
    if mode is not None:
        cfg["fair_cast"] = {"enabled": True, "mode": mode, "seed": seed, **fair_cast}
    return cfg


def batch(step: int, rank: int, vocab: int = 101) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (2, 16), generator=g)


def train_step(engine: Any, step: int, rank: int) -> float:
    x = batch(step, rank)
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def deterministic_master(name_hash: int, start: int, numel: int) -> torch.Tensor:
    """fp32 master values that depend only on (parameter, index): the same for any sharding."""
    idx = torch.arange(start, start + numel, dtype=torch.float64)
    return (0.05 * torch.sin(0.37 * idx + (name_hash % 1000)) + 1e-6 * math.pi).to(torch.float32)


def optimizer_class(engine: Any) -> str:
    return type(engine.optimizer).__name__


def full_served_bits(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's served bf16 bits (gathered under ZeRO-3), keyed by name."""
    import deepspeed

    from faircast_ds.casting.bits import bf16_bits

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=engine.zero_optimization_stage() == 3):
        return {n: bf16_bits(p.detach().reshape(-1)).clone() for n, p in params.items()}


def gather_shards(fc: Any, numels: dict[str, int]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Full fp32 masters and served bits of every parameter, assembled from every rank's shard
    slices in one collective (test-only: Fair Cast itself never gathers fp32)."""
    import deepspeed.comm as dist

    from faircast_ds.casting.bits import bf16_bits

    pieces = [(s.name, s.start, master[s.offset:s.offset + s.numel].detach().clone(),
               bf16_bits(served[s.offset:s.offset + s.numel].detach()))
              for _, master, served, slices in fc.adapter.flat_groups() for s in slices if not s.is_padding]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces)
    masters = {n: torch.full((k,), float("nan")) for n, k in numels.items()}
    served = {n: torch.full((k,), -1, dtype=torch.int64) for n, k in numels.items()}
    for rank_pieces in everyone:
        for name, start, m, b in rank_pieces:
            masters[name][start:start + m.numel()] = m
            served[name][start:start + b.numel()] = b
    return masters, served


def tampered_checkpoint_copy(src: str, dst: str, tag: str) -> str:
    """Rank 0 copies the checkpoint folder ``src`` to ``dst`` and changes one element of tag ``tag``'s module
    file on disk (the last element of the last floating parameter, in the last rank's partition); every rank
    waits for it. A ZeRO-1/2 load of the copy then changes a served bit on its owner, so it must all-gather (a
    load that changes nothing skips the gather, and with it the refresh that follows it)."""
    import shutil

    import torch.distributed as dist

    if dist.get_rank() == 0:
        shutil.copytree(src, dst, dirs_exist_ok=True)
        path = os.path.join(dst, tag, "mp_rank_00_model_states.pt")
        ckpt = torch.load(path, weights_only=False)
        name = [k for k, v in ckpt["module"].items() if torch.is_tensor(v) and v.is_floating_point()][-1]
        flat = ckpt["module"][name].view(-1)
        flat[-1] = flat[-1] * 2 + 1
        torch.save(ckpt, path)
    dist.barrier()
    return dst


def tensors_in(obj: Any):
    """Every tensor in a nest of lists, tuples and dicts (a dispatched op's arguments or results)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(path + ".tmp", path)


def finish() -> None:
    import deepspeed.comm as dist

    dist.barrier()
    torch.distributed.destroy_process_group()


def finish_and_exit(code: int = 0) -> None:
    """Barrier, destroy the process group, flush, and leave with ``os._exit``: gloo's threads can abort
    a process that finalizes normally after destroy_process_group (a DeepSpeed-on-CPU race, not ours)."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
