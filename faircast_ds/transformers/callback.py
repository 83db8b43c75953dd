"""Fair Cast's diagnostics in a transformers Trainer's logs (and so in W&B, TensorBoard, MLflow ...).

``FairCastCallback`` adds ``fair_cast/changed_fraction``, ``fair_cast/gap_spacings`` and
``fair_cast/lag_steps`` to every log the Trainer writes (TRL's trainers are Trainers), so they reach
whatever ``report_to`` the user configured and ``trainer.state.log_history``. With
``fair_cast.diagnostics.every: 0`` only the changed fraction is added (the gap and lag need the
sampled history).

The reporting callbacks (W&B, TensorBoard) are registered before user callbacks; a callback sees the
logs after the ones before it have sent them. So the callback moves itself to the front of the
Trainer's callback list when the Trainer tells it that initialization ended (``on_init_end``), and
:func:`add_callback` puts it there directly for a Trainer built without it.
"""
from __future__ import annotations

import gc
import math
from typing import Any

from transformers import TrainerCallback

from faircast_ds._util import dist
from faircast_ds.shard.handle import FairCast, get_fair_cast

PREFIX = "fair_cast/"


def find_handle(model: Any = None, optimizer: Any = None) -> FairCast | None:
    """The Fair Cast serving ``model`` (the module a DeepSpeed engine wraps) or ``optimizer`` (as the
    Trainer holds it: Accelerate's wrapper around the engine's optimizer)."""
    candidates = [model, getattr(model, "module", None)]
    inner = optimizer
    for _ in range(3):  # AcceleratedOptimizer -> DeepSpeed's ZeRO optimizer
        candidates.append(inner)
        inner = getattr(inner, "optimizer", None)
    return next((h for h in map(get_fair_cast, candidates) if h is not None), None)


class FairCastCallback(TrainerCallback):
    """Adds Fair Cast's figures to the Trainer's logs. Every rank runs it (the figures are reduced over
    ranks: a collective, called where the Trainer logs, which it does on every rank).

    ``lora_merge=True`` also makes PEFT's LoRA merges (``merge_adapter``, used by TRL before a vLLM
    weight sync) cast with the engine's configured mode (:mod:`faircast_ds.transformers.lora`).
    """

    def __init__(self, prefix: str = PREFIX, lora_merge: bool = False) -> None:
        self.prefix = prefix
        self.lora_merge = lora_merge
        self._merge_installed = False
        self.last: dict[str, float] = {}

    # -- ordering: ahead of the reporting callbacks -----------------------------------------------
    def _move_to_front(self) -> None:
        """Put this callback first in the CallbackHandler's list that holds it (safe while the handler
        iterates over that list: the entries after ours keep their positions)."""
        from transformers.trainer_callback import CallbackHandler

        def held_by_handler(holder: list) -> bool:
            for owner in gc.get_referrers(holder):  # the handler itself, or its __dict__
                if isinstance(owner, CallbackHandler):
                    return True
                if isinstance(owner, dict) and any(isinstance(h, CallbackHandler) for h in gc.get_referrers(owner)):
                    return True
            return False

        for holder in gc.get_referrers(self):
            if (isinstance(holder, list) and holder and holder[0] is not self
                    and all(isinstance(c, TrainerCallback) for c in holder) and held_by_handler(holder)):
                holder.remove(self)
                holder.insert(0, self)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._move_to_front()

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self._move_to_front()  # added after the Trainer was built (trainer.add_callback)
        self._maybe_install_merge(find_handle(model, optimizer), model)  # the engine exists by now

    def _maybe_install_merge(self, handle: FairCast | None, model: Any) -> None:
        if not self.lora_merge or self._merge_installed or handle is None or model is None:
            return
        from faircast_ds.transformers.lora import install_lora_merge, lora_layers

        if lora_layers(model):
            install_lora_merge(model, handle)
        self._merge_installed = True

    # -- the figures -----------------------------------------------------------------------------
    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, model: Any = None,
               optimizer: Any = None, **kwargs: Any) -> None:
        if logs is None:
            return
        handle = find_handle(model, optimizer)
        if handle is None:  # not (yet) a Fair Cast engine: the same on every rank
            return
        self._maybe_install_merge(handle, model)
        if handle.diagnostics is not None:
            figures = handle.report()
        else:
            figures = {"changed_fraction": handle.stats()["changed_fraction"]}
        # NaN (e.g. the drift lag before two steps of history) is left out: JSON loggers refuse it
        items = {f"{self.prefix}{k}": float(v) for k, v in figures.items() if k != "step" and math.isfinite(v)}
        self.last = items
        logs.update(items)
        history = getattr(state, "log_history", None)
        if history and history[-1].get("step") == state.global_step:  # the entry Trainer.log just appended
            history[-1].update(items)


def add_callback(trainer: Any, **kwargs: Any) -> FairCastCallback:
    """Add a :class:`FairCastCallback` to ``trainer`` ahead of its reporting callbacks; returns it."""
    callback = FairCastCallback(**kwargs)
    trainer.callback_handler.callbacks.insert(0, callback)
    dist.log_rank0("[fair_cast] Trainer logs get fair_cast/changed_fraction, gap_spacings, lag_steps")
    return callback
