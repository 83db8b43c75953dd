"""One launch per DeepSpeed release (tests/deepspeed_tests/test_releases.py): every supported optimizer class in every
mode on the same deterministic fp32 masters, the staging route forced on CPU, a save -> load ->
continue round trip, and casts deliberately bypassed so that the guard must stop the run.

The release is whichever ``deepspeed`` is first on PYTHONPATH; each rank writes which one it really
imported (version and file) into $OUT_DIR/releases_rank{r}.json, rank 0 the served bits into
$OUT_DIR/served.pt. Fair Cast arrives through the interpreter-start hook, as in stages_worker.py, whose
builders this script reuses.
"""
from __future__ import annotations

import gc
import inspect
import os
import sys
import traceback
import types

import deepspeed
import deepspeed.comm as dist
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint_worker  # noqa: E402
from checkpoint_worker import snapshot  # noqa: E402
from common import finish, tampered_checkpoint_copy, train_step, write_json  # noqa: E402
from stages_worker import build, set_deterministic_masters  # noqa: E402

from faircast_ds.shard.adapter import UnsupportedSetupError  # noqa: E402
from faircast_ds.casting.bits import bf16_bits
from faircast_ds.casting.modes import MODES  # noqa: E402
from faircast_ds.deepspeed import compat  # noqa: E402
from faircast_ds.shard.caster import STAGING_ENV  # noqa: E402

OUT = os.environ["OUT_DIR"]



def served_bits(engine) -> dict[str, torch.Tensor]:
    """Every parameter's served bf16 bits, gathered one parameter at a time under ZeRO-3 (as RL weight syncs
    do). Not common.full_served_bits's one GatheredParameters over all parameters: in 0.16.8 - 0.19.5
    (read from their sources; 0.19.8 waits on each) DeepSpeed's multi-parameter gather waits on its last
    all-gather only, which on gloo can hand back a parameter whose all-gather has not finished (seen:
    0.16.9, ZeRO-3, a busy machine); on CUDA the stream orders them."""
    import deepspeed

    def read(param) -> torch.Tensor:
        with deepspeed.zero.GatheredParameters([param], enabled=engine.zero_optimization_stage() == 3):
            return bf16_bits(param.detach().reshape(-1)).clone()

    out = {}
    for name, param in engine.module.named_parameters():
        # Read until two reads agree on every rank (at most 5). Seen once more in a full suite on 2 busy
        # cores: 0.16.9, ZeRO-3, one parameter at a time, a layer norm's "served bits" read as heap addresses
        # (an all-gather not finished when the gather returned; likely a parameter its prefetch left in
        # flight, which 0.16.9's blocking gather skips). A served copy that itself held wrong bits reads the same
        # twice, so this hides nothing the test checks; every rank takes the same number of reads (each
        # read is a collective).
        bits = read(param)
        for _ in range(4):
            again = read(param)
            differs = torch.tensor([int(not torch.equal(again, bits))])
            torch.distributed.all_reduce(differs)
            bits = again
            if not int(differs):
                break
        out[name] = bits
    return out


# the shared snapshot helper, with the gather above and torch's all_gather_object (deepspeed.comm has
# none before 0.17)
checkpoint_worker.dist = torch.distributed
checkpoint_worker.full_served_bits = served_bits


def apply_upstream_flatten_fix() -> bool:
    """DeepSpeed 0.18.9's ZeRO-1/2 flattens the bf16 parameters on the accelerator without detaching them
    (its "flatten_on_gpu" path), so the flat buffer carries autograd history and the first step fails on a
    CPU accelerator, with or without Fair Cast ("Output 0 of Split is a view and is being modified
    inplace"). DeepSpeed fixed it upstream after 0.18.9 by detaching that buffer (PR 7948); the same
    one-line fix is applied here, for the releases that have the path, so that their cast sites can be
    tested on CPU. Nothing in faircast_ds does this."""
    from deepspeed.runtime.zero import stage_1_and_2

    cls = stage_1_and_2.DeepSpeedZeroOptimizer
    if "flatten_on_gpu" not in inspect.getsource(cls.__init__):
        return False
    flatten = cls.flatten_dense_tensors_aligned

    def detached(self, *args, **kwargs):
        return flatten(self, *args, **kwargs).detach()

    cls.flatten_dense_tensors_aligned = detached
    return True
