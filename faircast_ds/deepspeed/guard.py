"""The run-time guard: what DeepSpeed serves is what Fair Cast wrote, or the run stops.

Fair Cast replaces DeepSpeed's fp32 -> bf16 refresh at the sites it knows. A release that moved one
(a second copy after ours, a renamed method that is no longer called, another buffer gathered in its
place) would serve round-to-nearest without a word. The guard turns that into an error, on any
release in the supported range, tested or not:

- every cast the caster makes is recorded where it wrote it: every bit when a full check will read the
  record (the first optimizer step, every checkpoint load), a small sample of elements otherwise;
- after the first optimizer step and after every checkpoint load each rank compares, element for
  element, what DeepSpeed will gather and serve (ZeRO-1/2 and BF16_Optimizer: this rank's flat bf16
  partition; ZeRO-3: every parameter's ``ds_tensor``) with that record; after every later step, the
  sample (a rotating choice of up to 32 parameters of each flat group, 64 elements of each);
- an optimizer step that DeepSpeed applied without any cast by Fair Cast fails too.

A mismatch on any rank raises ``UnsupportedSetupError`` on every rank, naming the DeepSpeed release,
where it was found (which step or load, which parameter and element, the two bit patterns) and what
to do. Nothing here changes a served bit.
"""
from __future__ import annotations

from typing import Any

from faircast_ds.deepspeed import compat
from faircast_ds.shard import guard as _core
from faircast_ds.shard.adapter import UnsupportedSetupError
from faircast_ds.shard.guard import (  # noqa: F401 (re-exported)
    SAMPLE_ELEMENTS,
    SAMPLE_SLICES,
    _any_rank,
    _bits,
    _raise,
)


class Guard(_core.Guard):
    """The route-neutral guard (:class:`faircast_ds.shard.guard.Guard`) in DeepSpeed's words: a mismatch names
    the DeepSpeed release and the supported range."""

    def _moved(self) -> str:
        return (f"DeepSpeed {compat.release()} ({compat.release_location()}) refreshed the served bf16 copy "
                f"outside the cast sites Fair Cast routes ({self.sites}), so this run would serve "
                f"round-to-nearest without saying so. Fair Cast supports deepspeed{compat.SUPPORTED_RANGE} "
                f"(tested: {', '.join(compat.TESTED)}); a cast site has moved in this release: use a tested "
                "release, and report this one")


def _applied(engine: Any) -> int:
    return engine.global_steps - getattr(engine, "skipped_steps", 0)


def install(engine: Any, fair_cast: Any, hooks: Any) -> Guard:
    """Guard ``engine``: check after its first optimizer step (fully), after every later one (sampled)
    and after every ``load_checkpoint`` (fully). ``hooks``: the engine's
    :class:`faircast_ds.deepspeed.engine_hooks.EngineHooks`, which the checks register into."""
    adapter = fair_cast.adapter
    guard = Guard(adapter, describe_sites=getattr(adapter, "cast_sites", type(adapter.optimizer).__name__))
    fair_cast.extras["guard"] = guard

    def before_step(*args: Any, **kwargs: Any) -> None:
        guard._counters = (guard.caster.step, _applied(engine))
        guard.prepare(full=guard.full_pending)

    def after_step(result: Any, *args: Any, **kwargs: Any) -> None:
        cast_before, applied_before = guard._counters
        applied = _applied(engine) != applied_before
        cast = guard.caster.step != cast_before
        if applied and not cast:
            error = (f"optimizer step {engine.global_steps} ran without Fair Cast's cast. {guard._moved()}")
            raise UnsupportedSetupError(f"fair_cast: {error}")
        if cast:
            first = "the first optimizer step" if guard.steps_checked == 0 else f"optimizer step {guard.caster.step}"
            guard.check(f"{first} ({type(adapter.optimizer).__name__}.step)")
            guard.steps_checked += 1

    def before_load(*args: Any, **kwargs: Any) -> None:
        guard.prepare(full=True)

    def after_load(result: Any, load_dir: Any, tag: Any = None, *args: Any, **kwargs: Any) -> None:
        if result is None or result[0] is None:  # nothing was loaded
            guard.record_full, guard.ready = False, {}
            return
        guard.full_pending = True
        guard.check(f"load_checkpoint({load_dir!s}, tag={tag!r})")

    hooks.before("step", "guard", "prepare the record of this step's casts", before_step)
    hooks.after("step", "guard", "the step cast, and the served copy is what it cast", after_step)
    hooks.before("load_checkpoint", "guard", "prepare a full record of the load's casts", before_load)
    hooks.after("load_checkpoint", "guard", "the served copy is what the load cast or restored", after_load)
    return guard
