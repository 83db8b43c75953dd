"""Align HF Qwen3 / Qwen2 / Llama modules to an engine profile, region by region, reversibly.

Only module *instances* are patched (an instance attribute ``forward`` shadows the class method),
and only the forward computation changes: parameters are read as usual inside each module's own
forward, so ZeRO-3's gather hooks and gradient checkpointing see the same modules being called.

Per region, for a profile whose rounding differs from HF eager:

- ``rope``: the model's rotary module returns its fp32 cos/sin table (HF casts it to bf16) and
  each attention module applies RoPE with the profile's rounding; attention itself is HF's.
- ``swiglu``: each MLP computes ``silu(gate)·up`` in fp32 with one rounding.
- ``rmsnorm``: each decoder layer hands the *fp32* residual sum to the next norm, as the engines'
  fused add+norm kernels do, and keeps the residual itself in bf16; every RMSNorm (including
  Qwen3's per-head q/k norms) computes ``x·rms·w`` in fp32 with one rounding (or, for a profile
  that rounds inside the norm like HF, HF's two roundings applied to the fp32 sum). Consequence:
  with this region aligned, decoder layers return fp32 hidden states (``output_hidden_states``
  shows them); the final norm still returns the model dtype.
- ``attention``: each attention module computes scores, softmax and ``P·V`` in fp32 and rounds
  its output once, instead of calling the configured attention kernel.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

from torch import nn

from faircast_ds.align import forwards
from faircast_ds.align.families import (
    ATTENTIONS,
    MLPS,
    RMS_NORMS,
    ROTARIES,
    check_silu,
    check_transformers_version,
    checked,
    decoder_layers,
)
from faircast_ds.align.profiles import (
    HF,
    REGIONS,
    EngineProfile,
    check_regions,
    get_profile,
)

_ACTIVE: weakref.WeakKeyDictionary[nn.Module, AlignmentHandle] = weakref.WeakKeyDictionary()


@dataclass
class AlignmentHandle:
    """An applied alignment. ``remove()`` (or leaving a ``with`` block) restores HF eager exactly.

    Attributes:
        engine: the profile aligned to.
        regions: the regions requested.
        patched_regions: those whose rounding differs from HF eager, hence actually patched
            (e.g. ``swiglu`` and ``rmsnorm`` are no-ops for ``vllm-cuda``).
    """

    engine: str
    regions: tuple[str, ...]
    patched_regions: tuple[str, ...]
    _patches: list[tuple[nn.Module, MethodType]] = field(default_factory=list, repr=False)
    _model: Any = field(default=None, repr=False)

    @property
    def active(self) -> bool:
        """True until :meth:`remove` is called."""
        return self._model is not None

    def remove(self) -> None:
        """Drop every instance-level forward this alignment installed. Idempotent."""
        for module, method in self._patches:
            if module.__dict__.get("forward") is method:
                del module.__dict__["forward"]
        self._patches = []
        model = self._model() if self._model is not None else None
        if model is not None and _ACTIVE.get(model) is self:
            del _ACTIVE[model]
        self._model = None

    def __enter__(self) -> AlignmentHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def is_aligned(model: nn.Module) -> bool:
    """True when ``model`` or one of its submodules carries an active alignment."""
    return any(m in _ACTIVE for m in model.modules())


def align_model(model: nn.Module, engine: str, regions: Sequence[str] = REGIONS) -> AlignmentHandle:
    """Make ``model``'s forward round where ``engine`` rounds, in ``regions``.

    Args:
        model: an HF Qwen3, Qwen2 or Llama model (``*ForCausalLM``, the base model, or anything
            holding their decoder layers), from transformers 5.x.
        engine: one of ``hf``, ``vllm-cuda``, ``vllm-inductor``, ``sglang``, ``vllm-cpu``.
        regions: any of ``rope``, ``swiglu``, ``rmsnorm``, ``attention``; default all four.

    Returns:
        An :class:`AlignmentHandle`; call ``remove()`` to restore HF eager.

    Raises:
        ValueError: unknown engine or region.
        UnsupportedModelError: no supported decoder layers, an unsupported part (e.g. a non-SiLU
            MLP), or an unknown transformers major version.
        RuntimeError: the model is already aligned, or a module to patch already has an
            instance-level forward installed by something else.
    """
    profile = get_profile(engine)
    regions = check_regions(regions)
    check_transformers_version()
    if is_aligned(model):
        raise RuntimeError(f"{type(model).__name__} is already aligned; remove() that alignment first")
    plan = _plan(model, profile, regions)
    for module, _ in plan:
        if "forward" in module.__dict__:
            raise RuntimeError(
                f"{type(module).__name__} already has an instance-level forward (another patch?); "
                "refusing to overwrite it"
            )
    patches = [(module, MethodType(fn, module)) for module, fn in plan]
    for module, method in patches:
        module.forward = method
    patched = tuple(r for r in regions if profile.differs_from_hf(r))
    handle = AlignmentHandle(engine, regions, patched, patches, weakref.ref(model))
    _ACTIVE[model] = handle
    return handle


def _plan(model: nn.Module, profile: EngineProfile, regions: tuple[str, ...]) -> list[tuple[nn.Module, Callable]]:
    """(module, forward) pairs for the regions whose rounding differs from HF eager."""
    layers = decoder_layers(model)
    plan: list[tuple[nn.Module, Callable]] = []
    differs = {r for r in regions if profile.differs_from_hf(r)}
    if differs & {"rope", "attention"}:  # one attention forward carries both
        rope_rounding = profile.rope if "rope" in differs else HF.rope
        kernel = profile.attention if "attention" in differs else None
        attention = forwards.attention_forward(rope_rounding, kernel)
        plan += [(checked(layer.self_attn, ATTENTIONS), attention) for layer in layers]
    for region in regions:
        if region not in differs:
            continue
        if region == "rope":
            plan += [(m, forwards.fp32_table_rotary_forward) for m in model.modules() if type(m) in ROTARIES]
        elif region == "swiglu":
            for layer in layers:
                check_silu(checked(layer.mlp, MLPS).config)
                plan.append((layer.mlp, forwards.fused_mlp_forward))
        elif region == "rmsnorm":
            if profile.rmsnorm.fp32_sum:
                plan += [(layer, forwards.fused_residual_layer_forward) for layer in layers]
            norm = forwards.fused_norm_forward if profile.rmsnorm.fused else forwards.wide_input_norm_forward
            plan += [(m, norm) for m in model.modules() if type(m) in RMS_NORMS]
    return plan
