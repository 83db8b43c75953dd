"""Checkpoint phases under the `deepspeed` runner (driven by tests/deepspeed_tests/test_checkpoint.py).

  straight  run 6 steps per combination, saving a checkpoint after step 3 (and, for zero3/stochastic,
            after step 5, so `latest` names another tag); snapshots after steps 3-6; then a cast that
            stops on a NaN master (on_nonfinite: error) and a checkpoint saved from the exception handler
  resume    new processes: load each step-3 checkpoint, snapshot, run steps 4-6; load each one module-only
            (load_optimizer_states=False, and load_module_only=True) and compare the served bits with the
            saved ones; load the NaN checkpoint; resume the crashed run from its latest checkpoint; try
            every bad checkpoint
  crash     save every 2 steps; rank 1 records OUT_DIR/killed.json and SIGKILLs itself after step 5 (the straight launch runs it last, with
            --then-crash, once straight.pt is written: one launch serves both phases)
  elastic   load a universal checkpoint at this world size, for ZeRO-3, ZeRO-2 and ZeRO-1; snapshot; run on;
            save; and load universal checkpoints converted by DeepSpeed's own ds_to_universal (no fair_cast/)

A snapshot is the full served bits, fp32 masters and error-feedback residual of every parameter,
gathered for the test only (Fair Cast itself never gathers fp32).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import deepspeed
import deepspeed.comm as dist
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (ds_config, finish_and_exit, full_served_bits, tampered_checkpoint_copy, tiny_qwen3, train_step,  # noqa: E402
                    write_json)

from faircast_ds.casting.bits import bf16_bits, fp32_bits
from faircast_ds.casting.rules import cast  # noqa: E402

COMBOS = [("zero3", "stochastic"), ("zero3", "error_feedback"), ("zero3", "dither"), ("zero3", "nearest"),
          ("zero2", "error_feedback"), ("zero1", "error_feedback"), ("bf16_optimizer", "error_feedback"),
          ("zero3+offload", "error_feedback"), ("zero2+offload", "stochastic")]
ELASTIC_STAGES = ("zero3", "zero2", "zero1")
NONFINITE = [("zero3", "stochastic"), ("zero2", "error_feedback")]  # one per adapter family
MODULE_LOADS = {"no_optimizer_states": {"load_optimizer_states": False}, "module_only": {"load_module_only": True}}


def build(stage: str, mode: str | None, **extra):
    from faircast_ds import get_fair_cast

    model = tiny_qwen3(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    cfg = ds_config(mode, stage=stage, **extra.pop("fair_cast", {}))
    cfg.update(extra)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine, get_fair_cast(engine)


def snapshot(engine, fc) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    served = full_served_bits(engine)
    masters = {n: safe_get_full_fp32_param(p).detach().reshape(-1).clone() for n, p in engine.module.named_parameters()}
    pieces = []
    if fc is not None and fc.config.mode == "error_feedback":
        for key, _, _, slices in fc.adapter.flat_groups():
            res = fc.caster.residuals[key]
            pieces += [(s.name, s.start, res[s.offset:s.offset + s.numel].clone()) for s in slices if not s.is_padding]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pieces)
    residual = {}
    for rank_pieces in gathered:
        for name, start, values in rank_pieces:
            residual.setdefault(name, torch.full((masters[name].numel(),), float("nan")))
            residual[name][start:start + values.numel()] = values
    return {"step": fc.caster.step if fc else None, "global_steps": engine.global_steps, "served": served,
            "master": masters, "residual": residual}


def replay_ok(fc, replay: dict) -> bool:
    """The served shard is exactly cast(master) with the test's own copy of the residual (updated)."""
    ok = True
    cfg = fc.config
    for key, master, served, slices in fc.adapter.flat_groups():
        now = bf16_bits(served.detach())
        for s in (s for s in slices if not s.is_padding):
            m = master.detach()[s.offset:s.offset + s.numel]
            r = replay[key][s.offset:s.offset + s.numel] if cfg.mode == "error_feedback" else None
            want = bf16_bits(cast(m, cfg.mode, seed=cfg.seed, step=fc.caster.step, name=s.name, start=s.start, residual=r))
            lo = fp32_bits(m) >> 16
            got = now[s.offset:s.offset + s.numel]
            finite = torch.isfinite(m)
            ok &= bool(torch.equal(want, got)) and bool(((got == lo) | (got == lo + 1) | ~finite).all())
    return ok


def save_rank0(obj, path: str) -> None:
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(obj, path + ".tmp")
        os.replace(path + ".tmp", path)


