"""Where the ``fair_cast`` section comes from: the DeepSpeed config, or ``FAIRCAST_DS_CONFIG``.

Frameworks that build the DeepSpeed config dict in code (OpenRLHF, oat, SkyRL) leave their users no
place for a ``fair_cast`` key. ``FAIRCAST_DS_CONFIG`` carries the section instead: either the
section itself as JSON (``{"mode": "stochastic", "seed": 1}``) or the path of a JSON file holding it.
That file may also be a whole DeepSpeed config; then its ``fair_cast`` key is the section.

The variable applies to every engine whose config has no section. Where both exist they must say
the same thing (compared after validation, so ``{}`` equals ``{"enabled": true}``); where they
differ, :class:`FairCastConfigError` names both. Every problem with the variable is a
``FairCastConfigError`` naming the variable (and the file, for a path).

Core module: it reads the environment and a file, and imports no framework.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from faircast_ds.config.section import (
    SECTION,
    FairCastConfig,
    FairCastConfigError,
    find_section,
)

ENV = "FAIRCAST_DS_CONFIG"

# what the banner's ``origin=`` says
FROM_CONFIG = "config"
FROM_ARGUMENT = "attach"


@dataclass(frozen=True)
class Resolved:
    """A validated section and where it came from (``origin``, as the banner prints it)."""

    config: FairCastConfig
    origin: str  # "config", "FAIRCAST_DS_CONFIG", "FAIRCAST_DS_CONFIG:/path.json", "config+FAIRCAST_DS_CONFIG", "attach"


def _env_value(environ: Mapping[str, str] | None) -> str | None:
    return (os.environ if environ is None else environ).get(ENV)


def _parse(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        hint = ""
        if text.lstrip().startswith("{") and '"' not in text:
            hint = (" (its double quotes are gone: a launcher or shell stripped them, as DeepSpeed's multi-node "
                    "runner does to .deepspeed_env values; put the section in a file and set the variable to its path)")
        raise FairCastConfigError(f"{where}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
                                  f"{hint}") from None


def read_env(environ: Mapping[str, str] | None = None) -> tuple[Any, str] | None:
    """The raw section ``FAIRCAST_DS_CONFIG`` holds and its origin, or None when the variable is unset.

    An empty value, a missing or unreadable file, or text that is not JSON raise FairCastConfigError
    naming the variable.
    """
    value = _env_value(environ)
    if value is None:
        return None
    text = value.strip()
    if not text:
        raise FairCastConfigError(f"{ENV} is set but empty: set it to the fair_cast section as JSON "
                                  f"(e.g. '{{\"mode\": \"stochastic\"}}') or to the path of a JSON file, or unset it")
    if text.startswith("{") or text.startswith("["):
        return _parse(text, f"{ENV} (inline JSON)"), ENV
    path = os.path.expanduser(text)
    where = f"{ENV}={text}"
    if not os.path.exists(path):
        raise FairCastConfigError(f"{where}: no such file (the variable holds either the fair_cast section as JSON, "
                                  f"starting with '{{', or the path of a JSON file; on every node, for multi-node jobs)")
    if os.path.isdir(path):
        raise FairCastConfigError(f"{where}: is a directory, expected a JSON file holding the fair_cast section")
    try:
        with open(path, encoding="utf-8") as f:
            raw = _parse(f.read(), where)
    except OSError as exc:
        raise FairCastConfigError(f"{where}: cannot read the file: {exc.strerror or exc}") from None
    origin = f"{ENV}:{os.path.abspath(path)}"
    if isinstance(raw, Mapping) and SECTION in raw:  # a whole DeepSpeed config: take its section
        return raw[SECTION], origin
    return raw, origin


def env_section(environ: Mapping[str, str] | None = None) -> Resolved | None:
    """The validated section of ``FAIRCAST_DS_CONFIG`` (None when unset); errors name the variable."""
    found = read_env(environ)
    if found is None:
        return None
    raw, origin = found
    try:
        config = FairCastConfig.from_section(raw)
    except FairCastConfigError as exc:
        raise FairCastConfigError(f"{_where(origin)}: {exc}") from None
    return Resolved(config, origin)


def _where(origin: str) -> str:
    if origin == ENV:
        return f"{ENV} (inline JSON)"
    return f"{ENV}={origin.split(':', 1)[1]}" if origin.startswith(ENV + ":") else origin


def _differences(a: dict[str, Any], b: dict[str, Any], prefix: str = SECTION) -> list[str]:
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}.{key}")
        elif x != y:
            out.append(f"{prefix}.{key}: {json.dumps(x)} vs {json.dumps(y)}")
    return out


def resolve(ds_config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> Resolved | None:
    """The section an engine built from ``ds_config`` (the raw DeepSpeed config dict) gets, and where it
    came from; None when neither the config nor ``FAIRCAST_DS_CONFIG`` has one.

    Raises FairCastConfigError for a malformed section (naming the variable when it came from there)
    and when both have a section and they differ.
    """
    own = find_section(ds_config)
    env = env_section(environ)
    if own is None:
        return env
    if env is None:
        return Resolved(own, FROM_CONFIG)
    mine, theirs = own.model_dump(mode="json"), env.config.model_dump(mode="json")
    if mine != theirs:
        diffs = "\n  ".join(_differences(mine, theirs))
        raise FairCastConfigError(
            f"two different fair_cast sections: the DeepSpeed config has {json.dumps(ds_config[SECTION])} and "
            f"{_where(env.origin)} has {json.dumps(_raw_for_message(environ))}; they differ in "
            f"(config vs {ENV}):\n  {diffs}\n"
            f"keep one: remove the section from the config, or unset {ENV}")
    return Resolved(own, f"{FROM_CONFIG}+{env.origin}")


def _raw_for_message(environ: Mapping[str, str] | None) -> Any:
    found = read_env(environ)
    return found[0] if found is not None else None


def describe(resolved: Resolved | None) -> str:
    """One phrase for humans: where the section came from."""
    if resolved is None:
        return f"no fair_cast section (neither the DeepSpeed config nor {ENV} has one)"
    origin = resolved.origin
    if origin == FROM_CONFIG:
        return "the DeepSpeed config's fair_cast section"
    if origin == FROM_ARGUMENT:
        return "the config passed to attach()"
    if origin.startswith(FROM_CONFIG + "+"):
        return f"the DeepSpeed config's fair_cast section (and {_where(origin[len(FROM_CONFIG) + 1:])}, identical)"
    return _where(origin)
