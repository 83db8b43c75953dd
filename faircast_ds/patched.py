"""Fair Cast through DeepSpeed's own cast hook (``patches/deepspeed-0.19.8-fair-cast.patch``).

A DeepSpeed with that patch refreshes every bf16 shard from its fp32 master through
``deepspeed.runtime.lp_cast.cast_hp_to_lp``: the ZeRO-3 step and load sites, the ZeRO-1/2 step (CPU
offload included) and ``update_lp_params``, BF16_Optimizer's ``update_lp_params``. Here nothing of
DeepSpeed is wrapped. The adapters only describe the shards (their slices, built exactly as on the
runtime route); the hook hands each refresh to the ShardCaster.

One route per optimizer, never both: ``attach`` leaves an engine that the runtime route already
serves alone (DeepSpeed's hook then falls back to its own copy, which the runtime route overwrites,
as on an unpatched DeepSpeed), and the hook refuses to cast for an engine that gained the runtime
route after it was routed here.
"""
from __future__ import annotations

import importlib.util
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from faircast_ds.activation import FairCast, get_fair_cast
from faircast_ds.adapters import Adapter, UnsupportedSetupError
from faircast_ds.adapters.registry import adapter_class
from faircast_ds.adapters.support import check_supported, engine_config, raw_config
from faircast_ds.config import FairCastConfig, find_section
from faircast_ds.shard_caster import ShardCaster, ShardSlice

HOOK_MODULE = "deepspeed.runtime.lp_cast"


def deepspeed_has_cast_hook() -> bool:
    """Whether the importable DeepSpeed carries the cast hook (has the patch applied)."""
    try:
        return importlib.util.find_spec(HOOK_MODULE) is not None
    except ModuleNotFoundError:  # no deepspeed at all
        return False


@dataclass
class _Route:
    adapter: Adapter
    slices: dict[int, list[ShardSlice]]
    engine: Callable[[], Any] | None  # weak reference to the engine, to notice a second route

    @torch.no_grad()
    def cast(self, lp: torch.Tensor, hp: torch.Tensor, context: Any) -> None:
        engine = self.engine() if self.engine is not None else None
        if engine is not None and get_fair_cast(engine) is not None:
            raise RuntimeError("fair_cast: this engine is routed through DeepSpeed's cast hook and also got the "
                               "runtime route (faircast_ds.attach / the interpreter-start hook); a refresh would be "
                               "cast twice. Use one: FAIRCAST_DS_AUTOLOAD=0 with faircast_ds.patched.attach, or the "
                               "runtime route alone.")
        caster = self.adapter.caster
        if context.after_step and context.group_index == 0:  # DeepSpeed refreshes groups in order after a step
            caster.begin_step()
        key = context.group_index
        # ZeRO-1/2 and BF16_Optimizer keep the last served bits aside (lp may be the offload staging buffer)
        caster.cast_flat(key, hp, lp, self.slices[key], previous=self.adapter.previous(key))


_ROUTES: "weakref.WeakKeyDictionary[Any, _Route]" = weakref.WeakKeyDictionary()  # optimizer -> route
_installed: dict[str, Any] = {}  # "previous": the hook that was installed before ours, if any


def _hook(lp: torch.Tensor, hp: torch.Tensor, context: Any) -> bool:
    route = _ROUTES.get(context.optimizer)
    if route is None:  # not ours: whoever hooked before us, else DeepSpeed's copy
        previous = _installed.get("previous")
        return bool(previous(lp, hp, context)) if previous is not None else False
    route.cast(lp, hp, context)
    return True


def _install_hook() -> None:
    from deepspeed.runtime import lp_cast

    # once per process: a hook installed after ours is expected to hand other optimizers on to ours
    if "previous" not in _installed:
        _installed["previous"] = lp_cast.set_lp_cast_hook(_hook)


def route(adapter: Adapter, engine: Any = None) -> None:
    """Send every refresh of ``adapter.optimizer``'s bf16 shards to ``adapter.caster`` through
    DeepSpeed's cast hook. The adapter must not be installed (its runtime wrapping would cast too)."""
    if not deepspeed_has_cast_hook():
        raise UnsupportedSetupError("fair_cast: this DeepSpeed has no cast hook (deepspeed.runtime.lp_cast); apply "
                                    "patches/deepspeed-0.19.8-fair-cast.patch or use the runtime route")
    _install_hook()
    slices = {key: list(group_slices) for key, _, _, group_slices in adapter.flat_groups()}
    _ROUTES[adapter.optimizer] = _Route(adapter, slices, weakref.ref(engine) if engine is not None else None)


def unroute(optimizer: Any) -> None:
    """Give ``optimizer``'s refreshes back to DeepSpeed's round-to-nearest copy."""
    _ROUTES.pop(optimizer, None)


def is_routed(optimizer: Any) -> bool:
    return optimizer in _ROUTES


def attach(engine: Any, config: FairCastConfig | Mapping[str, Any] | None = None) -> FairCast | None:
    """Serve ``engine``'s bf16 weights by Fair Cast through a patched DeepSpeed's cast hook.

    ``config`` defaults to the engine's ``fair_cast`` section (validated strictly, as on the runtime
    route). Returns None when the section is absent or disabled, and the runtime route's handle
    when that route already serves the engine. The returned handle's ``stats()`` works; Fair Cast's
    checkpoint state and periodic diagnostics come with the runtime route's ``faircast_ds.attach``.
    """
    existing = get_fair_cast(engine)
    if existing is not None:
        return existing
    if engine.optimizer in _ROUTES:
        route_ = _ROUTES[engine.optimizer]
        return FairCast(route_.adapter.caster.config, route_.adapter.caster, route_.adapter)
    if config is None:
        config = find_section(raw_config(engine_config(engine)))
    elif not isinstance(config, FairCastConfig):
        config = FairCastConfig.from_section(config)
    if config is None or not config.enabled:
        return None
    check_supported(engine_config(engine))
    if engine.optimizer is None:
        raise UnsupportedSetupError("fair_cast: the engine has no optimizer; there is no fp32 master to cast from")
    caster = ShardCaster(config)
    adapter = adapter_class(engine.optimizer)(engine.optimizer, caster, engine.param_names)
    route(adapter, engine)
    fair_cast = FairCast(config, caster, adapter)
    if config.align_rounding is not None:
        from faircast_ds.align import apply_from_config

        fair_cast.alignment = apply_from_config(engine.module, config.align_rounding)
    _log_rank0(f"[fair_cast] active (DeepSpeed cast hook): mode={config.mode} zero_stage={adapter.zero_stage} "
               f"seed={config.seed} local_shard_elements={adapter.local_numel()} on_nonfinite={config.on_nonfinite}")
    return fair_cast


def _log_rank0(message: str) -> None:
    import deepspeed.comm as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)