def poison(fc) -> list:
    """Make one fp32 master element NaN in the first and the last parameter slice of every rank's first
    flat shard, as a diverged update would; returns (parameter, element) of each on this rank."""
    _, master, _, group = next(iter(fc.adapter.flat_groups()))
    slices = [s for s in group if not s.is_padding]
    chosen = []
    for s in (slices[0], slices[-1]):
        i = min(3, s.numel - 1)
        master.data[s.offset + i] = float("nan")
        chosen.append((s.name, s.start + i))
    return chosen


def build_split(stage: str, mode: str):
    """An engine whose rank shard is several flat shards: ZeRO-3 sub-groups of 4000 elements, or for ZeRO-1/2
    two optimizer parameter groups (a failed cast then leaves shards the step did not reach)."""
    from faircast_ds import get_fair_cast

    model = tiny_qwen3(seed=0)
    params = list(model.parameters())
    groups = [{"params": params[: len(params) // 2]}, {"params": params[len(params) // 2:]}]
    opt = torch.optim.AdamW(groups if stage != "zero3" else params, lr=1e-5, weight_decay=0.0)
    cfg = ds_config(mode, stage=stage)
    if stage == "zero3":
        cfg["zero_optimization"]["sub_group_size"] = 4000
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine, get_fair_cast(engine)


def nonfinite(root: str) -> dict:
    """A step whose cast meets a NaN master raises NonFiniteWeightError on every rank; the exception
    handler saves a checkpoint. Returns what the live engine held then (the resume phase loads it)."""
    from faircast_ds.shard.caster import NonFiniteWeightError

    records = {}
    for stage, mode in NONFINITE:
        engine, fc = build_split(stage, mode)
        for step in (1, 2):
            train_step(engine, step, engine.global_rank)
        replay = {k: r.clone() for k, r in fc.caster.residuals.items()}
        record = {"raised": None, "message": None, "poisoned": poison(fc),
                  "flat_shards": len(list(fc.adapter.flat_groups()))}
        try:
            train_step(engine, 3, engine.global_rank)
        except NonFiniteWeightError as exc:
            record["raised"], record["message"] = type(exc).__name__, str(exc)
            record["cast_by_failed_step"] = len(fc.caster.cast_keys)  # the flat shards the step reached
            engine.save_checkpoint(os.path.join(root, f"nonfinite-{stage}-{mode}"), tag="nan")
        record["cast_after_save"] = len(fc.caster.cast_keys)
        record["replay_one_step"] = replay_ok(fc, replay)  # every shard is step 3's cast, none is step 2's
        record["caster_step"], record["global_steps"] = fc.caster.step, engine.global_steps
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, record["message"])
        record["messages"] = messages
        record["snapshot"] = snapshot(engine, fc)
        records[f"{stage}/{mode}"] = record
    return records


def straight(root: str, out: str) -> None:
    records = {}
    for stage, mode in COMBOS:
        engine, fc = build(stage, mode)
        snaps = {}
        for step in range(1, 7):
            train_step(engine, step, engine.global_rank)
            if step == 3 or (step == 5 and (stage, mode) == ("zero3", "stochastic")):
                engine.save_checkpoint(os.path.join(root, f"{stage}-{mode}"), tag=f"step{step}")
            if step >= 3:
                snaps[step] = snapshot(engine, fc)
        records[f"{stage}/{mode}"] = snaps
    engine, _ = build("zero3", None)  # a checkpoint from a run without Fair Cast
    train_step(engine, 1, engine.global_rank)
    engine.save_checkpoint(os.path.join(root, "no-fair-cast"), tag="step1")
    records["nonfinite"] = nonfinite(root)
    save_rank0(records, os.path.join(out, "straight.pt"))


def crash(root: str, out: str) -> None:
    engine, fc = build("zero3", "error_feedback")
    for step in range(1, 7):
        train_step(engine, step, engine.global_rank)
        if step == 5 and dist.get_rank() == 1:
            with open(os.path.join(out, "killed.json"), "w") as f:  # the test's proof of the kill (see there)
                json.dump({"step": step, "rank": 1}, f)
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # a node dies mid-run, without warning
        if step % 2 == 0:
            engine.save_checkpoint(os.path.join(root, "crash"))


def try_load(stage: str, mode: str, load_dir: str, tag: str | None, extra: dict | None = None,
             load: dict | None = None, **fair_cast) -> dict:
    try:
        engine, fc = build(stage, mode, fair_cast=fair_cast, **(extra or {}))
        engine.load_checkpoint(load_dir, tag=tag, **(load or {}))
        return {"ok": True, "step": fc.caster.step}
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        return {"ok": False, "type": type(exc).__name__, "message": str(exc)}


def module_only_loads(root: str, straight_served: dict) -> dict:
    """Every combination's step-3 checkpoint loaded module-only, both ways DeepSpeed offers: the served
    bits must be the saved ones, the masters equal to them, the residual zero, and the next step the
    exact cast of the next master."""
    out = {}
    for stage, mode in COMBOS:
        for kind, kwargs in MODULE_LOADS.items():
            engine, fc = build(stage, mode)
            engine.load_checkpoint(os.path.join(root, f"{stage}-{mode}"), tag="step3", **kwargs)
            snap = snapshot(engine, fc)
            want = straight_served[f"{stage}/{mode}"]
            differ = sum(int((snap["served"][n] != want[n]).sum()) for n in want)
            masters_are_served = all(torch.equal(snap["master"][n].to(torch.bfloat16).float(), snap["master"][n]) and
                                     torch.equal(bf16_bits(snap["master"][n].to(torch.bfloat16)), snap["served"][n])
                                     for n in want)
            residual_zero = all(bool((r == 0).all()) for r in snap["residual"].values())
            replay = {k: torch.zeros_like(m) for k, m, _, _ in fc.adapter.flat_groups()}
            train_step(engine, 4, engine.global_rank)
            out[f"{stage}/{mode}/{kind}"] = {
                "differ": differ, "numel": sum(v.numel() for v in want.values()), "step": snap["step"],
                "masters_are_served": masters_are_served, "residual_zero": residual_zero,
                "continued_exact": replay_ok(fc, replay)}
    return out


def count_casts(fc) -> dict:
    """Count the caster's flat-group casts from now on (the load's: one per group, the restore's, under the
    noise modes; none under error feedback, whose restore writes the saved bits)."""
    counter = {"n": 0}
    cast_flat = fc.caster.cast_flat

    def counted(*args, **kwargs):
        counter["n"] += 1
        return cast_flat(*args, **kwargs)

    fc.caster.cast_flat = counted
    return counter


def tampered_module_load(root: str, out: str, stage: str = "zero2+offload", mode: str = "stochastic") -> dict:
    """ZeRO-2: the step-3 checkpoint with one element of its module file changed on disk, the
    last element of the last parameter (in the last rank's partition). The load's recast at the saved step
    (error feedback: its restore of the saved served bits) writes the served bit back on its owner, so the
    load must all-gather (a load that changes nothing skips it): rank 0's full copy then holds the straight
    run's bits."""
    dst = tampered_checkpoint_copy(os.path.join(root, f"{stage}-{mode}"), os.path.join(out, f"tampered-{stage}-{mode}"),
                                   "step3")
    engine, fc = build(stage, mode)
    engine.load_checkpoint(dst, tag="step3")
    return {"served": snapshot(engine, fc)["served"], "skipped_gathers": fc.adapter.skipped_gathers}


def resume(root: str, out: str) -> None:
    straight_records = torch.load(os.path.join(os.environ["STRAIGHT_DIR"], "straight.pt"))
    records = {}
    for stage, mode in COMBOS:
        engine, fc = build(stage, mode)
        casts = count_casts(fc)
        engine.load_checkpoint(os.path.join(root, f"{stage}-{mode}"), tag="step3")
        snaps = {3: snapshot(engine, fc)}
        snaps["load_casts"] = {"casts": casts["n"], "groups": len(list(fc.adapter.flat_groups())),
                               "skipped_gathers": getattr(fc.adapter, "skipped_gathers", None)}
        for step in range(4, 7):
            train_step(engine, step, engine.global_rank)
            snaps[step] = snapshot(engine, fc)
        records[f"{stage}/{mode}"] = snaps
    records["tampered"] = tampered_module_load(root, out)
    records["tampered_error_feedback"] = tampered_module_load(root, out, "zero2", "error_feedback")
    records["module_only"] = module_only_loads(root, {c: s[3]["served"] for c, s in straight_records.items()
                                                      if c in {f"{a}/{b}" for a, b in COMBOS}})
    nan = {}
    for stage, mode in NONFINITE:
        engine, fc = build_split(stage, mode)
        engine.load_checkpoint(os.path.join(root, f"nonfinite-{stage}-{mode}"), tag="nan")
        nan[f"{stage}/{mode}"] = snapshot(engine, fc)
    records["nonfinite"] = nan
    engine, fc = build("zero3", "error_feedback")  # the crashed run, from its latest checkpoint
    engine.load_checkpoint(os.path.join(root, "crash"))
    resumed_at = engine.global_steps
    for step in range(resumed_at + 1, 7):
        train_step(engine, step, engine.global_rank)
    records["crash"] = {"resumed_at": resumed_at, 6: snapshot(engine, fc)}
    save_rank0(records, os.path.join(out, "resume.pt"))

    ef = os.path.join(root, "zero3-error_feedback")
    bad = {
        "missing": try_load("zero3", "error_feedback", os.path.join(root, "no-fair-cast"), "step1"),
        "missing_recovered": try_load("zero3", "stochastic", os.path.join(root, "no-fair-cast"), "step1"),
        "missing_module_only_recovered": try_load("zero3", "stochastic", os.path.join(root, "no-fair-cast"), "step1",
                                                  load={"load_optimizer_states": False}),
        "missing_module_only": try_load("zero3", "error_feedback", os.path.join(root, "no-fair-cast"), "step1",
                                        load={"load_module_only": True}),
        "other_mode": try_load("zero3", "stochastic", ef, "step3"),
        "other_seed": try_load("zero3", "error_feedback", ef, "step3", seed=99),
        "corrupted": try_load("zero3", "error_feedback", os.path.join(root, "corrupted"), "step3"),
        "truncated": try_load("zero3", "error_feedback", os.path.join(root, "truncated"), "step3"),
        "rank_file_missing": try_load("zero3", "error_feedback", os.path.join(root, "rank-missing"), "step3"),
        "two_saves": try_load("zero3", "error_feedback", os.path.join(root, "two-saves"), "step3"),
        "torn_zero_file": try_load("zero3", "error_feedback", os.path.join(root, "torn-zero-file"), "step3"),
        "zero_file_missing": try_load("zero3", "error_feedback", os.path.join(root, "zero-file-missing"), "step3"),
        "empty_latest": try_load("zero3", "error_feedback", os.path.join(root, "empty-latest"), None),
        "missing_reset": try_load("zero3", "error_feedback", os.path.join(root, "no-fair-cast"), "step1",
                                  on_missing_state="reset"),
    }
    if dist.get_rank() == 0:
        write_json(os.path.join(out, "bad_state.json"), bad)


def elastic(root: str, out: str, load_tag: str, save_tag: str | None) -> None:
    snaps = {}
    for stage in ELASTIC_STAGES:
        engine, fc = build(stage, "error_feedback", checkpoint={"load_universal": True})
        engine.load_checkpoint(os.path.join(root, f"{stage}-error_feedback"), tag=load_tag)
        got = {"loaded": snapshot(engine, fc)}
        replay = {k: r.clone() for k, r in fc.caster.residuals.items()}
        ok = []
        for step in range(engine.global_steps + 1, engine.global_steps + 3):
            train_step(engine, step, engine.global_rank)
            ok.append(replay_ok(fc, replay))
        got["continued_exact"] = all(ok)
        got["after"] = snapshot(engine, fc)
        if save_tag:
            engine.save_checkpoint(os.path.join(root, f"{stage}-error_feedback"), tag=save_tag)
        snaps[stage] = got
    if load_tag == "step3_universal":  # checkpoints converted by DeepSpeed's ds_to_universal: no fair_cast/
        engine, fc = build("zero3", "stochastic", checkpoint={"load_universal": True})
        engine.load_checkpoint(os.path.join(root, "zero3-stochastic"), tag="step3_ds_universal")
        snaps["ds_universal_stochastic"] = snapshot(engine, fc)
        snaps["ds_universal_error_feedback"] = try_load("zero3", "error_feedback", os.path.join(root, "zero3-error_feedback"),
                                                        "step3_ds_universal", extra={"checkpoint": {"load_universal": True}})
    save_rank0(snaps, os.path.join(out, f"elastic_ws{dist.get_world_size()}.pt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["straight", "resume", "crash", "elastic"])
    parser.add_argument("--root", required=True)
    parser.add_argument("--load-tag")
    parser.add_argument("--save-tag")
    parser.add_argument("--then-crash", action="store_true",
                        help="after the straight phase, in the same processes, the crash phase (the launch then fails)")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    out = os.environ["OUT_DIR"]
    if args.phase == "straight":
        straight(args.root, out)  # straight.pt is on disk before the crash phase's first collective
        if args.then_crash:
            crash(args.root, out)
    elif args.phase == "crash":
        crash(args.root, out)
    elif args.phase == "resume":
        resume(args.root, out)
    else:
        elastic(args.root, out, args.load_tag, args.save_tag)
    finish_and_exit()


if __name__ == "__main__":
    from common import freeze_the_imports

    freeze_the_imports()  # gc.collect() (DeepSpeed's and ours) then skips the imported modules
    main()
