"""The ``fair_cast`` section of the DeepSpeed JSON config.

DeepSpeed ignores unknown top-level keys, so nothing but this model stands between a typo and a
run that silently keeps round-to-nearest. Every key is validated strictly and every error names
the key and what would have been accepted.
"""
from __future__ import annotations

import difflib
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SECTION = "fair_cast"

Mode = Literal["nearest", "stochastic", "dither", "error_feedback"]
NonFinitePolicy = Literal["error", "propagate"]
MissingStatePolicy = Literal["error", "reset"]


class FairCastConfigError(ValueError):
    """The ``fair_cast`` section is malformed; the message names each offending key."""


class FairCastConfig(BaseModel):
    """Validated ``fair_cast`` settings.

    enabled:      turn the cast on (``false`` keeps DeepSpeed's round-to-nearest, and says so).
    mode:         ``nearest`` (DeepSpeed today, the control), ``stochastic`` (fresh noise every cast),
                  ``dither`` (a fixed per-element threshold), ``error_feedback`` (a carried residual).
    seed:         the noise seed; the noise is a function of (seed, step, parameter name, index).
    on_nonfinite: ``error`` stops the step with the parameter's name when a served weight is NaN/Inf;
                  ``propagate`` serves it as it is (what DeepSpeed does today).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    enabled: bool = True
    mode: Mode = "stochastic"
    seed: int = Field(default=0, ge=0, lt=2**63)
    on_nonfinite: NonFinitePolicy = "error"
    on_missing_state: MissingStatePolicy = "error"

    @classmethod
    def from_section(cls, section: Any) -> "FairCastConfig":
        """Validate the raw ``fair_cast`` value from a DeepSpeed config dict."""
        if not isinstance(section, Mapping):
            raise FairCastConfigError(
                f"{SECTION}: expected an object such as {{\"enabled\": true, \"mode\": \"stochastic\"}}, "
                f"got {type(section).__name__} {section!r}")
        try:
            return cls.model_validate(dict(section))
        except ValidationError as exc:
            raise FairCastConfigError(_describe(exc, section)) from None


def find_section(ds_config: Mapping[str, Any] | None) -> FairCastConfig | None:
    """The validated ``fair_cast`` section of a DeepSpeed config dict, or None when it is absent."""
    if not ds_config or SECTION not in ds_config:
        return None
    return FairCastConfig.from_section(ds_config[SECTION])


def _accepted(field: str) -> str:
    annotation = FairCastConfig.model_fields[field].annotation
    args = getattr(annotation, "__args__", None)
    if args and all(isinstance(a, str) for a in args):
        return "one of " + ", ".join(args)
    return {"enabled": "true or false", "seed": "an integer in [0, 2^63)"}.get(field, str(annotation))


def _describe(exc: ValidationError, section: Mapping[str, Any]) -> str:
    keys = list(FairCastConfig.model_fields)
    lines = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "extra_forbidden":
            hint = difflib.get_close_matches(field, keys, n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            lines.append(f"{SECTION}.{field}: unknown key{suggestion}; accepted keys: {', '.join(keys)}")
        else:
            value = section.get(field)
            lines.append(f"{SECTION}.{field}: {type(value).__name__} {value!r} is not accepted; "
                         f"expected {_accepted(field)}")
    return "invalid fair_cast config:\n  " + "\n  ".join(lines)
