"""Fair Cast's state in a DeepSpeed engine's checkpoints: ``save_checkpoint`` writes it (before
DeepSpeed's own files, so ``latest`` never names a checkpoint without it) and ``load_checkpoint``
restores it, so that the served bits after a load are the ones served at save time. The state
file format is ``faircast_ds.checkpoint``."""
from __future__ import annotations

import functools
import inspect
import os
from typing import Any

from faircast_ds import dist
from faircast_ds.checkpoint import FairCastStateError, publish_restored, reset_state, restore_state, save_state
from faircast_ds.handle import FairCast


def wrap_checkpointing(engine: Any, fair_cast: FairCast) -> None:
    """Save Fair Cast's state with every engine checkpoint, restore it with every load."""
    save, load = engine.save_checkpoint, engine.load_checkpoint

    @functools.wraps(save)
    def save_checkpoint(save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"  # DeepSpeed's default
        rank, world = dist.rank_world()
        # ours first: DeepSpeed writes `latest` last, so it never names a checkpoint without our state
        save_state(fair_cast.adapter, fair_cast.caster, os.path.join(save_dir, tag), rank=rank, world=world)
        return save(save_dir, tag, *args, **kwargs)

    @functools.wraps(load)
    def load_checkpoint(load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        result = load(load_dir, tag, *args, **kwargs)
        if result is None or result[0] is None:
            return result  # nothing was loaded
        if tag is None:
            latest = "latest_universal" if engine.load_universal_checkpoint() else "latest"
            with open(os.path.join(load_dir, latest)) as f:
                tag = f.read().strip()
        tag_dir = os.path.join(load_dir, str(tag))
        given = inspect.signature(load).bind(load_dir, tag, *args, **kwargs)
        given.apply_defaults()
        optimizer_loaded = given.arguments["load_optimizer_states"] and not given.arguments["load_module_only"]
        if not optimizer_loaded:
            reset_state(fair_cast.adapter, fair_cast.caster, engine.global_steps)
            dist.log_rank0(f"[fair_cast] {tag_dir}: module-only load, residual starts at zero, noise step "
                           f"{engine.global_steps}")
            return result
        error = dist.first_failure(lambda: restore_state(fair_cast.adapter, fair_cast.caster, tag_dir),
                                   FairCastStateError)
        if error is None:
            publish_restored(fair_cast.adapter, fair_cast.caster)
            dist.log_rank0(f"[fair_cast] restored state from {tag_dir}: mode={fair_cast.config.mode} "
                           f"step={fair_cast.caster.step}")
        elif fair_cast.config.on_missing_state == "error":
            raise FairCastStateError(f"{error}. Set fair_cast.on_missing_state to 'reset' to start the residual "
                                     "at zero instead.")
        else:
            reset_state(fair_cast.adapter, fair_cast.caster, engine.global_steps)
            dist.log_rank0(f"[fair_cast] WARNING {error}; on_missing_state=reset: residual starts at zero, noise "
                           f"step {engine.global_steps}")
        return result

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint
