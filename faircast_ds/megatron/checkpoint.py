"""Fair Cast's state in Megatron-Core's distributed checkpoints (``megatron.core.dist_checkpointing``).

One more entry in the state dict you give ``dist_checkpointing.save`` and ``load``, beside the model's and
the optimizer's::

    from megatron.core import dist_checkpointing
    from faircast_ds.megatron import checkpoint as fair_cast_checkpoint

    model_sd = model.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd),
                             "fair_cast": fair_cast_checkpoint.sharded_state_dict(fc)}, ckpt_dir)
    ...
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True),
             "fair_cast": fair_cast_checkpoint.sharded_state_dict(fc)}
    loaded = dist_checkpointing.load(state, ckpt_dir)
    model.load_state_dict(loaded["model"]); optimizer.load_state_dict(loaded["optimizer"])
    fair_cast_checkpoint.load_state_dict(fc, loaded.get("fair_cast"))

What the entry holds: the mode, seed and noise step (common state, written once), and for
``error_feedback`` the residual, one ShardedTensor per parameter of the parameter's flattened size, each
data-parallel rank's piece at its offset — uneven 1-D chunks, as the distributed optimizer's own
``dp_reshardable`` format keeps its buckets — so it saves in parallel and loads at any data-parallel
size. The served copy needs nothing more: the model's bf16 parameters are it, and Megatron saves them.
After the load the model serves the saved bits, the main params are the saved ones and the next step
casts exactly as a run that never stopped.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from faircast_ds import dist
from faircast_ds.cast_state import FORMAT, FairCastStateError, MissingStateError, cast_mismatch
from faircast_ds.handle import FairCast

PREFIX = "fair_cast"


def _params(adapter: Any) -> dict[str, Any]:
    from faircast_ds.megatron.adapter import parameter_names

    return {name: param for param, name in parameter_names(adapter.optimizer).items()}


def _tp(param: Any) -> tuple[int, int, bool]:
    """(size, rank, split) of the tensor-parallel group over ``param``: split parameters keep one residual
    row per tensor-parallel rank, the others one residual that every tensor-parallel rank holds alike."""
    from faircast_ds.megatron.layout import tp_group_of

    size, rank = tp_group_of(param)
    return size, rank, bool(getattr(param, "tensor_model_parallel", False)) and size > 1


def sharded_state_dict(fair_cast: FairCast) -> dict[str, Any]:
    """Fair Cast's entry of a ``dist_checkpointing`` state dict, for saving and for loading (the residual
    ShardedTensors point at the live residual buffers)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    cfg = fair_cast.config
    state: dict[str, Any] = {"format": FORMAT, "mode": cfg.mode, "seed": cfg.seed,
                             "step": max((a.caster.step for a in fair_cast.adapters), default=0)}
    if cfg.mode != "error_feedback":
        return state
    residual = {}
    for adapter in fair_cast.adapters:
        params = _params(adapter)
        for key, main, _, _ in adapter.flat_groups():
            name, start = key  # one flat shard per (parameter, start in this rank's flattened parameter)
            data = adapter.caster.residual_for(key, main)
            numel, total = data.numel(), params[name].numel()
            size, rank, split = _tp(params[name])
            if split:  # this rank's slice: its own row of the residual (resumed at the same tensor-parallel size)
                residual[f"{name}@{start}"] = ShardedTensor(
                    f"{PREFIX}.residual.{name}", data.view(1, numel), data.dtype, (1, numel), (size, total),
                    (rank, start), axis_fragmentations=None, replica_id=(0, 0, 0))
            else:  # every tensor-parallel rank holds the same residual: the first one saves it
                residual[f"{name}@{start}"] = ShardedTensor(
                    f"{PREFIX}.residual.{name}", data, data.dtype, (numel,), (total,), (start,),
                    axis_fragmentations=None, replica_id=(rank, 0, 0))
    state["residual"] = residual
    return state


@torch.no_grad()
def load_state_dict(fair_cast: FairCast, state: Mapping[str, Any] | None, *, step: int | None = None) -> int:
    """Restore Fair Cast's state from the ``"fair_cast"`` entry ``dist_checkpointing.load`` returned, after
    the model's and the optimizer's; returns the noise step. ``state`` None (a checkpoint saved without
    it): for every mode but ``error_feedback`` the whole state is (mode, seed, step), taken from this run's
    config and ``step`` (the optimizer steps the checkpoint's run took), with a log line; otherwise an error,
    unless ``on_missing_state: reset`` (residual zero, noise step ``step`` or 0)."""
    cfg = fair_cast.config
    if state is None:
        problem = "no Fair Cast state in this checkpoint (saved without faircast_ds.megatron.checkpoint's entry)"
        if cfg.mode != "error_feedback" and step is not None:
            _set(fair_cast, step, clear=True)
            dist.log_rank0(f"[fair_cast] {problem}; mode={cfg.mode} keeps nothing beyond (mode, seed, step): mode and "
                           f"seed={cfg.seed} from this run's config, noise step {step} as given")
            from faircast_ds.megatron import guard

            guard.check_after_load(fair_cast, f"the checkpoint load (noise step {step}, given)")
            return step
        if cfg.on_missing_state == "reset":
            _set(fair_cast, step or 0, clear=True)
            dist.log_rank0(f"[fair_cast] WARNING {problem}; on_missing_state=reset: residual starts at zero, noise step "
                           f"{step or 0}")
            return step or 0
        hint = "" if cfg.mode == "error_feedback" else "pass step= (the optimizer steps taken) to recover it, or "
        raise MissingStateError(f"{problem}; {hint}set fair_cast.on_missing_state to 'reset' to start the residual "
                                "at zero instead")
    if state.get("format") != FORMAT:
        raise FairCastStateError(f"the checkpoint's fair_cast entry is not a {FORMAT} state")
    mismatch = cast_mismatch(state, cfg, "the checkpoint")
    if mismatch is not None:
        raise FairCastStateError(mismatch)
    if cfg.mode == "error_feedback":
        residual = state.get("residual") or {}
        for adapter in fair_cast.adapters:
            for key, main, _, _ in adapter.flat_groups():
                name, start = key
                loaded = residual.get(f"{name}@{start}")
                if loaded is None:
                    raise FairCastStateError(f"the checkpoint's fair_cast entry has no residual for {name} "
                                             f"[{start}, {start + main.numel()})")
                target = adapter.caster.residual_for(key, main)
                if loaded.data_ptr() != target.data_ptr():
                    target.copy_(loaded.reshape(-1))
    _set(fair_cast, int(state["step"]), clear=False)
    dist.log_rank0(f"[fair_cast] restored state from the Megatron checkpoint: mode={cfg.mode} step={state['step']}")
    from faircast_ds.megatron import guard

    guard.check_after_load(fair_cast, f"the checkpoint load (noise step {state['step']})")
    return int(state["step"])


def _set(fair_cast: FairCast, step: int, *, clear: bool) -> None:
    for adapter in fair_cast.adapters:
        if clear:
            adapter.caster.residuals.clear()
        adapter.caster.step = step
        adapter.caster.failed = None
