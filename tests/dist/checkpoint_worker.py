"""Checkpoint phases under the `deepspeed` runner (driven by tests/test_checkpoint.py).

  straight  run 6 steps per combination, saving a checkpoint after step 3; snapshots after steps 3-6
  resume    new processes: load each step-3 checkpoint, snapshot, run steps 4-6; also resume the crashed
            run from its latest checkpoint, and try every bad checkpoint
  crash     save every 2 steps; rank 1 SIGKILLs itself after step 5
  elastic   load a universal checkpoint at this world size; snapshot; run on; save

A snapshot is the full served bits, fp32 masters and error-feedback residual of every parameter,
gathered for the test only (Fair Cast itself never gathers fp32).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

import deepspeed
import deepspeed.comm as dist
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ds_config, finish, full_served_bits, tiny_qwen3, train_step, write_json  # noqa: E402

from faircast_ds.casts import bf16_bits, cast, fp32_bits  # noqa: E402

COMBOS = [("zero3", "stochastic"), ("zero3", "error_feedback"), ("zero3", "dither"), ("zero3", "nearest"),
          ("zero2", "error_feedback"), ("zero1", "error_feedback"), ("bf16_optimizer", "error_feedback"),
          ("zero3+offload", "error_feedback"), ("zero2+offload", "stochastic")]


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
    """The served shard is exactly cast(master) with the test's own copy of the residual."""
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
            ok &= bool(torch.equal(want, got)) and bool(((got == lo) | (got == lo + 1)).all())
    return ok


def save_rank0(obj, path: str) -> None:
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(obj, path + ".tmp")
        os.replace(path + ".tmp", path)


def straight(root: str, out: str) -> None:
    records = {}
    for stage, mode in COMBOS:
        engine, fc = build(stage, mode)
        snaps = {}
        for step in range(1, 7):
            train_step(engine, step, engine.global_rank)
            if step == 3:
                engine.save_checkpoint(os.path.join(root, f"{stage}-{mode}"), tag="step3")
            if step >= 3:
                snaps[step] = snapshot(engine, fc)
        records[f"{stage}/{mode}"] = snaps
    engine, _ = build("zero3", None)  # a checkpoint from a run without Fair Cast
    train_step(engine, 1, engine.global_rank)
    engine.save_checkpoint(os.path.join(root, "no-fair-cast"), tag="step1")
    save_rank0(records, os.path.join(out, "straight.pt"))


def crash(root: str, out: str) -> None:
    engine, fc = build("zero3", "error_feedback")
    for step in range(1, 7):
        train_step(engine, step, engine.global_rank)
        if step == 5 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a node dies mid-run, without warning
        if step % 2 == 0:
            engine.save_checkpoint(os.path.join(root, "crash"))


def try_load(stage: str, mode: str, load_dir: str, tag: str | None, **fair_cast) -> dict:
    try:
        engine, fc = build(stage, mode, fair_cast=fair_cast)
        engine.load_checkpoint(load_dir, tag=tag)
        return {"ok": True, "step": fc.caster.step}
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        return {"ok": False, "type": type(exc).__name__, "message": str(exc)}


def resume(root: str, out: str) -> None:
    records = {}
    for stage, mode in COMBOS:
        engine, fc = build(stage, mode)
        engine.load_checkpoint(os.path.join(root, f"{stage}-{mode}"), tag="step3")
        snaps = {3: snapshot(engine, fc)}
        for step in range(4, 7):
            train_step(engine, step, engine.global_rank)
            snaps[step] = snapshot(engine, fc)
        records[f"{stage}/{mode}"] = snaps
    engine, fc = build("zero3", "error_feedback")  # the crashed run, from its latest checkpoint
    engine.load_checkpoint(os.path.join(root, "crash"))
    resumed_at = engine.global_steps
    for step in range(resumed_at + 1, 7):
        train_step(engine, step, engine.global_rank)
    records["crash"] = {"resumed_at": resumed_at, 6: snapshot(engine, fc)}
    save_rank0(records, os.path.join(out, "resume.pt"))

    bad = {
        "missing": try_load("zero3", "error_feedback", os.path.join(root, "no-fair-cast"), "step1"),
        "other_mode": try_load("zero3", "stochastic", os.path.join(root, "zero3-error_feedback"), "step3"),
        "other_seed": try_load("zero3", "error_feedback", os.path.join(root, "zero3-error_feedback"), "step3", seed=99),
        "corrupted": try_load("zero3", "error_feedback", os.path.join(root, "corrupted"), "step3"),
        "truncated": try_load("zero3", "error_feedback", os.path.join(root, "truncated"), "step3"),
        "rank_file_missing": try_load("zero3", "error_feedback", os.path.join(root, "rank-missing"), "step3"),
        "missing_reset": try_load("zero3", "error_feedback", os.path.join(root, "no-fair-cast"), "step1",
                                  on_missing_state="reset"),
    }
    if dist.get_rank() == 0:
        write_json(os.path.join(out, "bad_state.json"), bad)


def elastic(root: str, out: str, load_tag: str, save_tag: str | None) -> None:
    engine, fc = build("zero3", "error_feedback", checkpoint={"load_universal": True})
    engine.load_checkpoint(os.path.join(root, "zero3-error_feedback"), tag=load_tag)
    snaps = {"loaded": snapshot(engine, fc)}
    replay = {k: r.clone() for k, r in fc.caster.residuals.items()}
    ok = []
    for step in range(engine.global_steps + 1, engine.global_steps + 3):
        train_step(engine, step, engine.global_rank)
        ok.append(replay_ok(fc, replay))
    snaps["continued_exact"] = all(ok)
    snaps["after"] = snapshot(engine, fc)
    if save_tag:
        engine.save_checkpoint(os.path.join(root, "zero3-error_feedback"), tag=save_tag)
    save_rank0(snaps, os.path.join(out, f"elastic_ws{dist.get_world_size()}.pt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["straight", "resume", "crash", "elastic"])
    parser.add_argument("--root", required=True)
    parser.add_argument("--load-tag")
    parser.add_argument("--save-tag")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    out = os.environ["OUT_DIR"]
    if args.phase == "straight":
        straight(args.root, out)
    elif args.phase == "crash":
        crash(args.root, out)
    elif args.phase == "resume":
        resume(args.root, out)
    else:
        elastic(args.root, out, args.load_tag, args.save_tag)
    finish()


if __name__ == "__main__":
    main()
