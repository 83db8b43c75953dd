"""One launch per route for tests/deepspeed_tests/test_patch_deepspeed.py: the same training cases on the runtime route
(an unmodified DeepSpeed, Fair Cast from the interpreter-start hook) or on a patched DeepSpeed copy
(FAIRCAST_DS_AUTOLOAD=0, Fair Cast through ``faircast_ds.deepspeed.attach(engine, route="hook")``).

Each case starts from deterministic fp32 masters, trains a few steps and then runs the optimizer's
checkpoint-load refresh site; rank 0 saves every parameter's served bits after each of those, so the
test can compare the two routes bit for bit. ROUTE=patched also checks that nothing was wrapped at
runtime, that DeepSpeed parsed the fair_cast section itself, that an unattached engine still gets
DeepSpeed's round-to-nearest copy, and that the runtime route on the patched DeepSpeed gives the same
bits without casting twice.
"""
from __future__ import annotations

import collections
import os
import sys
import time

import deepspeed
import deepspeed.comm as dist
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (deterministic_master, ds_config, finish_and_exit, full_served_bits, gather_shards,  # noqa: E402
                    tiny_qwen3, train_step, write_json)

from faircast_ds.shard.handle import get_fair_cast  # noqa: E402
from faircast_ds.casting.bits import bf16_bits  # noqa: E402
from faircast_ds.casting.noise import name_id  # noqa: E402

OUT = os.environ["OUT_DIR"]
ROUTE = os.environ["ROUTE"]  # "runtime" or "patched"
STEPS = 3

CASES = [("zero1", "stochastic"), ("zero2", "error_feedback"), ("zero2+offload", "stochastic"),
         ("zero3", "stochastic"), ("zero3", "error_feedback"), ("bf16_optimizer", "error_feedback")]
COEXIST = [("zero2", "error_feedback"), ("zero3", "error_feedback")]  # runtime route on the patched DeepSpeed


def build(stage: str, mode: str | None):
    model = tiny_qwen3(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(mode, stage=stage))
    return engine


def attach(engine):
    if ROUTE == "runtime" or get_fair_cast(engine) is not None:
        return get_fair_cast(engine)
    from faircast_ds.deepspeed import attach as attach_engine

    return attach_engine(engine, route="hook")


def load_site_refresh(engine) -> None:
    """The refresh a checkpoint load runs after restoring fp32 (here from the masters as they are)."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() == 3:
        opt._rigid_load_state_dict(opt.state_dict(), load_optimizer_states=False)
    else:
        opt.update_lp_params()  # what DeepSpeed calls after a universal checkpoint load


def run_case(stage: str, mode: str, counts: collections.Counter) -> dict:
    started = time.perf_counter()
    engine = build(stage, mode)
    fc = attach(engine)
    for _, master, _, slices in fc.adapter.flat_groups():
        for s in (s for s in slices if not s.is_padding):
            master.data[s.offset:s.offset + s.numel] = deterministic_master(name_id(s.name), s.start, s.numel)
    numels = {n: getattr(p, "ds_numel", p.numel()) for n, p in engine.module.named_parameters()}
    before = dict(counts)
    steps, losses = [], []
    for step in range(1, STEPS + 1):
        losses.append(train_step(engine, step, engine.global_rank))
        steps.append(full_served_bits(engine))
    load_site_refresh(engine)
    _, loaded = gather_shards(fc, numels)
    return {"steps": steps, "losses": losses, "load": loaded, "caster_step": fc.caster.step,
            "hook_calls": {k: counts[k] - before.get(k, 0) for k in counts},
            "native_mode": getattr(getattr(engine._config, "fair_cast_config", None), "mode", None),
            "runtime_wrapped": _runtime_wrapped(engine), "routed": _routed(engine),
            "seconds": round(time.perf_counter() - started, 1)}


def _routed(engine) -> bool:
    """Whether the patched route serves this engine (and only it: attach hands back a runtime handle)."""
    if ROUTE != "patched":
        return False
    from faircast_ds.deepspeed import attach as attach_engine, hook as patched

    again = attach_engine(engine, route="hook")
    runtime = get_fair_cast(engine)
    assert runtime is None or again is runtime, "attach(route='hook') did not hand back the runtime route's handle"
    from faircast_ds.shard.routes import ROUTES

    route = ROUTES.get(engine.optimizer)
    return route is not None and route.kind == patched.ROUTE


def _runtime_wrapped(engine) -> bool:
    """Whether any of our runtime wrappers sits on this engine's optimizer."""
    from deepspeed.runtime import bf16_optimizer
    from deepspeed.runtime.zero import stage_1_and_2

    opt = engine.optimizer
    overridden = {"_reassign_or_swap_out_partitioned_parameters", "step", "_rigid_load_state_dict"} & set(vars(opt))
    gathers = [getattr(m.all_gather_dp_groups, "_faircast_wrapped", False) for m in (stage_1_and_2, bf16_optimizer)]
    return bool(overridden) or any(gathers)


