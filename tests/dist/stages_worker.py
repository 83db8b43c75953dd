"""Checks of every supported optimizer class under the real `deepspeed` runner, one launch per world
size (see tests/deepspeed_tests/test_stages.py).

The script never calls faircast_ds.install() or attach(): Fair Cast must arrive through the
interpreter-start hook, as it would for an unmodified training script. It writes one JSON file per
rank (and, on rank 0, the served bits for the sharding-invariance comparison) into $OUT_DIR.
"""
from __future__ import annotations

import os
import sys

import deepspeed
import deepspeed.comm as dist
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (batch, deterministic_master, ds_config, finish_and_exit, full_served_bits, optimizer_class,  # noqa: E402
                    tensors_in, tiny_qwen3, train_step, write_json)

from faircast_ds.casting.bits import bf16_bits, fp32_bits
from faircast_ds.casting.modes import MODES
from faircast_ds.casting.rules import cast  # noqa: E402
from faircast_ds.casting.noise import name_id  # noqa: E402

OUT = os.environ["OUT_DIR"]
STEPS = 4


TRAINING = [("zero3", m) for m in MODES] + [(s, m) for s in ("zero2", "zero1", "bf16_optimizer")
                                             for m in ("stochastic", "error_feedback")]
INVARIANCE = [(s, m) for s in ("zero3", "zero3+offload", "zero2", "zero2+offload", "zero1", "zero1+offload",
                               "bf16_optimizer") for m in ("stochastic", "error_feedback")]
INVARIANCE += [("zero3", "nearest"), ("zero3", "dither")]


def build(mode: str, stage: str, lr: float = 1e-5, **fair_cast):
    model = tiny_qwen3(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(mode, stage=stage, **fair_cast))
    from faircast_ds import get_fair_cast

    return engine, get_fair_cast(engine)


def training_checks(mode: str, stage: str) -> dict:
    from deepspeed.runtime.engine import DeepSpeedEngine

    hooked_before_attach = bool(getattr(DeepSpeedEngine.__init__, "_faircast_wrapped", False))
    engine, fc = build(mode, stage)
    res = {"hooked": hooked_before_attach, "attached": fc is not None, "steps": [],
           "optimizer": optimizer_class(engine), "zero_stage": fc.adapter.zero_stage if fc else None}
    if fc is None:
        return res
    # each engine method Fair Cast hooks is replaced once, by one dispatcher over DeepSpeed's own method
    res["hooks"] = fc.extras["hooks"].describe()
    res["wrapped_once"] = {m: getattr(getattr(engine, m).__wrapped__, "__func__", None) is getattr(DeepSpeedEngine, m)
                           for m in ("step", "save_checkpoint", "load_checkpoint", "load_module_state_dict")}
    adapter, cfg = fc.adapter, fc.config
    groups = list(adapter.flat_groups())
    replay_res = {k: torch.zeros(m.numel()) for k, m, _, _ in groups}
    prev = {k: bf16_bits(s.detach()).clone() for k, _, s, _ in groups}
    for step in range(1, STEPS + 1):
        train_step(engine, step, engine.global_rank)
        exact, neighbour, observed, exp_changed, var_changed, numel = True, True, 0, 0.0, 0.0, 0
        for key, master, served, slices in adapter.flat_groups():
            now = bf16_bits(served.detach())
            for s in slices:
                if s.is_padding:
                    continue
                m = master.detach()[s.offset:s.offset + s.numel]
                got = now[s.offset:s.offset + s.numel]
                before = prev[key][s.offset:s.offset + s.numel]
                r = replay_res[key][s.offset:s.offset + s.numel] if mode == "error_feedback" else None
                want = bf16_bits(cast(m, mode, seed=cfg.seed, step=fc.caster.step, name=s.name, start=s.start,
                                      residual=r))
                exact &= bool(torch.equal(want, got))
                lo = fp32_bits(m) >> 16
                neighbour &= bool(((got == lo) | (got == lo + 1)).all())
                observed += int((got != before).sum())
                numel += s.numel
                if mode == "stochastic":  # P(change) given the previous served value and the new master
                    p_up = (fp32_bits(m) & 0xFFFF).double() / 65536.0
                    p = torch.where(before == lo, p_up, torch.where(before == lo + 1, 1 - p_up, torch.ones_like(p_up)))
                    exp_changed += float(p.sum())
                    var_changed += float((p * (1 - p)).sum())
            prev[key] = now.clone()
        stats = fc.stats()
        totals = torch.tensor([observed, exp_changed, var_changed, numel], dtype=torch.float64)
        dist.all_reduce(totals)
        bits = full_served_bits(engine)
        shard_matches_full = True
        for key, _, served, slices in adapter.flat_groups():
            now = bf16_bits(served.detach())
            for s in (s for s in slices if not s.is_padding):
                shard_matches_full &= bool(torch.equal(bits[s.name][s.start:s.start + s.numel],
                                                       now[s.offset:s.offset + s.numel]))
        checksum = torch.tensor([float(sum(int((b * torch.arange(1, b.numel() + 1)).sum()) for b in bits.values()))],
                                dtype=torch.float64)
        all_sums = [torch.zeros_like(checksum) for _ in range(dist.get_world_size())]
        dist.all_gather(all_sums, checksum)
        res["steps"].append({
            "step": fc.caster.step, "exact_replay": exact, "neighbour": neighbour,
            "observed_changed": totals[0].item(), "stats_changed": stats["changed"],
            "expected_changed": totals[1].item(), "var_changed": totals[2].item(), "numel": totals[3].item(),
            "shard_matches_gathered": shard_matches_full,
            "ranks_agree": all(float(s) == float(all_sums[0]) for s in all_sums),
        })
    return res


