"""Which optimizer is served by which Fair Cast route: the one registry every route uses.

A route is stored on the optimizer object itself, so it lives exactly as long as the optimizer (no
``id()`` that a new object could reuse, nothing that keeps a dead optimizer alive); the registry holds
the optimizers only weakly, to find one by its buffers. One route per optimizer: a second one would
cast every refresh twice, so registering it is refused.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, get_args

from faircast_ds.shard.adapter import Adapter

_ATTR = "_fair_cast_route"

Choice = Literal["auto", "runtime", "hook"]
"""What ``attach(..., route=)`` takes, for either framework: ``runtime`` replaces the optimizer's refresh
sites at run time; ``hook`` registers with a patched framework's cast hook (``patches/``); ``auto`` takes
the hook when the importable framework carries it, else the runtime route."""
CHOICES: tuple[str, ...] = get_args(Choice)

Framework = Literal["deepspeed", "megatron"]
RouteKind = Literal["deepspeed-runtime", "deepspeed-hook", "megatron-runtime", "megatron-hook"]
"""One route: a framework and how its refreshes reach the caster (the banner's ``route=``)."""
KINDS: tuple[str, ...] = get_args(RouteKind)
DEEPSPEED_RUNTIME: RouteKind = "deepspeed-runtime"
DEEPSPEED_HOOK: RouteKind = "deepspeed-hook"
MEGATRON_RUNTIME: RouteKind = "megatron-runtime"
MEGATRON_HOOK: RouteKind = "megatron-hook"


def resolve_choice(route: str, *, has_hook: Callable[[], bool]) -> Literal["runtime", "hook"]:
    """``route`` as "runtime" or "hook" (``auto``: the hook when ``has_hook()``); ValueError otherwise."""
    if route not in CHOICES:
        raise ValueError(f"route must be one of {', '.join(map(repr, CHOICES))}, got {route!r}")
    if route == "auto":
        return "hook" if has_hook() else "runtime"
    return route  # type: ignore[return-value]


def kind(framework: Framework, choice: Literal["runtime", "hook"]) -> RouteKind:
    """The route kind of ``framework`` taken ``choice``'s way."""
    name = f"{framework}-{choice}"
    if name not in KINDS:
        raise ValueError(f"no route {name!r} (routes: {', '.join(KINDS)})")
    return name  # type: ignore[return-value]


@dataclass(frozen=True)
class Route:
    """``adapter`` serves its optimizer's refreshes; ``kind`` says how (one of :data:`KINDS`)."""

    adapter: Adapter
    kind: RouteKind

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown route kind {self.kind!r} (routes: {', '.join(KINDS)})")


class RouteRegistry:
    def __init__(self) -> None:
        self._optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()

    def add(self, optimizer: Any, route: Route) -> None:
        existing = self.get(optimizer)
        if existing is not None:
            raise RuntimeError(f"fair_cast: this optimizer is already served by the {existing.kind} route; a second "
                               f"({route.kind}) route would make every refresh cast twice. Attach Fair Cast once: with "
                               "a patched framework, FAIRCAST_DS_AUTOLOAD=0 and the hook route, or the runtime "
                               "route alone.")
        setattr(optimizer, _ATTR, route)
        self._optimizers.add(optimizer)

    def get(self, optimizer: Any) -> Route | None:
        return getattr(optimizer, _ATTR, None) if optimizer is not None else None

    def remove(self, optimizer: Any) -> None:
        if self.get(optimizer) is not None:
            delattr(optimizer, _ATTR)
        self._optimizers.discard(optimizer)

    def routes(self) -> Iterator[Route]:
        for optimizer in list(self._optimizers):
            route = self.get(optimizer)
            if route is not None:
                yield route

    def find(self, predicate: Callable[[Route], bool]) -> Route | None:
        """The live route for which ``predicate`` holds, if any."""
        return next((r for r in self.routes() if predicate(r)), None)


ROUTES = RouteRegistry()
