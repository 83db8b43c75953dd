"""The runtime route: Fair Cast on an unmodified DeepSpeed, config -> caster -> adapter -> shard.

``install()`` wraps ``DeepSpeedEngine.__init__`` so that every engine is handed to ``attach`` as it is
built (export gets each one's served-weight reader, ``faircast_ds.deepspeed.reader``); one whose config
has a ``fair_cast`` section is attached, on the runtime route (the interpreter-start hook
calls it for you). ``attach(engine, route="auto")`` attaches one engine explicitly, on either route
(the hook route's own half is ``faircast_ds.deepspeed.hook``). The adapter replaces the optimizer's
refresh sites; ``wire_engine`` registers periodic diagnostics, Fair Cast's checkpoint state
(``checkpointing``) and the guard into the engine's one ``hooks.EngineHooks`` (what runs around
``engine.step`` and the checkpoint methods is listed there).
"""
from __future__ import annotations

import functools
import json
from typing import Any, Callable, Mapping

from faircast_ds._util import dist
from faircast_ds.config import origin as config_origin
from faircast_ds.config.section import FairCastConfig
from faircast_ds.config.origin import Resolved
from faircast_ds.deepspeed.adapters import make_adapter
from faircast_ds.deepspeed.adapters.registry import stand_in, will_train
from faircast_ds.deepspeed import reader as served_reader
from faircast_ds.deepspeed.engine_hooks import EngineHooks
from faircast_ds.deepspeed.support import check_supported, engine_config, raw_config
from faircast_ds.shard import routes
from faircast_ds.shard.caster import ShardCaster
from faircast_ds.shard.handle import ATTR, FairCast, build, get_fair_cast, resolve

ROUTE = routes.DEEPSPEED_RUNTIME

__all__ = ["FairCast", "attach", "get_fair_cast", "install"]


def engine_section(engine: Any) -> Resolved | None:
    """The section the engine gets and where from: its own config's ``fair_cast`` section, else
    ``FAIRCAST_DS_CONFIG`` (see faircast_ds.config.origin); None when neither has one."""
    return config_origin.resolve(raw_config(engine_config(engine)))


def model_numel(engine: Any) -> int:
    """Elements of the model's trainable parameters, the ones the cast serves (ZeRO-3 parameters
    counted at full size; frozen ones, e.g. a LoRA base model, have no master and are left out, so the
    diagnostics' sample lands on cast elements)."""
    from faircast_ds.deepspeed.params import full_numel

    return sum(full_numel(p) for p in engine.module.parameters() if p.requires_grad)


def attach(engine: Any, config: FairCastConfig | Mapping[str, Any] | Resolved | None = None, *,
           route: routes.Choice = "auto") -> FairCast | None:
    """Attach Fair Cast to a built DeepSpeed engine.

    ``config`` defaults to the engine's own ``fair_cast`` section, else ``FAIRCAST_DS_CONFIG``.
    ``route`` (:data:`faircast_ds.shard.routes.Choice`): ``"runtime"`` wraps the optimizer's refresh sites;
    ``"hook"`` goes through a patched DeepSpeed's cast hook (``faircast_ds.deepspeed.hook``; nothing of
    the optimizer wrapped); ``"auto"`` takes the hook when the importable DeepSpeed carries it. An
    engine a route already serves (e.g. attached as it was built, by ``install()``) gets that route's
    handle back, whatever ``route`` says.
    Returns None when there is no section or it says ``enabled: false``, and for an engine without a
    training optimizer (a reference or evaluation copy: rank 0 says so in one line). Every engine, with
    Fair Cast or without, gets its served-weight reader handed to export first
    (:func:`faircast_ds.deepspeed.reader.provide`: export reads a ZeRO-3 engine through it). Raises
    FairCastConfigError for a malformed section and UnsupportedSetupError for a setup we cannot route
    through the cast.
    """
    from faircast_ds.deepspeed import hook

    served_reader.provide(engine)  # export reads this engine's served weights through DeepSpeed's reader
    existing = get_fair_cast(engine)
    if existing is not None:
        return existing
    resolved = to_resolved(engine, config)
    if routes.resolve_choice(route, has_hook=hook.deepspeed_has_cast_hook) == "hook":
        return attach_route(engine, resolved, route=hook.ROUTE, connect=hook.connect, before_build=hook.require_hook)
    return attach_route(engine, resolved, route=ROUTE, connect=lambda a: a.install())