def set_deterministic_masters(fc) -> None:
    for _, master, _, slices in fc.adapter.flat_groups():
        for s in (s for s in slices if not s.is_padding):
            master.data[s.offset:s.offset + s.numel] = deterministic_master(name_id(s.name), s.start, s.numel)


def invariance_bits(mode: str, stage: str) -> list[dict[str, torch.Tensor]]:
    """Served bits after two casts of the same deterministic masters (lr = 0 keeps them fixed)."""
    engine, fc = build(mode, stage, lr=0.0)
    set_deterministic_masters(fc)
    out = []
    for step in (1, 2):
        train_step(engine, step, engine.global_rank)
        out.append(full_served_bits(engine))
    return out


class Tracer(TorchDispatchMode):
    """Records every tensor created inside the cast window and every collective's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.in_cast = False
        self.cast_allocs: list[tuple[int, int]] = []  # (numel, storage pointer) of new tensors
        self.cast_collectives: list[str] = []
        self.gathers: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        is_collective = name.startswith("c10d.") or "allgather" in name or "all_gather" in name
        if is_collective:
            dtypes = sorted({str(t.dtype) for t in tensors_in((args, kwargs))})
            if "gather" in name:
                self.gathers.append(f"{name}:{','.join(dtypes)}")
            if self.in_cast:
                self.cast_collectives.append(name)
        elif self.in_cast:
            # views and in-place results share an input's storage: only new storage is an allocation
            inputs = {t.untyped_storage().data_ptr() for t in tensors_in((args, kwargs))}
            for t in tensors_in(out):
                if t.untyped_storage().data_ptr() not in inputs:
                    self.cast_allocs.append((t.numel(), t.untyped_storage().data_ptr()))
        return out


def allocation_checks(mode: str, stage: str) -> dict:
    # The eager path is the one that allocates temporaries (the fused kernel writes in place and is
    # invisible to a dispatch-level tracer), so it is the one to trace.
    # Diagnostics are off: they are not part of the cast and keep their own, documented, state.
    os.environ["FAIRCAST_DS_KERNELS"] = "eager"
    engine, fc = build(mode, stage, diagnostics={"every": 0})
    installed = fc.caster.cast_flat
    tracer = Tracer()

    def traced(*args, **kwargs) -> None:
        tracer.in_cast = True
        try:
            installed(*args, **kwargs)
        finally:
            tracer.in_cast = False

    fc.caster.cast_flat = traced
    with tracer:
        train_step(engine, 1, engine.global_rank)
        engine(input_ids=batch(2, engine.global_rank))  # the forward that gathers the new bf16 shards
    largest_slice = max(s.numel for _, _, _, sl in fc.adapter.flat_groups() for s in sl)
    largest_param = max(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    # the error-feedback residual is state, one fp32 per local shard element, made once
    residual_ptrs = {r.untyped_storage().data_ptr() for r in fc.caster.residuals.values()}
    temporaries = [n for n, ptr in tracer.cast_allocs if ptr not in residual_ptrs]
    os.environ.pop("FAIRCAST_DS_KERNELS")
    return {"cast_max_numel": max(temporaries, default=0), "largest_local_slice": largest_slice,
            "residual_numel": sum(r.numel() for r in fc.caster.residuals.values()),
            "largest_param": largest_param, "local_shard": fc.adapter.local_numel(),
            "local_shard_padded": sum(m.numel() for _, m, _, _ in fc.adapter.flat_groups()),
            "cast_collectives": tracer.cast_collectives, "gathers": sorted(set(tracer.gathers)),
            "n_gathers": len(tracer.gathers)}


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {"world_size": world, "training": {}, "allocation": {}}
    for stage, mode in TRAINING:
        report["training"][f"{stage}/{mode}"] = training_checks(mode, stage)
    invariance = {f"{stage}/{mode}": invariance_bits(mode, stage) for stage, mode in INVARIANCE}
    if world > 1:
        for stage in ("zero3", "zero2"):
            for mode in ("stochastic", "error_feedback"):
                report["allocation"][f"{stage}/{mode}"] = allocation_checks(mode, stage)
    write_json(os.path.join(OUT, f"stages_ws{world}_rank{rank}.json"), report)
    if rank == 0:
        torch.save(invariance, os.path.join(OUT, f"invariance_ws{world}.pt"))
    finish_and_exit()


if __name__ == "__main__":
    from common import freeze_the_imports

    freeze_the_imports()  # gc.collect() (DeepSpeed's and ours) then skips the imported modules
    main()
