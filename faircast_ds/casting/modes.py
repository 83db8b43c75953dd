"""The cast modes as one registry: a :class:`ModeSpec` per mode says everything the rest of the
package may ask about a mode, so no module outside ``faircast_ds.casting`` and the config tells modes
apart by name.

- ``nearest``: round to nearest even (DeepSpeed's own cast; the control). No noise.
- ``stochastic``: fresh noise every cast (stream 1, keyed by the step).
- ``dither``: a fixed per-element threshold for the whole run (stream 2, keyed by step 0).
- ``error_feedback``: round to nearest of master + carried residual. No noise; an fp32 residual per
  element, saved in checkpoints.

The fused kernels' mode codes are the built-in modes' positions in that list: nearest 0, stochastic 1,
dither 2, error_feedback 3. The noise of a mode at optimizer step ``step`` is
``faircast_ds.casting.noise``'s ``noise16`` under ``key(name, stream, seed, step)`` with the stream and
step its spec names. A run casts with a :class:`CastRule`: its spec and its seed.

Adding a mode is one :func:`register` call with its pure-torch rule, plus its code in the kernels
(``code``); a mode without a code is served by the pure-torch path and refused by name by a kernel
asked to run it. This module imports no torch at import time (the command line reads it).
"""
from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Final, Literal

if TYPE_CHECKING:
    import torch

# the pure-torch rule of a mode: (fp32 slice, its 16-bit noise or None, its residual or None) -> bf16
TorchRule = Callable[["torch.Tensor", "torch.Tensor | None", "torch.Tensor | None"], "torch.Tensor"]

STREAM_STOCHASTIC: Final = 1  # stream tags keep the noise of different modes independent for one (seed, name)
STREAM_DITHER: Final = 2


@dataclass(frozen=True)
class ModeSpec:
    """What a mode is. ``stream``: its noise stream (None: it draws no noise); ``per_step``: the noise is
    redrawn every optimizer step (else fixed for the run); ``residual``: it carries an fp32 residual per
    element, which checkpoints save and restore; ``code``: the fused kernels' code for it (None: the
    pure-torch ``rule`` alone serves it)."""

    name: str
    rule: TorchRule
    stream: int | None = None
    per_step: bool = False
    residual: bool = False
    code: int | None = None

    @property
    def uses_noise(self) -> bool:
        return self.stream is not None

    @property
    def checkpoint_state(self) -> str:
        """What a checkpoint keeps for the mode beyond the step: ``"residual"`` (the values) or ``"none"``."""
        return "residual" if self.residual else "none"


def _nearest(x: "torch.Tensor", noise: "torch.Tensor | None", residual: "torch.Tensor | None") -> "torch.Tensor":
    import torch

    return x.to(torch.bfloat16)


def _with_noise(x: "torch.Tensor", noise: "torch.Tensor | None", residual: "torch.Tensor | None") -> "torch.Tensor":
    from faircast_ds.casting.rounding import round_with_noise

    return round_with_noise(x, noise)


def _error_feedback(x: "torch.Tensor", noise: "torch.Tensor | None", residual: "torch.Tensor | None") -> "torch.Tensor":
    from faircast_ds.casting.rounding import error_feedback_step

    return error_feedback_step(x, residual)


Mode = Literal["nearest", "stochastic", "dither", "error_feedback"]  # the built-in modes (the config's type)
MODES: Final[tuple[str, ...]] = typing.get_args(Mode)

_REGISTRY: dict[str, ModeSpec] = {}


def register(spec: ModeSpec) -> ModeSpec:
    """Add a mode. Its name and its kernel code must be new."""
    if spec.name in _REGISTRY:
        raise ValueError(f"fair cast mode {spec.name!r} is already registered")
    if spec.code is not None and any(s.code == spec.code for s in _REGISTRY.values()):
        raise ValueError(f"kernel code {spec.code} is already taken")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a mode added by :func:`register` (the built-in ones stay)."""
    if name in MODES:
        raise ValueError(f"{name!r} is a built-in mode")
    _REGISTRY.pop(name, None)


for _spec in (ModeSpec("nearest", _nearest, code=0),
              ModeSpec("stochastic", _with_noise, stream=STREAM_STOCHASTIC, per_step=True, code=1),
              ModeSpec("dither", _with_noise, stream=STREAM_DITHER, per_step=False, code=2),
              ModeSpec("error_feedback", _error_feedback, residual=True, code=3)):
    register(_spec)


def registered() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def spec(mode: str) -> ModeSpec:
    """The spec of ``mode``; an unknown name is refused with the accepted ones."""
    try:
        return _REGISTRY[mode]
    except (KeyError, TypeError):
        raise ValueError(f"unknown fair cast mode {mode!r}; accepted: {', '.join(_REGISTRY)}") from None


def kernel_code(mode: str, kernel: str) -> int:
    """The code the fused ``kernel`` runs ``mode`` under; a mode it has no code for is refused by name."""
    code = spec(mode).code
    if code is None:
        raise ValueError(f"the fused {kernel} kernel has no code for fair cast mode {mode!r}; it is served by "
                         "the pure-torch path (FAIRCAST_DS_KERNELS=eager or auto)")
    return code


def uses_noise(mode: str) -> bool:
    return spec(mode).uses_noise


def noise_key(mode: str, *, seed: int, step: int, name: str) -> int:
    """The 32-bit stream key a noise mode hashes with at ``step`` (0 for modes without noise)."""
    return CastRule(spec(mode), seed).key(name, step)


@dataclass(frozen=True)
class CastRule:
    """How a run casts: a mode's spec and the run's seed. ``key(name, step)`` is the noise key of one
    parameter at one optimizer step (0 for a mode without noise)."""

    spec: ModeSpec
    seed: int

    @classmethod
    def of(cls, mode: str, seed: int) -> "CastRule":
        return cls(spec(mode), seed)

    @property
    def mode(self) -> str:
        return self.spec.name

    def key(self, name: str, step: int) -> int:
        if self.spec.stream is None:
            return 0
        from faircast_ds.casting.noise import stream_key

        return stream_key(seed=self.seed, step=step if self.spec.per_step else 0, name=name, stream=self.spec.stream)