def to_resolved(engine: Any, config: FairCastConfig | Mapping[str, Any] | Resolved | None) -> Resolved | None:
    """The section ``attach`` was given, or the engine's own (its config, else ``FAIRCAST_DS_CONFIG``)."""
    if isinstance(config, Resolved):
        return config
    if config is None:
        return engine_section(engine)
    return Resolved(config if isinstance(config, FairCastConfig) else FairCastConfig.from_section(config),
                  config_origin.FROM_ARGUMENT)


def attach_route(engine: Any, resolved: Resolved | None, *, route: routes.RouteKind, connect: Callable[[Any], None],
                 before_build: Callable[[], None] | None = None) -> FairCast | None:
    """The DeepSpeed half of the attach pipeline, shared by the runtime and the cast-hook route: skip
    engines without a training optimizer, agree on the section across ranks, check the setup, make the
    adapter, build the handle (faircast_ds.shard.handle.build), and wire diagnostics, checkpoints and the guard."""
    why = stand_in(engine)
    if why is not None:  # never steps: no cast to replace, never an error
        if resolved is not None and resolved.config.enabled:
            dist.log_rank0(f"[fair_cast] not attached to this engine: it has no training optimizer ({why}), as a "
                           f"reference, evaluation or inference engine; its bf16 weights are left as DeepSpeed "
                           f"builds them (section from {config_origin.describe(resolved)})")
        return None
    _agree_across_ranks(resolved, _shard_group(engine))
    config = resolve(resolved.config if resolved is not None else None)
    if config is None:
        return None
    if before_build is not None:
        before_build()
    check_supported(engine_config(engine))
    adapter = make_adapter(engine, ShardCaster(config))
    fair_cast = build(config, [adapter], route=route, owner=engine, connect=connect,
                      module=engine.module, model_numel=model_numel(engine), origin=resolved.origin)
    setattr(engine.module, ATTR, fair_cast)  # for callers that hold the model, not the engine
    _report_frozen(engine, fair_cast)
    wire_engine(engine, fair_cast)
    return fair_cast


def _shard_group(engine: Any) -> Any:
    """The process group the engine's optimizer shards over (every rank that builds this engine):
    the sequence-data-parallel group where there is one, else the data-parallel group."""
    return getattr(engine, "seq_data_parallel_group", None) or getattr(engine, "data_parallel_group", None)


UNSECTIONED_WAIT_S = 30.0  # how long a rank that does not cast waits for the others' (it never fails on a missing one)


def _agree_across_ranks(resolved: Resolved | None, group: Any) -> None:
    """Every rank of a training engine must have the same section (or none): an environment variable
    set on one node only would otherwise cast some shards and not others. Exchanged through the
    process group's store, not a collective, so that ranks without Fair Cast at all (a node missing the
    package, or with ``FAIRCAST_DS_AUTOLOAD=0``) are named after a bounded wait instead of leaving the
    others matched against DeepSpeed's next collective until the job's timeout (dist.post_and_gather).
    A rank without a section, or with ``enabled: false``, never fails for a rank that did not post (a
    job that does not use Fair Cast is not ours to stop): it waits at most UNSECTIONED_WAIT_S, to report
    a disagreement too. Without a store (the MPI backend) ranks that cast fall back to a collective."""
    from faircast_ds.config.section import FairCastConfigError

    mine = json.dumps(resolved.config.model_dump(mode="json"), sort_keys=True) if resolved is not None else None
    post = [mine, resolved.origin if resolved is not None else None]
    casting = resolved is not None and resolved.config.enabled  # absent or `enabled: false`: not ours to stop
    try:
        if not casting:
            everyone = dist.post_and_gather("section", post, group, wait_s=UNSECTIONED_WAIT_S, allow_missing=True)
        else:
            everyone = dist.post_and_gather("section", post, group)
    except dist.RanksMissingError as exc:
        raise FairCastConfigError(
            f"ranks {exc.missing} of this engine never reached Fair Cast's attach ({exc.waited_s:.0f}s waited after "
            f"this rank's): Fair Cast is not loaded there (faircast-ds not installed on that node, or "
            f"FAIRCAST_DS_AUTOLOAD=0). Install it on every node; launch/preflight.py names the nodes") from None
    except dist.NoStoreError:
        if not casting:
            return  # nothing of ours to protect
        everyone = dict(enumerate(_all_gather(post, group)))  # every rank has Fair Cast, or this hangs until the timeout
    if len({s for s, _ in everyone.values()}) > 1:
        lines = [f"rank {r}: {s} (origin={o})" if s else f"rank {r}: no fair_cast section"
                 for r, (s, o) in sorted(everyone.items())]
        raise FairCastConfigError("the ranks of this engine disagree on the fair_cast section (is "
                                  f"{config_origin.ENV} set on every node? see docs/integrations.md):\n  "
                                  + "\n  ".join(lines))


