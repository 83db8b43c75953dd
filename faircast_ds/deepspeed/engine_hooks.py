"""What runs around a DeepSpeed engine's methods: one :class:`EngineHooks` per engine, the only place
Fair Cast replaces an engine's bound methods.

``EngineHooks.of(engine)`` replaces ``engine.step``, ``engine.save_checkpoint``,
``engine.load_checkpoint`` and ``engine.load_module_state_dict`` once, each by a dispatcher that runs,
in this order::

    before hooks (registration order) -> around hooks (first registered outermost) -> DeepSpeed's method
    -> after hooks (registration order)

Every route attaches through ``faircast_ds.deepspeed.attachment.wire_engine``, which registers, in order:

- ``engine.step``: before: guard (prepare the record buffers, note the step counters); after:
  diagnostics (every ``every``-th step: reduce, log, feed DeepSpeed's monitor), then guard (the step
  cast, and what DeepSpeed serves is what was cast);
- ``engine.save_checkpoint``: around: checkpoint state (ours first, DeepSpeed's files, then ``latest``);
- ``engine.load_checkpoint``: before: guard (full record buffers); around: checkpoint state (read
  ``latest`` once, check the tag, restore our state); after: guard (full check of the served copy);
- ``engine.load_module_state_dict``: around: checkpoint state (ZeRO-3 module-only loads get the served
  copy, not round-to-nearest of the masters).

``EngineHooks.describe()`` lists what is registered on one engine. The caster's writes reach
diagnostics and the guard through ``ShardCaster.observers`` (nothing replaces ``cast_flat`` or
``publish``).

Replacements that are not an engine's methods, each made once and marked ``_faircast_wrapped``:

- ``DeepSpeedEngine.__init__`` (``faircast_ds.deepspeed.attachment.install``): engines with a section
  attach as they are built;
- ``deepspeed.runtime.engine.get_fp32_state_dict_from_zero_checkpoint``
  (``faircast_ds.deepspeed.checkpoint``): during our loads it reads the tag being loaded;
- ``all_gather_dp_groups`` of ``deepspeed.runtime.zero.stage_1_and_2`` / ``deepspeed.runtime.bf16_optimizer``
  (``faircast_ds.deepspeed.adapters.zero12``): the runtime route's ZeRO-1/2 and BF16_Optimizer cast site;
- the optimizer's own refresh sites, on the optimizer instance (the runtime route's adapters:
  ZeRO-1/2's ``step``, ZeRO-3's ``_reassign_or_swap_out_partitioned_parameters`` and load sites); the
  hook route replaces none of them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

METHODS = ("step", "save_checkpoint", "load_checkpoint", "load_module_state_dict")
Phase = Literal["before", "around", "after"]
PHASES: tuple[Phase, ...] = ("before", "around", "after")
_ATTR = "_fair_cast_hooks"


@dataclass(frozen=True)
class Hook:
    """One registered hook: who registered it (``owner``, e.g. "guard"), what it does, the function."""

    owner: str
    what: str
    fn: Callable[..., Any]


@dataclass
class _Method:
    original: Callable[..., Any]
    hooks: dict[str, list[Hook]] = field(default_factory=lambda: {p: [] for p in PHASES})


class EngineHooks:
    """The hooks of one engine (see the module docstring). Made by :meth:`of`, once per engine."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.methods: dict[str, _Method] = {}
        for name in METHODS:
            original = getattr(engine, name)
            self.methods[name] = _Method(original)
            setattr(engine, name, self._dispatcher(name, original))

    @classmethod
    def of(cls, engine: Any) -> "EngineHooks":
        """The engine's hooks, installing the dispatchers on the first call only."""
        hooks = engine.__dict__.get(_ATTR)
        if hooks is None:
            hooks = cls(engine)
            setattr(engine, _ATTR, hooks)
        return hooks

    def original(self, method: str) -> Callable[..., Any]:
        """DeepSpeed's own bound method (for its signature)."""
        return self.methods[method].original

    def _dispatcher(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        entry_hooks = lambda: self.methods[name].hooks  # noqa: E731 - read at call time

        @functools.wraps(original)
        def dispatch(*args: Any, **kwargs: Any) -> Any:
            hooks = entry_hooks()
            for h in hooks["before"]:
                h.fn(*args, **kwargs)
            call = original
            for h in reversed(hooks["around"]):  # the first registered is the outermost
                call = functools.partial(h.fn, call)
            result = call(*args, **kwargs)
            for h in hooks["after"]:
                h.fn(result, *args, **kwargs)
            return result

        dispatch._faircast_hooks = True  # type: ignore[attr-defined]
        return dispatch

    def add(self, phase: Phase, method: str, owner: str, what: str, fn: Callable[..., Any]) -> None:
        """Register ``fn``: ``before``: ``fn(*args, **kwargs)``; ``around``: ``fn(call, *args, **kwargs)``
        returning the result (``call`` runs the inner hooks and DeepSpeed's method); ``after``:
        ``fn(result, *args, **kwargs)``. One hook per (phase, method, owner)."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        if method not in self.methods:
            raise ValueError(f"engine method {method!r} is not hooked (hooked: {', '.join(METHODS)})")
        listed = self.methods[method].hooks[phase]
        if any(h.owner == owner for h in listed):
            raise RuntimeError(f"fair_cast: {owner} already has a {phase} hook on engine.{method}")
        listed.append(Hook(owner, what, fn))

    def before(self, method: str, owner: str, what: str, fn: Callable[..., Any]) -> None:
        self.add("before", method, owner, what, fn)

    def around(self, method: str, owner: str, what: str, fn: Callable[..., Any]) -> None:
        self.add("around", method, owner, what, fn)

    def after(self, method: str, owner: str, what: str, fn: Callable[..., Any]) -> None:
        self.add("after", method, owner, what, fn)

    def describe(self) -> list[str]:
        """One line per registered hook, in the order a call runs them: ``engine.step: before guard: ...``."""
        return [f"engine.{name}: {phase} {h.owner}: {h.what}"
                for name, entry in self.methods.items() for phase in PHASES for h in entry.hooks[phase]]
