"""The ``fair_cast`` key table of docs/config.md, rendered from the config models.

Every key documents itself in its ``Field(description=...)``; this module turns the models into one
markdown table (key path, type or accepted values, default, description), so the docs cannot drift
from the code (``tests/config/test_config_docs.py`` compares them).

    python3 -m faircast_ds.config.keys                     # print the table
    python3 -m faircast_ds.config.keys --update docs/config.md   # rewrite it between the markers

Pydantic only: importing this module does not import torch.
"""
from __future__ import annotations

import argparse
import json
import sys
import typing
from typing import Any, Iterator, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from faircast_ds.config.section import SECTION, FairCastConfig, _submodel

BEGIN = "<!-- keys:begin -->"
END = "<!-- keys:end -->"


def _number(value: int) -> str:
    if value >= 2**20 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    return str(value)


def _bounds(info: FieldInfo) -> str:
    lo = hi = None
    lo_open = hi_open = False
    for m in info.metadata:
        for attr, is_lo, is_open in (("ge", True, False), ("gt", True, True), ("le", False, False), ("lt", False, True)):
            value = getattr(m, attr, None)
            if value is None:
                continue
            if is_lo:
                lo, lo_open = value, is_open
            else:
                hi, hi_open = value, is_open
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{_number(lo)}, {_number(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '≥'} {_number(lo)}"
    if hi is not None:
        return f" {'<' if hi_open else '≤'} {_number(hi)}"
    return ""


def _type(annotation: Any) -> str:
    """The accepted values of a plain annotation, in JSON terms."""
    if typing.get_origin(annotation) is Literal:
        return ", ".join(f"`{json.dumps(a)}`" for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        return "list of " + _type(item)
    if typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        inner = " or ".join(_type(a) for a in args)
        return inner + (" or `null`" if optional else "")
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    names = {bool: "bool", int: "int", str: "string", float: "number"}
    if annotation in names:
        return names[annotation]
    raise TypeError(f"config_docs: no rendering for the annotation {annotation!r}; add one")


def _default(info: FieldInfo) -> str:
    if info.default is PydanticUndefined and info.default_factory is None:
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "see below"
    return f"`{json.dumps(value)}`"


def _rows(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, str, str, str]]:
    for name, info in model.model_fields.items():
        path = f"{prefix}.{name}"
        if not (info.description or "").strip():
            raise ValueError(f"{path} has no description: give it Field(description=...) in its model")
        kind = _type(info.annotation)
        if _submodel(info.annotation) is None:
            kind += _bounds(info)
        yield path, kind, _default(info), " ".join(info.description.split())
        sub = _submodel(info.annotation)
        if sub is not None:
            yield from _rows(sub, path)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def key_table() -> str:
    """The markdown table of every ``fair_cast`` key, nested keys included, in model order."""
    lines = ["| key | type, accepted values | default | description |", "|---|---|---|---|"]
    for row in _rows(FairCastConfig, SECTION):
        path, *rest = row
        lines.append("| " + " | ".join([f"`{path}`", *map(_cell, rest)]) + " |")
    return "\n".join(lines) + "\n"


def between_markers(text: str) -> str:
    """What ``text`` holds between the key-table markers (without the newlines next to them)."""
    try:
        start = text.index(BEGIN) + len(BEGIN)
        stop = text.index(END, start)
    except ValueError:
        raise ValueError(f"the markers {BEGIN} and {END} are missing") from None
    return text[start:stop].strip("\n") + "\n"


def update(path: str) -> bool:
    """Rewrite the table between the markers of the file at ``path``; True if it changed."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if between_markers(text) == key_table():
        return False
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{BEGIN}\n{key_table()}{END}{tail}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m faircast_ds.config.keys", description=__doc__.split("\n")[0])
    parser.add_argument("--update", metavar="FILE", help="rewrite the table between the markers in FILE "
                        "(docs/config.md) instead of printing it")
    args = parser.parse_args(argv)
    if args.update:
        changed = update(args.update)
        print(f"{args.update}: {'updated' if changed else 'already up to date'}")
    else:
        sys.stdout.write(key_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
