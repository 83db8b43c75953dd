"""Fair Cast's state in Megatron-Core's distributed checkpoints (``megatron.core.dist_checkpointing``).

One more entry in the state dict you give ``dist_checkpointing.save`` and ``load``, beside the model's and
the optimizer's::

    from megatron.core import dist_checkpointing
    from faircast_ds.megatron import checkpoint as fair_cast_checkpoint

    model_sd = model.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd),
                             "fair_cast": fair_cast_checkpoint.sharded_state_dict(fc, model_sd)}, ckpt_dir)
    ...
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True),
             "fair_cast": fair_cast_checkpoint.sharded_state_dict(fc, model_sd)}
    loaded = dist_checkpointing.load(state, ckpt_dir)
    model.load_state_dict(loaded["model"]); optimizer.load_state_dict(loaded["optimizer"])
    fair_cast_checkpoint.load_state_dict(fc, loaded.get("fair_cast"))

What the entry holds: the mode, seed and noise step (common state, written once), and for
``error_feedback`` the residual. Given the model's sharded state dict, the residual is one more state
of each parameter in the model's space (each parameter's local residual, gathered over data parallel, as the
optimizer's ``fully_reshardable`` format), so it loads under another tensor, pipeline or
data-parallel layout; without it, one ShardedTensor per parameter of the parameter's flattened size, each
data-parallel rank's piece at its offset — uneven 1-D chunks, as the distributed optimizer's own
``dp_reshardable`` format keeps its buckets — which loads at any data-parallel size (a tensor-parallel
split parameter: one row per TP rank, the same TP size only). The served copy needs nothing more: the
model's bf16 parameters are it, and Megatron saves them. After the load the model serves the saved bits, the main params are the saved ones and the next step
casts exactly as a run that never stopped.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from faircast_ds._util import dist
from faircast_ds.shard.handle import FairCast
from faircast_ds.shard.state import (
    FairCastStateError,
    MissingStateError,
    cast_mismatch,
)

PREFIX = "fair_cast"
# the fair_cast entry of a Megatron checkpoint: settings and per-parameter state, no served bits (Megatron
# saves the bf16 parameters themselves), so it did not change with the DeepSpeed state file's /2
FORMAT = "faircast-ds/1"


def _params(adapter: Any) -> dict[str, Any]:
    from faircast_ds.megatron.adapters import parameter_names

    return {name: param for param, name in parameter_names(adapter.optimizer).items()}


def _tp(param: Any) -> tuple[int, int, bool]:
    """(size, rank, split) of the tensor-parallel group over ``param``: split parameters keep one residual
    row per tensor-parallel rank, the others one residual that every tensor-parallel rank holds alike."""
    from faircast_ds.megatron.layout import tp_group_of

    size, rank = tp_group_of(param)
    return size, rank, bool(getattr(param, "tensor_model_parallel", False)) and size > 1


def _model_space(model_sharded_state_dict: Any) -> dict:
    """parameter -> its ShardedTensor (or factory) in the model's sharded state dict."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import (
        extract_sharded_tensors_and_factories,
    )

    tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    return {sh.data: sh for sh in nested_values(tensors)}


@torch.no_grad()
def _model_space_residual(adapter: Any, space: dict) -> dict[str, Any]:
    """One entry per parameter of this rank: its whole local (TP slice) residual, gathered over the data-parallel
    group (each rank adds its own pieces' bits into zeros: exact), in the place of the parameter's
    ShardedTensor (or SwiGLU's factory), with the model's own replica ids (every DP rank holds it alike)."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    params = _params(adapter)
    by_name: dict[str, list] = {}
    for key, main, _, _ in adapter.flat_groups():
        by_name.setdefault(key[0], []).append((key[1], adapter.caster.residual_for(key, main)))
    group = getattr(adapter.optimizer, "data_parallel_group", None)
    out = {}
    for name in sorted(params):  # every rank walks the same parameters in the same order (a collective each)
        param = params[name]
        if param.dtype == torch.float32:
            continue  # copied, never cast: no residual
        whole = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        for start, piece in by_name.get(name, []):
            whole[start:start + piece.numel()] = piece
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(whole.view(torch.int32), group=group)  # disjoint pieces: a bitwise sum
        sh = space.get(param)
        if sh is None:
            raise FairCastStateError(f"{name} is not in the model's sharded state dict (build it from the "
                                     "parameters themselves, as the optimizer's is)")
        fields = dict(key=f"{PREFIX}.residual.{sh.key}", data=whole.view(param.shape))
        if not isinstance(sh, ShardedTensorFactory):
            fields["dtype"] = torch.float32
        out[name] = replace(sh, **fields)
    return out


def sharded_state_dict(fair_cast: FairCast, model_sharded_state_dict: Any = None) -> dict[str, Any]:
    """Fair Cast's entry of a ``dist_checkpointing`` state dict, for saving and for loading (the residual
    ShardedTensors point at the live residual buffers).

    With ``model_sharded_state_dict`` (the model's ``sharded_state_dict()``, the one given to the optimizer's)
    ``error_feedback``'s residual is laid out in the model's space, as the distributed optimizer's
    ``fully_reshardable`` format keeps its states: each parameter's local residual, gathered over the
    data-parallel group (an fp32 copy of this rank's bf16 parameters, held until the save is written), in place of the parameter's
    ShardedTensor (tensor- and pipeline-parallel offsets, SwiGLU's factory included), so it loads under any
    tensor, pipeline and data-parallel layout. Without it: the 1-D layout below (resharded over
    data-parallel sizes only)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    cfg = fair_cast.config
    state: dict[str, Any] = {"format": FORMAT, **fair_cast.summary()}
    if not cfg.spec.residual:
        return state
    residual = {}
    if model_sharded_state_dict is not None:
        for adapter in fair_cast.adapters:
            residual.update(_model_space_residual(adapter, _model_space(model_sharded_state_dict)))
        state["residual"] = residual
        return state
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
        if not cfg.spec.residual and step is not None:
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
        hint = "" if cfg.spec.residual else "pass step= (the optimizer steps taken) to recover it, or "
        raise MissingStateError(f"{problem}; {hint}set fair_cast.on_missing_state to 'reset' to start the residual "
                                "at zero instead")
    if state.get("format") != FORMAT:
        raise FairCastStateError(f"the checkpoint's fair_cast entry is not a {FORMAT} state")
    mismatch = cast_mismatch(state, cfg, "the checkpoint")
    if mismatch is not None:
        raise FairCastStateError(mismatch)
    if cfg.spec.residual:
        residual = state.get("residual") or {}
        for adapter in fair_cast.adapters:
            for key, main, _, _ in adapter.flat_groups():
                name, start = key
                loaded = residual.get(f"{name}@{start}")
                if loaded is None and name in residual:  # the model-space layout: this rank's range of the slice
                    loaded = residual[name].reshape(-1)[start:start + main.numel()]
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
    fair_cast.served_rewritten()  # Megatron's load wrote the bf16 weights: the next delta push is dense
    for adapter in fair_cast.adapters:
        if clear:
            adapter.caster.residuals.clear()
        adapter.caster.step = step
        adapter.caster.failed = None
