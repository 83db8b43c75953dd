"""Fast paths for :func:`faircast_ds.casting.rules.cast_into`: one pass over a shard, noise in registers.

- ``cpp``: a fused C++ kernel for CPU tensors (``fused_cast.cpp``, built at first use; see ``cpu``);
- ``triton``: a Triton kernel for CUDA tensors (``triton_cast``; imported only when used);
- ``eager``: no fast path; ``cast_into`` runs the eager torch ``cast`` and copies.

The environment variable ``FAIRCAST_DS_KERNELS`` picks one: ``auto`` (default: the fast path for
the tensor's device when it can run, else eager, with one warning), ``eager``, ``cpp`` or
``triton`` (forced: an error if it cannot run). Every path gives the bits of ``rules.cast``.
"""
from __future__ import annotations

import os
import warnings

import torch

from faircast_ds.casting.modes import CastRule

ENV_VAR = "FAIRCAST_DS_KERNELS"
BACKENDS = ("auto", "eager", "cpp", "triton")

_warned: set[str] = set()


def requested_backend() -> str:
    """The backend named by ``FAIRCAST_DS_KERNELS`` (``auto`` when unset)."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={value!r}; accepted: {', '.join(BACKENDS)}")
    return value


def _usable(backend: str) -> tuple[bool, str]:
    if backend == "cpp":
        from faircast_ds.casting.kernels import cpu

        return cpu.available(), cpu.unavailable_reason() or ""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        from faircast_ds.casting.kernels import triton_cast  # noqa: F401  (imports Triton)
    except Exception as exc:  # not installed, or too old for what the kernel uses
        return False, f"triton unavailable: {type(exc).__name__}: {exc}"
    return True, ""


def backend_for(device: torch.device) -> str:
    """The path ``cast_into`` takes for tensors on ``device`` (may build the CPU kernel)."""
    requested = requested_backend()
    native = "cpp" if device.type == "cpu" else "triton" if device.type == "cuda" else None
    if requested == "eager":
        return "eager"
    if requested != "auto":
        if requested != native:
            raise ValueError(f"{ENV_VAR}={requested} cannot cast {device.type} tensors")
        ok, why = _usable(requested)
        if not ok:
            raise RuntimeError(f"{ENV_VAR}={requested} but that kernel cannot run here: {why}")
        return requested
    if native is None:
        return "eager"
    ok, why = _usable(native)
    if not ok:
        if native not in _warned:
            _warned.add(native)
            warnings.warn(f"faircast-ds: the fused {native} kernel is unavailable ({why}); "
                          "using the eager torch path (same bits, slower)", RuntimeWarning, stacklevel=3)
        return "eager"
    return native


def fused_cast_into(out: torch.Tensor, x: torch.Tensor, rule: CastRule, *, step: int, name: str,
                    start: int, residual: torch.Tensor | None, runs=None, marks: torch.Tensor | None = None,
                    mark_base: int = 0) -> tuple[int, int] | None:
    """Cast with the fast path for the tensors' device; None when the eager path must do it (also for a
    mode the kernels have no code for, unless a kernel is forced: then that kernel refuses it by name).

    Inputs are those already checked by ``rules.cast_into`` (``runs``: a ``faircast_ds.casting.runs.Runs``
    of ``x.numel()`` elements, given only for a mode that draws noise; ``marks``/``mark_base``: the change
    marks, :mod:`faircast_ds.casting.marks`).
    """
    devices = {out.device, x.device} | ({residual.device} if residual is not None else set()) | \
        ({marks.device} if marks is not None else set())
    if len(devices) != 1:
        return None  # e.g. an fp32 master on CPU cast into a GPU buffer: eager cast, then copy
    backend = backend_for(x.device)
    if backend == "eager" or (rule.spec.code is None and requested_backend() == "auto"):
        return None
    if rule.spec.uses_noise and start < 0:
        raise ValueError(f"start must be non-negative, got {start}")
    key = rule.key(name, step)
    if backend == "cpp":
        from faircast_ds.casting.kernels import cpu

        return cpu.cast_into(out, x, rule.mode, key=key, start=start, residual=residual, runs=runs, marks=marks,
                             mark_base=mark_base)
    from faircast_ds.casting.kernels import triton_cast

    return triton_cast.cast_into(out, x, rule.mode, key=key, start=start, residual=residual, runs=runs, marks=marks,
                                 mark_base=mark_base)


def prepare(device: torch.device | str = "cpu") -> str:
    """Build or compile the kernel for ``device`` now (not inside the first optimizer step);
    returns the backend ``cast_into`` will use there."""
    return backend_for(torch.device(device))