STAGES = ("zero1", "zero2", "zero2+offload", "zero3", "zero3+offload", "bf16_optimizer")
FORCED = [("zero2+offload", "stochastic"), ("zero2+offload", "error_feedback"), ("zero1+offload", "dither"),
          ("zero3+offload", "error_feedback")]
ROUND_TRIPS = [("zero3", "error_feedback"), ("zero2", "error_feedback")]


def served_case(stage: str, mode: str, *, forced: bool = False) -> tuple[dict, list]:
    """Two casts of the same deterministic masters (lr 0 keeps them fixed): the served bits after each."""
    if forced:
        os.environ[STAGING_ENV] = "always"
    try:
        engine, fc = build(mode, stage, lr=0.0)
    except UnsupportedSetupError as exc:  # a setup this release cannot give Fair Cast (the test says which)
        return {"refused": str(exc)}, None
    finally:
        os.environ.pop(STAGING_ENV, None)
    set_deterministic_masters(fc)
    bits = []
    for step in (1, 2):
        train_step(engine, step, engine.global_rank)
        bits.append(served_bits(engine))
    opt = engine.optimizer
    info = {"optimizer": type(opt).__name__, "facts": compat.facts(opt, engine._config),
            "guard_steps_checked": fc.extras["guard"].steps_checked, "force_staging": fc.caster.force_staging,
            "own_staging": sorted(str(k) for k in fc.caster.stages)}
    staging = compat.zero12_offload_staging(opt, 0) if info["optimizer"] == "DeepSpeedZeroOptimizer" else None
    if staging is not None:  # what Fair Cast last cast is in DeepSpeed's pinned buffer (the staged route used it)
        served = fc.adapter.served(0)
        mask = torch.zeros(served.numel(), dtype=torch.bool)
        for s in fc.adapter.group_slices(0):
            if not s.is_padding:
                mask[s.offset:s.offset + s.numel] = True
        info["deepspeed_buffer_holds_served"] = bool(torch.equal(bf16_bits(staging.detach())[mask],
                                                                 bf16_bits(served.detach())[mask]))
    del engine, fc
    gc.collect()
    return info, bits


def round_trip(stage: str, mode: str, root: str) -> dict:
    """Steps 1-2, save, step 3; then a new engine loads the step-2 checkpoint and runs step 3."""
    engine, fc = build(mode, stage)
    for step in (1, 2):
        train_step(engine, step, engine.global_rank)
    saved = snapshot(engine, fc)
    engine.save_checkpoint(root, tag="step2")
    train_step(engine, 3, engine.global_rank)
    straight = snapshot(engine, fc)
    del engine, fc
    engine, fc = build(mode, stage)
    engine.load_checkpoint(root, tag="step2")
    loaded = snapshot(engine, fc)
    train_step(engine, 3, engine.global_rank)
    resumed = snapshot(engine, fc)
    return {"saved": saved, "loaded": loaded, "straight": straight, "resumed": resumed,
            "guard_steps_checked": fc.extras["guard"].steps_checked}


def overwrite_after_cast(opt) -> None:
    """Make this DeepSpeed refresh the served partition by round-to-nearest after Fair Cast's cast, as a
    release whose cast site moved would: ZeRO-1/2 when it re-points the model's bf16 weights (after the
    all-gather), ZeRO-3 when it unflattens a sub-group's partition."""
    name = type(opt).__name__
    if name == "DeepSpeedZeroOptimizer":
        original = opt._update_model_bit16_weights

        def rn_then_update(i):
            rank = dist.get_rank(group=opt.real_dp_process_group[i])
            opt.parallel_partitioned_bit16_groups[i][rank].data.copy_(opt.single_partition_of_fp32_groups[i].data)
            return original(i)

        opt._update_model_bit16_weights = rn_then_update
    elif name == "DeepSpeedZeroOptimizer_Stage3":
        original = opt._unflatten_partitioned_parameters

        def rn_then_unflatten(i):
            opt.fp16_partitioned_groups_flat[i].data.copy_(opt.fp32_partitioned_groups_flat[i].data)
            return original(i)

        opt._unflatten_partitioned_parameters = rn_then_unflatten
    else:
        raise ValueError(name)


