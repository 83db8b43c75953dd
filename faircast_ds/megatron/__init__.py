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
the hook when the patch is there. The handle is the same :class:`faircast_ds.shard.handle.FairCast` every route returns,
kept on the optimizer (``faircast_ds.get_fair_cast(optimizer)``). Fair Cast's state goes into Megatron's
distributed checkpoints as one more entry of the state dict (``faircast_ds.megatron.checkpoint``:
``sharded_state_dict(fc, model_sd)`` beside the model's and the optimizer's, ``load_state_dict(fc, loaded["fair_cast"])``
after the load), so a resume is bit for bit, ``error_feedback``'s residual included. The run-time guard
(``faircast_ds.megatron.guard``) checks the served copy against what Fair Cast wrote after the first step,
a sample after every later one, and every bit after that load.
"""
from __future__ import annotations

from faircast_ds._util import lazy

_LAZY = {
    "attach": "faircast_ds.megatron.attachment",
    "FairCast": "faircast_ds.shard.handle",
    "MegatronAdapter": "faircast_ds.megatron.adapters",
    "ParamShard": "faircast_ds.megatron.shards",
    "param_shard": "faircast_ds.megatron.shards",
    "megatron_has_cast_hook": "faircast_ds.megatron.hook",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy.exports(__name__, _LAZY, globals())
