"""Reference forward of a whole HF Qwen3 / Qwen2 / Llama causal LM under an engine profile.

Written from scratch as plain torch on the model's parameters, in the engines' dataflow
(``hidden, residual = add_rmsnorm(...)`` between blocks). The three regions come from
``regions.py`` with the profile's rounding; everything else (embedding, projections, the causal
mask, logits) performs the same ops as transformers' eager path, so with the ``hf``
profile this reproduces the HF model bit for bit. It does not touch the model's modules, so it
is a check on :func:`align_model`, not a second copy of it.

Scope: no padding, positions ``0..T-1``, full (non-sliding) causal attention, static RoPE types,
no attention dropout. Parameters must be materialised (gather them first under ZeRO-3).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from faircast_ds.align.families import SILU_NAMES, UnsupportedModelError, decoder_layers
from faircast_ds.align.profiles import REGIONS, EngineProfile, get_profile
from faircast_ds.align.regions import add_rmsnorm, attention, rmsnorm, rope, swiglu

_DYNAMIC_ROPE = ("dynamic", "longrope")


def reference_logits(
    model: nn.Module, input_ids: Tensor, engine: str = "hf", regions: Sequence[str] = REGIONS
) -> Tensor:
    """Logits ``[B, T, V]`` (model dtype) of ``model`` on ``input_ids`` ``[B, T]`` under ``engine``.

    Regions not in ``regions`` keep HF eager rounding, which gives the reference for a trainer
    aligned on a subset of regions.
    """
    profile = get_profile(engine).restricted_to(regions)
    base = _base_model(model)
    _check_scope(base)
    length = input_ids.shape[1]
    positions = torch.arange(length, device=input_ids.device)[None]
    cos, sin = _rope_table(base.rotary_emb, positions)
    mask = _causal_mask(length, base.embed_tokens.weight.dtype, input_ids.device)

    hidden, residual = F.embedding(input_ids, base.embed_tokens.weight), None
    for layer in base.layers:
        x, residual = _norm(layer.input_layernorm, hidden, residual, profile)
        x = _attention(layer.self_attn, x, cos, sin, mask, profile)
        x, residual = _norm(layer.post_attention_layernorm, x, residual, profile)
        hidden = _mlp(layer.mlp, x, profile)
    x, _ = _norm(base.norm, hidden, residual, profile)
    return F.linear(x, model.lm_head.weight)


def _base_model(model: nn.Module) -> nn.Module:
    if not hasattr(model, "lm_head") or not hasattr(model, "model"):
        raise UnsupportedModelError(f"reference_logits needs a *ForCausalLM model, got {type(model).__name__}")
    decoder_layers(model)  # raises for unsupported families
    return model.model


def _check_scope(base: nn.Module) -> None:
    config = base.config
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        raise UnsupportedModelError("reference_logits supports full causal attention only (no sliding window)")
    if any(kind in str(base.rotary_emb.rope_type) for kind in _DYNAMIC_ROPE):
        raise UnsupportedModelError(f"reference_logits supports static RoPE only, got {base.rotary_emb.rope_type!r}")
    if getattr(config, "hidden_act", None) not in SILU_NAMES:
        raise UnsupportedModelError(f"reference_logits needs a SiLU-gated MLP, got {config.hidden_act!r}")
    if getattr(config, "attention_dropout", 0.0) and base.training:
        raise UnsupportedModelError("reference_logits has no attention dropout; call model.eval() first")


def _rope_table(rotary: nn.Module, positions: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 cos/sin ``[1, T, D]``, computed as HF's rotary module does before its final cast."""
    angles = positions[..., None].float() * rotary.inv_freq.float()
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos() * rotary.attention_scaling, angles.sin() * rotary.attention_scaling


def _causal_mask(length: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive mask: 0 where a query may attend, the dtype's lowest value elsewhere."""
    allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)


def _norm(norm: nn.Module, x: Tensor, residual: Tensor | None, profile: EngineProfile) -> tuple[Tensor, Tensor]:
    return add_rmsnorm(x, residual, norm.weight, norm.variance_epsilon, profile.rmsnorm)


def _linear(proj: nn.Linear, x: Tensor) -> Tensor:
    return F.linear(x, proj.weight, proj.bias)


def _attention(attn: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, profile: EngineProfile) -> Tensor:
    batch, length, _ = x.shape
    heads = (batch, length, -1, attn.head_dim)
    query, key = _linear(attn.q_proj, x).view(heads), _linear(attn.k_proj, x).view(heads)
    if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm on q and k, before RoPE
        query = rmsnorm(query, attn.q_norm.weight, attn.q_norm.variance_epsilon, profile.rmsnorm)
        key = rmsnorm(key, attn.k_norm.weight, attn.k_norm.variance_epsilon, profile.rmsnorm)
    value = _linear(attn.v_proj, x).view(heads).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    query = rope(query.transpose(1, 2), cos, sin, profile.rope)
    key = rope(key.transpose(1, 2), cos, sin, profile.rope)

    # HF eager (bf16 scores, fp32 softmax rounded back, bf16 PV) or the profile's fused kernel
    groups = attn.num_key_value_groups
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = attention(query, key, value, mask, attn.scaling, profile.attention).transpose(1, 2).contiguous()
    return _linear(attn.o_proj, out.reshape(batch, length, -1).contiguous())


def _mlp(mlp: nn.Module, x: Tensor, profile: EngineProfile) -> Tensor:
    return _linear(mlp.down_proj, swiglu(_linear(mlp.gate_proj, x), _linear(mlp.up_proj, x), profile.swiglu))
