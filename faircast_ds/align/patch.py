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
  Qwen3's per-head q/k norms) computes ``x·rms·w`` in fp32 with one rounding. Consequence: with
  this region aligned, decoder layers return fp32 hidden states (``output_hidden_states`` shows
  them); the final norm still returns the model dtype.
"""
from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch
import transformers
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from faircast_ds.align.fused import fused_rmsnorm, fused_swiglu
from faircast_ds.align.profiles import REGIONS, Rounding, check_regions, get_profile
from faircast_ds.align.regions import rope, wide

_FAMILIES = {"Qwen3": modeling_qwen3, "Qwen2": modeling_qwen2, "Llama": modeling_llama}


def _classes(kind: str) -> tuple[type, ...]:
    return tuple(getattr(module, f"{family}{kind}") for family, module in _FAMILIES.items())


DECODER_LAYERS = _classes("DecoderLayer")
ATTENTIONS = _classes("Attention")
MLPS = _classes("MLP")
RMS_NORMS = _classes("RMSNorm")
ROTARIES = _classes("RotaryEmbedding")
SILU_NAMES = ("silu", "swish")


class UnsupportedModelError(TypeError):
    """The model (or a part of it) is not one that :func:`align_model` knows how to align."""


# --- patched forwards ------------------------------------------------------------------------


def _fp32_table_rotary_forward(self: nn.Module, x: Tensor, position_ids: Tensor, *args: Any, **kw: Any):
    # HF's forward builds cos/sin in fp32 and casts them to x.dtype at the end; it reads only
    # x.device and x.dtype, so an empty fp32 probe keeps the fp32 table for the rope region.
    probe = x.new_empty(0, dtype=torch.float32)
    return type(self).forward(self, probe, position_ids, *args, **kw)


def _attention_forward(rounding: Rounding) -> Callable[..., tuple[Tensor, Tensor | None]]:
    """HF's attention forward with RoPE rounded per ``rounding``; projections and kernel unchanged."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        has_qk_norm = hasattr(self, "q_norm")  # Qwen3 norms q and k per head, before RoPE

        query = self.q_proj(hidden_states).view(hidden_shape)
        query = (self.q_norm(query) if has_qk_norm else query).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape)
        key = (self.k_norm(key) if has_qk_norm else key).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = (t.unsqueeze(1) for t in position_embeddings)  # broadcast over heads
        query, key = rope(query, cos, sin, rounding), rope(key, cos, sin, rounding)

        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        eager = sys.modules[type(self).__module__].eager_attention_forward
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
        if hasattr(self, "sliding_window"):  # Qwen2/Qwen3 pass it; Llama does not
            kwargs["sliding_window"] = self.sliding_window
        out, weights = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights

    return forward


def _fused_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    return self.down_proj(fused_swiglu(self.gate_proj(x), self.up_proj(x)))


def _fused_norm_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
    return fused_rmsnorm(hidden_states, self.weight, self.variance_epsilon)


def _fused_residual_layer_forward(
    self: nn.Module,
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    past_key_values: Any = None,
    use_cache: bool | None = False,
    position_embeddings: tuple[Tensor, Tensor] | None = None,
    **kwargs: Any,
) -> Tensor:
    # hidden_states is the embedding (first layer) or the previous layer's fp32 sum. The engine
    # norms that fp32 sum but stores the residual rounded, so round it here before adding.
    attn_out, _ = self.self_attn(
        hidden_states=self.input_layernorm(hidden_states),
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    total = wide(hidden_states.to(attn_out.dtype)) + wide(attn_out)
    mlp_out = self.mlp(self.post_attention_layernorm(total))
    return wide(total.to(mlp_out.dtype)) + wide(mlp_out)


# --- planning and applying -------------------------------------------------------------------

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
        engine: one of ``hf``, ``vllm-cuda``, ``vllm-inductor``, ``sglang``.
        regions: any of ``rope``, ``swiglu``, ``rmsnorm``; default all three.

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
    _check_transformers_version()
    if is_aligned(model):
        raise RuntimeError(f"{type(model).__name__} is already aligned; remove() that alignment first")
    plan = _plan(model, profile.restricted_to(regions), regions)
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


def _check_transformers_version() -> None:
    major = int(transformers.__version__.split(".")[0])
    if major != 5:  # the forwards above mirror the 5.x module structure
        raise UnsupportedModelError(f"alignment supports transformers 5.x, found {transformers.__version__}")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The supported decoder layers in ``model``; :class:`UnsupportedModelError` if none."""
    layers = [m for m in model.modules() if type(m) in DECODER_LAYERS]
    if not layers:
        names = ", ".join(c.__name__ for c in DECODER_LAYERS)
        raise UnsupportedModelError(
            f"{type(model).__name__} has no supported decoder layers; alignment supports {names}"
        )
    return layers


def _plan(model: nn.Module, profile: Any, regions: tuple[str, ...]) -> list[tuple[nn.Module, Callable]]:
    """(module, forward) pairs for the regions whose rounding differs from HF eager."""
    layers = decoder_layers(model)
    plan: list[tuple[nn.Module, Callable]] = []
    for region in regions:
        if not profile.differs_from_hf(region):
            continue
        if region == "rope":
            attention = _attention_forward(profile.rope)
            plan += [(_checked(layer.self_attn, ATTENTIONS), attention) for layer in layers]
            plan += [(m, _fp32_table_rotary_forward) for m in model.modules() if type(m) in ROTARIES]
        elif region == "swiglu":
            plan += [(_checked_silu(layer.mlp), _fused_mlp_forward) for layer in layers]
        elif region == "rmsnorm":
            plan += [(layer, _fused_residual_layer_forward) for layer in layers]
            plan += [(m, _fused_norm_forward) for m in model.modules() if type(m) in RMS_NORMS]
    return plan


def _checked(module: nn.Module, allowed: tuple[type, ...]) -> nn.Module:
    if type(module) not in allowed:
        raise UnsupportedModelError(f"cannot align {type(module).__name__}; supported: {[c.__name__ for c in allowed]}")
    return module


def _checked_silu(mlp: nn.Module) -> nn.Module:
    _checked(mlp, MLPS)
    act = getattr(mlp.config, "hidden_act", None)
    if act not in SILU_NAMES:
        raise UnsupportedModelError(f"swiglu alignment needs a SiLU-gated MLP, got hidden_act={act!r}")
    return mlp
