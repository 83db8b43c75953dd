"""Fair Cast for Megatron-Core's distributed optimizer (bf16 params, fp32 main params, data parallel).

::

    from faircast_ds.megatron import attach
    optimizer = get_megatron_optimizer(OptimizerConfig(bf16=True, use_distributed_optimizer=True, ...), model)
    fc = attach(optimizer, {"mode": "stochastic", "seed": 1234})   # the same keys as the fair_cast section

Each rank casts its own fp32 main shards into its range of the param buffer, before the param
all-gather; the noise of an element is keyed by (parameter name, index in the flattened parameter),
as for DeepSpeed, so a parameter with the same name and fp32 values is served the same bits by
either framework at any data-parallel size. ``route`` picks how: ``"runtime"`` replaces the
optimizer's ``_copy_main_params_to_model_params``; ``"hook"`` registers with a Megatron-Core that
carries ``patches/megatron-core-0.16.1-fair-cast.patch``; ``"auto"`` (default) takes the hook when
the patch is there. Fair Cast state is not part of Megatron checkpoints: ``error_feedback``'s
residual restarts at zero after a resume.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import torch

from faircast_ds.adapters.base import UnsupportedSetupError
from faircast_ds.config import FairCastConfig
from faircast_ds.megatron.adapter import MegatronAdapter, check_supported, distributed_optimizers, parameter_names
from faircast_ds.megatron.hook import megatron_has_cast_hook
from faircast_ds.megatron.shards import ParamShard, param_shard
from faircast_ds.shard_caster import ShardCaster

__all__ = ["MegatronFairCast", "MegatronAdapter", "ParamShard", "attach", "megatron_has_cast_hook", "param_shard"]

Route = Literal["auto", "runtime", "hook"]


@dataclass
class MegatronFairCast:
    """Fair Cast attached to one Megatron optimizer: one adapter (and caster) per DistributedOptimizer."""

    config: FairCastConfig
    adapters: list[MegatronAdapter] = field(default_factory=list)
    route: str = "runtime"

    def stats(self) -> dict[str, float]:
        """The last cast's counts, summed over all ranks (a collective: call it on every rank)."""
        changed = sum(a.caster.last.changed for a in self.adapters)
        numel = sum(a.caster.last.numel for a in self.adapters)
        t = torch.tensor([changed, numel], dtype=torch.float64)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(t)
        changed, numel = t.tolist()
        step = max((a.caster.step for a in self.adapters), default=0)
        return {"step": step, "changed": changed, "numel": numel,
                "changed_fraction": changed / numel if numel else 0.0}


def attach(optimizer: Any, config: FairCastConfig | Mapping[str, Any], *,
           route: Route = "auto") -> MegatronFairCast | None:
    """Serve ``optimizer``'s bf16 parameters by Fair Cast (a DistributedOptimizer or a ChainedOptimizer of them).

    Returns None when the config says ``enabled: false``. Raises FairCastConfigError for a malformed
    config and UnsupportedSetupError for a setup whose served copy we do not route.
    """
    if not isinstance(config, FairCastConfig):
        config = FairCastConfig.from_section(config)
    if not config.enabled:
        return None
    if config.align_rounding is not None:
        raise UnsupportedSetupError("fair_cast.align_rounding: rounding alignment patches HF modules, not Megatron's")
    if route == "auto":
        route = "hook" if megatron_has_cast_hook() else "runtime"
    if route not in ("runtime", "hook"):
        raise ValueError(f"route must be 'auto', 'runtime' or 'hook', got {route!r}")
    inner = distributed_optimizers(optimizer)
    for opt in inner:
        check_supported(opt)
        if "_copy_main_params_to_model_params" in vars(opt) or _hook_routes(opt):
            raise RuntimeError("fair_cast: this optimizer already has Fair Cast attached")
    handle = MegatronFairCast(config, route=route)
    for opt in inner:
        adapter = MegatronAdapter(opt, ShardCaster(config), parameter_names(opt))
        if route == "hook":
            from faircast_ds.megatron import hook

            hook.route(adapter)
        else:
            adapter.install()
        handle.adapters.append(adapter)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        local = sum(a.local_numel() for a in handle.adapters)
        print(f"[fair_cast] active (megatron-core, {route} route): mode={config.mode} seed={config.seed} "
              f"local_shard_elements={local} on_nonfinite={config.on_nonfinite}", flush=True)
    return handle


def _hook_routes(optimizer: Any) -> bool:
    from faircast_ds.megatron import hook

    return hook.is_routed(optimizer)
