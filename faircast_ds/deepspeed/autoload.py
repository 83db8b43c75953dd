"""Interpreter-start hook (loaded by ``faircast-ds.pth``): activates Fair Cast for unmodified scripts.

It only registers an import watcher; nothing is imported until a program imports DeepSpeed's
engine module. Then ``faircast_ds.install()`` wraps ``DeepSpeedEngine.__init__`` so that any engine
built with a ``fair_cast`` section — by ``deepspeed.initialize``, HF Trainer or Accelerate — gets
the cast. Set ``FAIRCAST_DS_AUTOLOAD=0`` to switch the watcher off.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any, Sequence

TARGET = "deepspeed.runtime.engine"


class _HookedLoader(importlib.abc.Loader):
    """Runs the real loader, then installs Fair Cast on the freshly executed engine module."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        from faircast_ds.deepspeed.attachment import install

        install()

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... for tracebacks and inspect
        return getattr(self.inner, name)


class _EngineWatcher(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _HookedLoader(spec.loader)
                return spec
        return None


def enable() -> None:
    if os.environ.get("FAIRCAST_DS_AUTOLOAD", "1") == "0":
        return
    if TARGET in sys.modules:  # imported before us (unusual): patch directly
        from faircast_ds.deepspeed.attachment import install

        install()
        return
    if not any(isinstance(f, _EngineWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _EngineWatcher())


enable()
