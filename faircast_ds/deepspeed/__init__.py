"""The DeepSpeed integration: everything that reads DeepSpeed's internals lives in this package.

The same role names as ``faircast_ds.megatron``:
- ``attach``: the attach pipeline and the runtime route (``install()`` wraps ``DeepSpeedEngine.__init__``;
  ``attach(engine, route="auto")`` for either route).
- ``hook``: the route through a patched DeepSpeed's cast hook (``patches/``).
- ``checkpoint``: Fair Cast's state in ``save_checkpoint`` / ``load_checkpoint``.
- ``guard``: when the run-time guard checks (around ``engine.step`` and loads) and its message.
- ``compat``: the differences between DeepSpeed releases; ``support``: the setups we refuse.
- ``adapters/``: one adapter per DeepSpeed optimizer class.
- ``engine_hooks``: the one object per engine that runs diagnostics, checkpoint state and the guard around
  ``engine.step`` and the checkpoint methods (and the list of every other replacement we make).
- ``autoload``: the interpreter-start hook that ``faircast-ds.pth`` loads; ``check``: ``faircast-ds check``.
- ``params``: ZeRO-3 parameter attributes; ``masters``: a checkpoint's fp32 masters for ``faircast-ds inspect``.

Importing this package imports nothing of DeepSpeed (the interpreter-start hook loads it).
"""
from __future__ import annotations

from typing import Any


def install() -> None:
    """Attach Fair Cast to every DeepSpeed engine built from now on whose config has a ``fair_cast`` section."""
    from faircast_ds.deepspeed.attachment import install as _install

    _install()


def attach(engine: Any, config: Any = None, *, route: str = "auto") -> Any:
    """Attach Fair Cast to a built engine; ``route``: ``"auto"``, ``"runtime"`` or ``"hook"``
    (:data:`faircast_ds.shard.routes.Choice`; see :func:`faircast_ds.deepspeed.attachment.attach`)."""
    from faircast_ds.deepspeed.attachment import attach as _attach

    return _attach(engine, config, route=route)
