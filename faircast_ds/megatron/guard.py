"""The run-time guard on the Megatron route: what the distributed optimizer serves is what Fair Cast wrote.

The route-neutral :class:`faircast_ds.shard.guard.Guard` (one per DistributedOptimizer, on its caster) checks,
on every rank, this rank's range of the param buffer — the bf16 values the param all-gather serves,
read back after the gather — against the record of the caster's writes:

- after the first optimizer step, every bit; after each later step, a rotating sample;
- an optimizer step that Megatron applied (``step()`` reported a successful update) without any cast by
  Fair Cast fails too (a release whose step no longer calls the refresh site the cast replaces);
- after :func:`faircast_ds.megatron.checkpoint.load_state_dict`, every bit against the cast of the loaded
  main params at the restored noise step (Megatron's loads restore the bf16 model weights and the main
  params separately, so a checkpoint whose served weights are not the cast of its masters shows here).
  ``error_feedback`` is the exception: its served bits depend on the residual before the last cast,
  which no checkpoint keeps, so its load is not compared (its step checks still are).

A mismatch raises ``UnsupportedSetupError`` on every rank, naming the megatron-core release and where it
lives, the step or load, the parameter and element and the two bit patterns. Nothing here changes a
served bit.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from faircast_ds.casting.rules import cast_into
from faircast_ds.megatron import compat
from faircast_ds.shard.adapter import UnsupportedSetupError
from faircast_ds.shard.guard import Guard
from faircast_ds.shard.handle import FairCast

SITES = "DistributedOptimizer._copy_main_params_to_model_params"


def _explain() -> str:
    return (f"megatron-core {compat.release()} ({compat.release_location()}) refreshed the served bf16 copy outside "
            f"the cast site Fair Cast routes ({SITES}), so this run would serve round-to-nearest without saying so. "
            f"Fair Cast supports megatron-core{compat.SUPPORTED_RANGE} (tested: {', '.join(compat.TESTED)}); use a "
            "tested release, and report this one")


def _explain_load() -> str:
    return (f"The loaded bf16 model weights are not the cast of the loaded fp32 main params at the restored noise "
            f"step: the model and the optimizer state come from different checkpoints, or megatron-core "
            f"{compat.release()} ({compat.release_location()}) rebuilt the model weights on load (e.g. by "
            f"round-to-nearest), so this run would not serve what Fair Cast cast. Resume from one consistent "
            f"checkpoint. Fair Cast supports megatron-core{compat.SUPPORTED_RANGE} "
            f"(tested: {', '.join(compat.TESTED)})")


def guards(fair_cast: FairCast) -> list[Guard]:
    """The guards of ``fair_cast`` (one per DistributedOptimizer), or [] when none is installed."""
    return list(fair_cast.extras.get("guards", []))


def install(fair_cast: FairCast, optimizer: Any) -> list[Guard]:
    """Guard ``optimizer`` (the object ``attach`` was given: a DistributedOptimizer or a ChainedOptimizer):
    its ``step`` is wrapped on the instance to check after it returns."""
    made = [Guard(adapter, describe_sites=SITES, explain=_explain) for adapter in fair_cast.adapters]
    fair_cast.extras["guards"] = made
    state = {"checked": 0}
    inner_step = optimizer.step

    @functools.wraps(inner_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        before = [g.caster.step for g in made]
        for g in made:
            g.prepare(full=g.full_pending)
        result = inner_step(*args, **kwargs)
        applied = bool(result[0] if isinstance(result, tuple) else result)  # (update_successful, grad norm, zeros)
        cast_now = [g.caster.step != b for g, b in zip(made, before)]
        skipped = [not c and not g.adapter.optimizer.is_stub_optimizer for g, c in zip(made, cast_now)]
        if applied and any(skipped):  # (a stub optimizer owns no parameters here: nothing to cast)
            raise UnsupportedSetupError(f"fair_cast: optimizer step {state['checked'] + 1} ran without Fair Cast's "
                                        f"cast. {_explain()}")
        if applied:
            state["checked"] += 1
            site = "the first optimizer step" if state["checked"] == 1 else f"optimizer step {state['checked']}"
            for g in made:  # a collective per guard: every rank runs the same list
                g.check(f"{site} ({type(g.adapter.optimizer).__name__}.step)")
                g.steps_checked += 1
        else:
            for g in made:
                g.record_full, g.ready = False, {}
        return result

    optimizer.step = step
    return made


@torch.no_grad()
def check_after_load(fair_cast: FairCast, site: str) -> None:
    """Compare every served element with the cast of its loaded main value at the restored step (a
    collective); nothing for ``error_feedback`` (see the module docstring)."""
    cfg = fair_cast.config
    for g in guards(fair_cast):
        if cfg.spec.residual:
            g.full_pending = True  # the next step's check reads everything again
            continue
        g.prepare(full=True)
        for key, main, served, slices in g.adapter.flat_groups():
            flat = main.detach().reshape(-1)
            want = torch.empty(flat.numel(), dtype=served.dtype, device=flat.device)
            for s in slices:  # under tensor parallelism a shard may be runs of the full parameter: one call
                cast_into(want.narrow(0, s.offset, s.numel), flat.narrow(0, s.offset, s.numel), cfg.mode,
                          seed=cfg.seed, step=g.caster.step, name=s.name, start=s.start, runs=s.run_table)
            g.record(key, want, slices)
        steps_explain, g.explain = g.explain, _explain_load  # a load mismatch means something else than a step's
        try:
            g.check(site)
        finally:
            g.explain = steps_explain
        g.full_pending = True
