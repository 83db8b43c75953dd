"""Fair Cast through DeepSpeed's own cast hook (the patches in ``patches/``: ``deepspeed-0.16.9``,
``0.18.9``, ``0.19.5`` and ``0.19.8-fair-cast.patch``, one per release family; ``patches/README.md``).

A DeepSpeed with one of those patches refreshes every bf16 shard from its fp32 master through
``deepspeed.runtime.lp_cast.cast_hp_to_lp``: the ZeRO-3 step and load sites, the ZeRO-1/2 step (CPU
offload included) and ``update_lp_params``, BF16_Optimizer's ``update_lp_params``. Here nothing of
DeepSpeed's optimizers is wrapped: the adapters only describe the shards (their slices, built exactly
as on the runtime route) and the hook hands each refresh to the ShardCaster. The engine gets the same
handle, diagnostics and checkpoint state as on the runtime route: ``faircast_ds.deepspeed.attach(engine,
route="hook")`` (or ``"auto"`` on a patched DeepSpeed) takes this route, through :func:`connect`.

One route per optimizer, never both (the route registry refuses a second): ``attach`` hands back the
runtime route's handle for an engine that route already serves.
"""
from __future__ import annotations

import importlib.util
from typing import Any

import torch

from faircast_ds.shard.adapter import Adapter, UnsupportedSetupError
from faircast_ds.shard.routes import DEEPSPEED_HOOK, ROUTES

HOOK_MODULE = "deepspeed.runtime.lp_cast"
ROUTE = DEEPSPEED_HOOK

_installed: dict[str, Any] = {}  # "previous": the hook that was installed before ours, if any


def deepspeed_has_cast_hook() -> bool:
    """Whether the importable DeepSpeed carries the cast hook (has the patch applied)."""
    try:
        return importlib.util.find_spec(HOOK_MODULE) is not None
    except ModuleNotFoundError:  # no deepspeed at all
        return False


@torch.no_grad()
def _cast(adapter: Adapter, lp: torch.Tensor, hp: torch.Tensor, context: Any) -> None:
    caster = adapter.caster
    if context.after_step and context.group_index == 0:  # DeepSpeed refreshes groups in order after a step
        caster.begin_step()
    key = context.group_index
    into_copy_target = getattr(adapter, "cast_into_copy_target", None)
    if into_copy_target is not None:  # ZeRO-1/2, BF16_Optimizer: lp may be the offload staging buffer
        into_copy_target(key, hp, lp)
        return
    caster.cast_flat(key, hp, lp, adapter.group_slices(key))


def _hook(lp: torch.Tensor, hp: torch.Tensor, context: Any) -> bool:
    route = ROUTES.get(context.optimizer)
    if route is None or route.kind != ROUTE:  # not ours: whoever hooked before us, else DeepSpeed's copy
        previous = _installed.get("previous")
        return bool(previous(lp, hp, context)) if previous is not None else False
    _cast(route.adapter, lp, hp, context)
    return True


def _install_hook() -> None:
    from deepspeed.runtime import lp_cast

    # once per process: a hook installed after ours is expected to hand other optimizers on to ours
    if "previous" not in _installed:
        _installed["previous"] = lp_cast.set_lp_cast_hook(_hook)


def require_hook() -> None:
    if not deepspeed_has_cast_hook():
        from faircast_ds.deepspeed.compat import release

        raise UnsupportedSetupError(f"fair_cast: this DeepSpeed ({release()}) has no cast hook "
                                    "(deepspeed.runtime.lp_cast); apply the patch for its release from patches/ "
                                    "(deepspeed-0.16.9, 0.18.9, 0.19.5 and 0.19.8-fair-cast.patch; patches/README.md) "
                                    "or use the runtime route")


def connect(adapter: Adapter) -> None:
    """Send every refresh of ``adapter.optimizer``'s bf16 shards to ``adapter``'s caster through
    DeepSpeed's cast hook: the optimizer must be registered under this route with this adapter (as
    ``faircast_ds.shard.handle.build`` does before connecting). The adapter is not installed: its runtime
    wrapping would cast too."""
    require_hook()
    route = ROUTES.get(adapter.optimizer)
    if route is None or route.kind != ROUTE or route.adapter is not adapter:
        raise RuntimeError(f"fair_cast: connect() needs the optimizer registered under the {ROUTE} route with this "
                           f"adapter (registered: {route.kind if route is not None else 'nothing'}); the hook would "
                           "hand its refreshes to another caster or none")
    _install_hook()
