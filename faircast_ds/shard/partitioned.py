"""Parameters a framework keeps partitioned across ranks (DeepSpeed ZeRO-3's): how the core reads their
full shape and gathers them, without knowing the framework.

An integration registers a :class:`Layout` for the parameters it partitions
(``faircast_ds.deepspeed.params.ZERO3``, registered when ``faircast_ds.deepspeed.attachment`` is imported:
by the interpreter-start hook with DeepSpeed's engine module, or by ``attach``). A parameter no
registered layout claims is an ordinary one: its data is all of it.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator, Protocol

import torch


class Layout(Protocol):
    """What the core needs of a framework's partitioned parameters."""

    name: str

    def owns(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param`` is one of this framework's partitioned parameters."""

    def full_shape(self, param: torch.nn.Parameter) -> tuple[int, ...]:
        """The parameter's full shape, gathered or not (local: no collective)."""

    def gathered(self, param: torch.nn.Parameter) -> ContextManager[torch.Tensor]:
        """The parameter in full for the duration (a collective)."""


_LAYOUTS: list[Layout] = []


def register(layout: Layout) -> None:
    """Make the core read ``layout``'s parameters through it (once; a second registration is a no-op)."""
    if all(existing is not layout for existing in _LAYOUTS):
        _LAYOUTS.append(layout)


def layouts() -> tuple[Layout, ...]:
    return tuple(_LAYOUTS)


def layout_of(param: torch.nn.Parameter) -> Layout | None:
    """The registered layout that partitions ``param``, or None for an ordinary parameter."""
    return next((layout for layout in _LAYOUTS if layout.owns(param)), None)


def is_partitioned(param: torch.nn.Parameter) -> bool:
    return layout_of(param) is not None


def full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    layout = layout_of(param)
    return layout.full_shape(param) if layout is not None else tuple(int(d) for d in param.shape)


@contextlib.contextmanager
def gathered(param: torch.nn.Parameter) -> Iterator[torch.Tensor]:
    """``param.data`` in full for the duration (a collective for a partitioned parameter)."""
    layout = layout_of(param)
    if layout is None:
        yield param.data
        return
    with layout.gathered(param) as full:
        yield full
