"""The ``fair_cast`` section of the DeepSpeed JSON config.

DeepSpeed ignores unknown top-level keys, so nothing but this model stands between a typo and a
run that silently keeps round-to-nearest. Every key is validated strictly and every error names
the key and what would have been accepted.
"""
from __future__ import annotations

import difflib
import typing
from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from faircast_ds.align.config import AlignRoundingConfig
from faircast_ds.casting.modes import CastRule, Mode, ModeSpec
from faircast_ds.casting.modes import spec as spec_of

SECTION = "fair_cast"

NonFinitePolicy = Literal["error", "propagate"]
MissingStatePolicy = Literal["error", "reset"]


class FairCastConfigError(ValueError):
    """The ``fair_cast`` section is malformed; the message names each offending key."""


class DiagnosticsConfig(BaseModel):
    """``fair_cast.diagnostics``: the staleness reports; each key documents itself below
    (``python3 -m faircast_ds.config.keys`` renders them as docs/config.md's table)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    every: int = Field(default=10, ge=0, description=(
        "Steps between staleness reports (changed fraction, gap, lag); `0` turns diagnostics off."))
    sample: int = Field(default=16384, ge=1, description=(
        "About this many elements of the whole model are tracked for the lag estimate, chosen by a "
        "hash of (parameter, index), so the same for any sharding."))
    horizon: int = Field(default=256, ge=2, le=4096, description=(
        "Steps of sampled master history kept (the largest lag it can see); memory is "
        "`sample x horizon x 4` bytes in all (16 MiB by default), split across ranks."))
    log: bool = Field(default=True, description="Rank 0 prints one line per report.")


class FairCastConfig(BaseModel):
    """Validated ``fair_cast`` settings; each key documents itself in its ``Field(description=...)``
    (``python3 -m faircast_ds.config.keys`` renders them as docs/config.md's table)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    enabled: bool = Field(default=True, description=(
        "Turn the cast on; `false` keeps DeepSpeed's round-to-nearest, and rank 0 says so."))
    mode: Mode = Field(default="dither", description=(
        "The cast rule: `nearest` (round-to-nearest, DeepSpeed today, the control), `stochastic` "
        "(fresh noise every step), `dither` (a fixed per-element threshold), `error_feedback` "
        "(a carried fp32 residual); see docs/modes.md."))
    seed: int = Field(default=0, ge=0, lt=2**63, description=(
        "The noise seed; the noise is a function of (seed, step, parameter name, index)."))
    on_nonfinite: NonFinitePolicy = Field(default="error", description=(
        "`error` stops the step naming the parameter and element whose served value would be "
        "NaN/Inf; `propagate` serves it as DeepSpeed does today."))
    on_missing_state: MissingStatePolicy = Field(default="error", description=(
        "What `load_checkpoint` does when the checkpoint's Fair Cast state is missing, from another "
        "mode or seed, or corrupted: `error` names the problem on every rank; `reset` logs it and "
        "starts the residual at zero and the noise step at the engine's global step."))
    diagnostics: DiagnosticsConfig = Field(default_factory=DiagnosticsConfig, description=(
        "Staleness diagnostics, reported to rank 0's log and DeepSpeed's monitor; see docs/diagnostics.md."))
    align_rounding: Optional[AlignRoundingConfig] = Field(default=None, description=(
        "Align the trainer's rounding to an inference engine's (absent: off); needs `enabled: true` "
        "(use mode `nearest` to align without changing the cast); see docs/alignment.md."))

    @property
    def spec(self) -> ModeSpec:
        """The mode's spec: what the rest of the package asks about the mode (never its name)."""
        return spec_of(self.mode)

    @property
    def rule(self) -> CastRule:
        """How this run casts: the mode's spec and the seed."""
        return CastRule(self.spec, self.seed)

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


_PLAIN = {bool: "true or false", int: "an integer"}


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The config model behind a field's annotation (``Optional[Model]`` included), if any."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _field_model(path: tuple) -> type[BaseModel]:
    """The config model that owns the key at ``path`` (a pydantic error location)."""
    model: type[BaseModel] = FairCastConfig
    for part in path:
        field = model.model_fields.get(str(part))
        sub = _submodel(field.annotation) if field is not None else None
        if sub is None:
            break
        model = sub
    return model


def _accepted(model: type[BaseModel], field: str) -> str:
    info = model.model_fields.get(field)
    if info is None:  # an error inside a list or similar: pydantic's own words say it best
        return "a valid value"
    sub = _submodel(info.annotation)
    if sub is not None:
        return "an object with keys " + ", ".join(sub.model_fields)
    args = getattr(info.annotation, "__args__", None)
    if args and all(isinstance(a, str) for a in args):
        return "one of " + ", ".join(args)
    bounds = [f"{op} {m.ge if op == '>=' else m.lt if op == '<' else m.le}" for m in info.metadata
              for op in (">=", "<", "<=") if getattr(m, {">=": "ge", "<": "lt", "<=": "le"}[op], None) is not None]
    plain = _PLAIN.get(info.annotation, str(info.annotation))
    return plain + (f" ({', '.join(bounds)})" if bounds else "")


def _describe(exc: ValidationError, section: Any) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = ".".join([SECTION, *map(str, loc)])
        owner = _field_model(loc[:-1])
        field = str(loc[-1]) if loc else ""
        if err["type"] == "extra_forbidden":
            keys = list(owner.model_fields)
            hint = difflib.get_close_matches(field, keys, n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            lines.append(f"{path}: unknown key{suggestion}; accepted keys: {', '.join(keys)}")
        elif err["type"] == "missing":
            lines.append(f"{path}: required key is missing; expected {_accepted(owner, field)}")
        else:
            value = err.get("input")
            detail = f" ({err['msg']})" if err["type"] == "value_error" or field not in owner.model_fields else ""
            lines.append(f"{path}: {type(value).__name__} {value!r} is not accepted; "
                         f"expected {_accepted(owner, field)}{detail}")
    return "invalid fair_cast config:\n  " + "\n  ".join(lines)
