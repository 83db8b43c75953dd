"""Lazy package exports: a package lists its public names and the module each lives in; the module
is imported the first time the name is read (PEP 562), so importing the package costs nothing."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def exports(package: str, table: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The ``__getattr__`` for ``package``: ``table`` maps each public name to its module; a name read
    once is kept in ``namespace`` (the package's globals()), so later reads do not come back here."""

    def __getattr__(name: str) -> Any:
        try:
            module_name = table[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module_name), name)
        namespace[name] = value
        return value

    return __getattr__
