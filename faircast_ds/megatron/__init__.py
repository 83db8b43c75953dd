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
carries its release's ``patches/megatron-core-<release>-fair-cast.patch``; ``"auto"`` (default) takes
the hook when the patch is there. The handle is the same :class:`faircast_ds.handle.FairCast` every route returns,
kept on the optimizer (``faircast_ds.get_fair_cast(optimizer)``). Fair Cast's state goes into Megatron's
distributed checkpoints as one more entry of the state dict (``faircast_ds.megatron.checkpoint``:
``sharded_state_dict(fc, model_sd)`` beside the model's and the optimizer's, ``load_state_dict(fc, loaded["fair_cast"])``
after the load), so a resume is bit for bit, ``error_feedback``'s residual included. The run-time guard
(``faircast_ds.megatron.guard``) checks the served copy against what Fair Cast wrote after the first step,
a sample after every later one, and every bit after that load.
"""
from __future__ import annotations

from typing import Any, Mapping

from faircast_ds import routes
from faircast_ds.adapter import UnsupportedSetupError
from faircast_ds.config import FairCastConfig
from faircast_ds.handle import FairCast, build, get_fair_cast, resolve
from faircast_ds.megatron import guard
from faircast_ds.megatron.adapter import MegatronAdapter, check_supported, distributed_optimizers, parameter_names
from faircast_ds.megatron.hook import megatron_has_cast_hook
from faircast_ds.megatron.shards import ParamShard, param_shard
from faircast_ds.shard_caster import ShardCaster

__all__ = ["FairCast", "MegatronAdapter", "ParamShard", "attach", "megatron_has_cast_hook", "param_shard"]

def attach(optimizer: Any, config: FairCastConfig | Mapping[str, Any], *,
           route: routes.Choice = "auto") -> FairCast | None:
    """Serve ``optimizer``'s bf16 parameters by Fair Cast (a DistributedOptimizer or a ChainedOptimizer of them).

    Returns None when the config says ``enabled: false``. Raises FairCastConfigError for a malformed
    config and UnsupportedSetupError for a setup whose served copy we do not route.
    """
    config = resolve(config)
    if config is None:
        return None
    if config.align_rounding is not None:
        raise UnsupportedSetupError("fair_cast.align_rounding: rounding alignment patches HF modules, not Megatron's")
    choice = routes.resolve_choice(route, has_hook=megatron_has_cast_hook)
    if get_fair_cast(optimizer) is not None:
        raise RuntimeError("fair_cast: this optimizer already has Fair Cast attached")
    inner = distributed_optimizers(optimizer)
    for opt in inner:
        check_supported(opt)
    adapters = [MegatronAdapter(opt, ShardCaster(config), parameter_names(opt)) for opt in inner]
    if choice == "hook":
        from faircast_ds.megatron import hook

        connect = hook.connect
    else:
        connect = MegatronAdapter.install
    fair_cast = build(config, adapters, route=routes.kind("megatron", choice), owner=optimizer, connect=connect)
    guard.install(fair_cast, optimizer)  # served bits == what Fair Cast wrote, after steps and loads
    return fair_cast