def bypassed(kind: str, stage: str, mode: str, load_root: str | None = None) -> dict:
    """A cast site bypassed on purpose; the guard must raise UnsupportedSetupError naming it."""
    if kind == "load" and stage == "zero2":
        # one module element changed on disk, so that the restore changes a bit and gathers (and the bypass fires)
        load_root = tampered_checkpoint_copy(load_root, load_root + "-tampered", "step2")
    engine, fc = build(mode, stage)
    opt = engine.optimizer
    if kind == "never_cast":  # the release calls DeepSpeed's own refresh, not the method Fair Cast replaced
        opt._reassign_or_swap_out_partitioned_parameters = types.MethodType(
            type(opt)._reassign_or_swap_out_partitioned_parameters, opt)
    else:
        overwrite_after_cast(opt)
    try:
        if kind == "load":
            engine.load_checkpoint(load_root, tag="step2")
        else:
            train_step(engine, 1, engine.global_rank)
        return {"raised": False}
    except UnsupportedSetupError as exc:
        return {"raised": True, "type": type(exc).__name__, "message": str(exc)}
    finally:
        del engine, fc
        gc.collect()


def attempt(report: dict, key: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - recorded for the test, which names the case
        report["errors"][key] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
        return None


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    report = {"version": deepspeed.__version__, "file": deepspeed.__file__, "world": dist.get_world_size(),
              "range_problem": compat.release_problem(), "upstream_flatten_fix": apply_upstream_flatten_fix(),
              "bf16_optimizer_buildable": compat.bf16_optimizer_buildable(),
              "cases": {}, "forced": {}, "round_trips": {}, "bypassed": {}, "errors": {}}
    served, forced, trips = {}, {}, {}
    for stage in STAGES:
        for mode in MODES:
            got = attempt(report, f"{stage}/{mode}", served_case, stage, mode)
            if got is not None:
                report["cases"][f"{stage}/{mode}"] = got[0]
                if got[1] is not None:
                    served[f"{stage}/{mode}"] = got[1]
    for stage, mode in FORCED:
        got = attempt(report, f"forced {stage}/{mode}", served_case, stage, mode, forced=True)
        if got is not None:
            report["forced"][f"{stage}/{mode}"], forced[f"{stage}/{mode}"] = got
    for stage, mode in ROUND_TRIPS:
        root = os.path.join(OUT, "ckpt", f"{stage}-{mode}")
        got = attempt(report, f"round trip {stage}/{mode}", round_trip, stage, mode, root)
        if got is not None:
            trips[f"{stage}/{mode}"] = got
            report["round_trips"][f"{stage}/{mode}"] = {"guard_steps_checked": got.pop("guard_steps_checked")}
    for kind, stage, mode, root in [("step", "zero2", "stochastic", None), ("step", "zero3", "stochastic", None),
                                    ("never_cast", "zero3", "stochastic", None),
                                    ("load", "zero2", "error_feedback", os.path.join(OUT, "ckpt", "zero2-error_feedback")),
                                    ("load", "zero3", "error_feedback", os.path.join(OUT, "ckpt", "zero3-error_feedback"))]:
        got = attempt(report, f"bypassed {kind} {stage}", bypassed, kind, stage, mode, root)
        if got is not None:
            report["bypassed"][f"{kind}/{stage}"] = got
    write_json(os.path.join(OUT, f"releases_rank{rank}.json"), report)
    if rank == 0:
        torch.save({"served": served, "forced": forced, "round_trips": trips}, os.path.join(OUT, "served.pt"))
    finish()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    from common import freeze_the_imports

    freeze_the_imports()  # gc.collect() (DeepSpeed's and ours) then skips the imported modules
    main()