def _all_gather(obj: Any, group: Any) -> list[Any]:
    import torch.distributed as tdist

    everyone: list[Any] = [None] * tdist.get_world_size(group=group)
    tdist.all_gather_object(everyone, obj, group=group)
    return everyone


def _report_frozen(engine: Any, fair_cast: FairCast) -> None:
    """With frozen parameters (LoRA, a frozen tower) only the trainable ones have fp32 masters and are
    cast; say how many elements are under Fair Cast (a collective)."""
    from faircast_ds.deepspeed.params import full_numel

    params = list(engine.module.parameters())
    frozen = [p for p in params if not p.requires_grad]
    if not frozen:
        return
    under, = dist.all_reduce_sum([float(fair_cast.local_numel())])
    total = sum(full_numel(p) for p in params)
    dist.log_rank0(f"[fair_cast] frozen parameters: {int(under):,} of {total:,} elements ({100 * under / total:.2f}%) "
                   f"are trainable and under Fair Cast; {sum(full_numel(p) for p in frozen):,} elements in "
                   f"{len(frozen)} frozen tensors are served as loaded")


def wire_engine(engine: Any, fair_cast: FairCast) -> EngineHooks:
    """What every DeepSpeed route adds to the engine, registered into its one
    :class:`faircast_ds.deepspeed.engine_hooks.EngineHooks` in the order they run (that module's docstring
    lists them): periodic diagnostics after ``engine.step``, Fair Cast's state in its checkpoints, and
    the guard (after the first step and every load: served bits == what we cast)."""
    from faircast_ds.deepspeed import checkpoint as checkpointing
    from faircast_ds.deepspeed import guard

    hooks = EngineHooks.of(engine)
    if fair_cast.diagnostics is not None:
        hooks.after("step", "diagnostics", "every `every`-th step: reduce, log one line, feed the monitor",
                    _diagnostics_after_step(engine, fair_cast))
    checkpointing.register(engine, fair_cast, hooks)
    guard.install(engine, fair_cast, hooks)
    fair_cast.extras["hooks"] = hooks
    return hooks


def _diagnostics_after_step(engine: Any, fair_cast: FairCast) -> Callable[..., None]:
    """After every ``every``-th optimizer step: reduce the figures, log one line, feed DeepSpeed's monitor."""
    every = fair_cast.config.diagnostics.every
    reported = {"step": -1}

    def report(result: Any, *args: Any, **kwargs: Any) -> None:
        now = fair_cast.caster.step
        if now != reported["step"] and now % every == 0:
            reported["step"] = now
            figures = fair_cast.report()
            if fair_cast.config.diagnostics.log:
                dist.log_rank0(f"[fair_cast] step {now}: served changed {100 * figures['changed_fraction']:.3f}% | "
                               f"gap {figures['gap_spacings']:.3f} spacings | lag {figures['lag_steps']:.0f} steps | "
                               f"lag along drift {figures['lag_drift_steps']:.1f} steps | "
                               f"bias {figures['bias_spacings']:+.3f} spacings")
            monitor = getattr(engine, "monitor", None)
            if monitor is not None and getattr(monitor, "enabled", False):
                monitor.write_events([(f"fair_cast/{k}", v, now) for k, v in figures.items() if k != "step"])

    return report


def installed() -> bool:
    """Whether engines built from now on attach themselves (``install()`` has run: by the
    interpreter-start hook once DeepSpeed's engine module was imported, or by hand). Imports DeepSpeed."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    return bool(getattr(DeepSpeedEngine.__init__, "_faircast_wrapped", False))


def install() -> None:
    """Wrap ``DeepSpeedEngine.__init__`` so engines with a ``fair_cast`` section attach themselves.
    Idempotent."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    if installed():
        return
    original = DeepSpeedEngine.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        resolved = None
        parsed = kwargs.get("config_class")  # deepspeed.initialize parses the config before the engine
        if parsed is not None:
            # the config's section or FAIRCAST_DS_CONFIG: a malformed section or two that differ fail here, in seconds
            resolved = config_origin.resolve(raw_config(parsed))
            optimizer = kwargs.get("optimizer", args[2] if len(args) > 2 else None)
            if resolved is not None and resolved.config.enabled and will_train(optimizer, parsed):
                check_supported(parsed)  # an engine without an optimizer is left alone: never refused
        original(self, *args, **kwargs)
        attach(self, resolved, route="runtime")  # None: resolved from the built engine's config

    __init__._faircast_wrapped = True  # type: ignore[attr-defined]
    DeepSpeedEngine.__init__ = __init__  # type: ignore[method-assign]
