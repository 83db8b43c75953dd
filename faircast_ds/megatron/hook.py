"""Fair Cast through a patched Megatron-Core's cast hook (``patches/megatron-core-<release>-fair-cast.patch``:
the 0.12.0 variant for 0.12.x, the 0.16.1 one for 0.14 - 0.16; ``patches/README.md``).

The patched ``_copy_main_params_to_model_params`` hands every shard of one refresh to
``megatron.core.optimizer.param_cast.copy_main_params_to_model_params``: one call per optimizer step,
each shard with its model parameter, its range in that parameter, its fp32 main values and its
destination in the param buffer. Nothing of Megatron is replaced; the noise ids are the runtime route's
(the full parameter's name and indices: ``MegatronAdapter.slices_of``).
"""
from __future__ import annotations

import importlib.util
from typing import Any

import torch

from faircast_ds.megatron.adapters import MegatronAdapter
from faircast_ds.shard.adapter import UnsupportedSetupError
from faircast_ds.shard.routes import MEGATRON_HOOK, ROUTES

HOOK_MODULE = "megatron.core.optimizer.param_cast"
ROUTE = MEGATRON_HOOK

_installed: dict[str, Any] = {}  # "previous": the hook installed before ours, if any


def megatron_has_cast_hook() -> bool:
    """Whether the importable Megatron-Core carries the cast hook (has the patch applied)."""
    try:
        return importlib.util.find_spec(HOOK_MODULE) is not None
    except ModuleNotFoundError:
        return False


@torch.no_grad()
def _cast(adapter: MegatronAdapter, shards: list) -> None:
    caster = adapter.caster
    caster.begin_step()  # the hook runs once per refresh, and a refresh follows every successful step
    for shard in shards:
        if shard.model_shard.dtype == torch.float32:  # a parameter kept in fp32: nothing to round
            shard.model_shard.copy_(shard.main_shard)
            continue
        name, start = adapter.name_of(shard.model_param), int(shard.param_range.start)
        caster.cast_flat((name, start), shard.main_shard, shard.model_shard,
                         adapter.slices_of(shard.model_param, start, shard.main_shard.numel()))


def _hook(optimizer: Any, shards: list) -> bool:
    route = ROUTES.get(optimizer)
    if route is None or route.kind != ROUTE:
        previous = _installed.get("previous")
        return bool(previous(optimizer, shards)) if previous is not None else False
    if "_copy_main_params_to_model_params" in vars(optimizer):
        raise RuntimeError("fair_cast: this optimizer is routed through Megatron's cast hook and its copy was also "
                           "replaced at runtime; a refresh would be cast twice")
    _cast(route.adapter, shards)
    return True


def connect(adapter: MegatronAdapter) -> None:
    """Send every main->model refresh of ``adapter.optimizer`` (registered under this route) to its
    caster through the hook."""
    if not megatron_has_cast_hook():
        raise UnsupportedSetupError("fair_cast: this Megatron-Core has no cast hook (megatron.core.optimizer."
                                    "param_cast); apply its release's patch (patches/README.md: the 0.12.0 or "
                                    "0.16.1 variant of megatron-core-<release>-fair-cast.patch) or use route='runtime'")
    from megatron.core.optimizer import param_cast

    if "previous" not in _installed:  # once per process; a later hook is expected to hand ours the rest
        _installed["previous"] = param_cast.set_main_param_cast_hook(_hook)