def count_hook_calls(counts: collections.Counter) -> None:
    """Wrap the installed cast hook to count refreshes (after a step / on a load) that it took."""
    from deepspeed.runtime import lp_cast

    inner = lp_cast.get_lp_cast_hook()

    def counting(lp, hp, context):
        took = inner(lp, hp, context)
        if took:
            counts["after_step" if context.after_step else "load"] += 1
        return took

    lp_cast.set_lp_cast_hook(counting)


def default_copy_is_round_to_nearest() -> bool:
    """A patched DeepSpeed engine that nobody attached keeps DeepSpeed's plain copy."""
    engine = build("zero2", None)
    train_step(engine, 1, engine.global_rank)
    opt = engine.optimizer
    ok = True
    for i, master in enumerate(opt.single_partition_of_fp32_groups):
        served = opt.parallel_partitioned_bit16_groups[i][dist.get_rank(group=opt.real_dp_process_group[i])]
        ok &= bool(torch.equal(bf16_bits(served.detach()), bf16_bits(master.detach().to(torch.bfloat16))))
    return ok


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    counts: collections.Counter = collections.Counter()
    report: dict = {"route": ROUTE, "deepspeed_file": deepspeed.__file__}
    results = {}
    if ROUTE == "patched":
        from deepspeed.runtime.engine import DeepSpeedEngine

        from faircast_ds.deepspeed import attach as attach_engine, hook as patched

        report["has_hook"] = patched.deepspeed_has_cast_hook()
        report["engine_init_hooked"] = bool(getattr(DeepSpeedEngine.__init__, "_faircast_wrapped", False))
        first = build(*CASES[0])  # installs our hook; from here on every refresh is counted
        attach_engine(first, route="hook")
        count_hook_calls(counts)
        from faircast_ds.shard.routes import ROUTES

        ROUTES.remove(first.optimizer)
    for stage, mode in CASES:
        results[f"{stage}/{mode}"] = run_case(stage, mode, counts)
    if ROUTE == "patched":
        report["default_is_rn"] = default_copy_is_round_to_nearest()
        import faircast_ds

        faircast_ds.install()  # the runtime route, now on the patched DeepSpeed
        for stage, mode in COEXIST:
            results[f"coexist/{stage}/{mode}"] = run_case(stage, mode, counts)
    keep = ("caster_step", "hook_calls", "native_mode", "runtime_wrapped", "routed", "losses", "seconds")
    report["cases"] = {k: {x: v[x] for x in keep} for k, v in results.items()}
    write_json(os.path.join(OUT, f"report_rank{rank}.json"), report)
    if rank == 0:
        torch.save({k: {"steps": v["steps"], "load": v["load"]} for k, v in results.items()},
                   os.path.join(OUT, "bits.pt"))
    finish_and_exit()


if __name__ == "__main__":
    from common import freeze_the_imports

    freeze_the_imports()  # gc.collect() (DeepSpeed's and ours) then skips the imported modules
    main()
