"""The Megatron-Core attach pipeline: ``attach(optimizer, config)`` checks the setup, builds one adapter per
DistributedOptimizer and hands them to the one attach pipeline (``faircast_ds.shard.handle.build``)."""

from __future__ import annotations

from typing import Any, Mapping

from faircast_ds.config.section import FairCastConfig
from faircast_ds.megatron import guard
from faircast_ds.megatron import reader as served_reader
from faircast_ds.megatron.adapters import (
    MegatronAdapter,
    distributed_optimizers,
    parameter_names,
)
from faircast_ds.megatron.hook import megatron_has_cast_hook
from faircast_ds.megatron.support import check_supported
from faircast_ds.shard import routes
from faircast_ds.shard.adapter import UnsupportedSetupError
from faircast_ds.shard.caster import ShardCaster
from faircast_ds.shard.handle import FairCast, build, get_fair_cast, resolve


def attach(optimizer: Any, config: FairCastConfig | Mapping[str, Any], *,
           route: routes.Choice = "auto", family: str | None = None) -> FairCast | None:
    """Serve ``optimizer``'s bf16 parameters by Fair Cast (a DistributedOptimizer or a ChainedOptimizer of them).

    First, enabled or not, export is handed the served weights' HF-named reader under the optimizer and
    each of its model chunks (:func:`faircast_ds.megatron.reader.provide`; ``family``: ``llama`` or
    ``qwen3``, by default Qwen3 where the config has query/key norms), so ``save_hf(chunk, ...)`` and the
    vLLM push read them without naming the reader.

    Returns None when the config says ``enabled: false``. Raises FairCastConfigError for a malformed
    config and UnsupportedSetupError for a setup whose served copy we do not route.
    """
    chunks = list({id(c): c for opt in distributed_optimizers(optimizer) for c in getattr(opt, "model_chunks", ())}.values())
    served_reader.provide(optimizer, chunks, family=family)  # export reads the served weights through it
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
