"""LoRA merges through the configured cast, not round-to-nearest.

TRL (before each vLLM weight sync) and ms-swift merge LoRA adapters into the bf16 base weights with
PEFT's ``merge_adapter``: ``W += B @ A * scale`` in bf16, which rounds to nearest again. A LoRA update
smaller than half a bf16 spacing of ``W`` is then lost entirely at every merge, however well the
adapters themselves were cast, and ``unmerge_adapter`` (``W -= B @ A * scale``, rounded again) does not
give ``W`` back bit for bit.

:func:`install_lora_merge` replaces ``merge`` and ``unmerge`` of every PEFT ``lora.Linear`` in one model:
the merge computes ``W + B @ A * scale`` in fp32 and casts it with the Fair Cast mode and seed
(noise keyed by the layer's name and the engine's optimizer step, so each sync draws fresh noise);
the unmerge restores ``W``'s bits exactly from a copy taken at the merge (memory: one copy of the
merged weights while they are merged; under ZeRO-3 TRL has them gathered anyway). Only vanilla LoRA
on bf16 ``Linear`` layers is handled; DoRA and other variants, ``lora_bias`` and ``error_feedback``
(which needs a residual carried from merge to merge) raise UnsupportedSetupError instead of rounding
to nearest.
"""
from __future__ import annotations

import types
from typing import Any, Callable

import torch

from faircast_ds._util import dist
from faircast_ds.casting.modes import spec
from faircast_ds.casting.rules import cast
from faircast_ds.config.section import FairCastConfig
from faircast_ds.shard.adapter import UnsupportedSetupError
from faircast_ds.shard.handle import FairCast, get_fair_cast

NAME_SUFFIX = "@lora_merge"  # noise stream of a merged weight, apart from the served parameter's


def lora_layers(model: Any) -> list[tuple[str, Any]]:
    """(name, layer) of every PEFT ``lora.Linear`` in ``model``."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return []
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]


def _refuse(mode: str) -> None:
    if spec(mode).residual:
        raise UnsupportedSetupError(
            f"fair_cast LoRA merge: mode {mode} carries a residual per served shard, and a merged weight "
            "has none; pass mode='stochastic' (or 'dither', 'nearest') to install_lora_merge")


def install_lora_merge(model: Any, source: FairCast | FairCastConfig | dict | None = None, *,
                       mode: str | None = None, step: Callable[[], int] | None = None) -> int:
    """Make ``model``'s PEFT LoRA merges use the cast; returns how many layers were hooked.

    ``source``: the Fair Cast handle of the engine that trains ``model`` (mode, seed and the optimizer
    step for the noise), or a config (then each layer counts its own merges as the step); None: the
    handle of the DeepSpeed engine that wraps ``model``, looked up at each merge. ``mode`` overrides
    the config's mode for merges only; ``step`` (a callable) gives the noise step in place of the
    engine's or the merge count, e.g. a framework's own training step.
    """
    layers = lora_layers(model)
    if not layers:
        raise UnsupportedSetupError("fair_cast LoRA merge: the model has no PEFT lora.Linear layer")

    given = source if source is None or isinstance(source, (FairCast, FairCastConfig)) else \
        FairCastConfig.from_section(source)  # a dict is validated once, at install

    def settings() -> tuple[FairCastConfig, Callable[[], int] | None]:
        """(config, noise step) for one merge: the config's, or the handle's (looked up now when none was given)."""
        handle = given if given is not None else get_fair_cast(model) or get_fair_cast(getattr(model, "module", None))
        if handle is None:
            raise UnsupportedSetupError("fair_cast LoRA merge: no Fair Cast engine wraps this model yet; pass its "
                                        "handle or a config to install_lora_merge")
        if isinstance(handle, FairCastConfig):
            return handle, step
        return handle.config, step if step is not None else (lambda: handle.caster.step)

    cfg, _ = settings() if source is not None else (None, None)
    if cfg is not None:
        _refuse(mode or cfg.mode)
    for name, layer in layers:
        _hook(layer, f"{name}.base_layer.weight{NAME_SUFFIX}", settings, mode)
    summary = f"mode={mode or cfg.mode}" if cfg is not None else "the engine's mode"
    dist.log_rank0(f"[fair_cast] LoRA merges of {len(layers)} layers cast with {summary}, unmerges restore the "
                   "base weights bit for bit")
    return len(layers)


def _hook(layer: Any, noise_name: str, settings: Callable[[], tuple[FairCastConfig, Any]], mode: str | None) -> None:
    from peft.tuners.tuners_utils import check_adapters_to_merge
    from peft.utils.other import transpose

    state: dict[str, Any] = {"saved": None, "merges": 0}

    @torch.no_grad()
    def merge(self: Any, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        adapter_names = check_adapters_to_merge(self, adapter_names)
        if not adapter_names:
            return
        names = [a for a in adapter_names if a in self.lora_A.keys()]
        for a in names:
            if a in self.lora_variant:
                raise UnsupportedSetupError(f"fair_cast LoRA merge: adapter {a!r} is a "
                                            f"{type(self.lora_variant[a]).__name__} (DoRA or another variant); only "
                                            "vanilla LoRA merges are cast")
            if self.lora_bias[a]:
                raise UnsupportedSetupError(f"fair_cast LoRA merge: adapter {a!r} has lora_bias; not handled")
        weight = self.get_base_layer().weight
        if weight.dtype != torch.bfloat16:
            raise UnsupportedSetupError(f"fair_cast LoRA merge: the base weight is {weight.dtype}, not bf16")
        cfg, step_of = settings()
        use = mode or cfg.mode
        _refuse(use)
        if state["saved"] is None:
            state["saved"] = weight.data.clone()
        merged = weight.data.float()
        for a in names:
            delta = self.lora_B[a].weight.float() @ self.lora_A[a].weight.float()
            merged += transpose(delta, self.fan_in_fan_out) * self.scaling[a]
        state["merges"] += 1
        step = step_of() if step_of is not None else state["merges"]
        out = cast(merged.reshape(-1).contiguous(), use, seed=cfg.seed, step=step, name=noise_name)
        if safe_merge and not torch.isfinite(out).all():
            raise ValueError(f"NaNs detected in the merged weights of {noise_name}")
        weight.data.copy_(out.view_as(weight))
        self.merged_adapters.extend(names)

    @torch.no_grad()
    def unmerge(self: Any) -> None:
        if not self.merged:
            return
        if state["saved"] is not None:
            self.get_base_layer().weight.data.copy_(state["saved"])
            state["saved"] = None
        self.merged_adapters.clear()

    layer.merge = types.MethodType(merge, layer)
    layer.unmerge = types.MethodType(unmerge, layer)
