"""Aligned ``forward`` methods, installed per instance by ``patch.py``.

Each calls the module's own submodules (so ZeRO-3 gathers their parameters as usual) and differs
from HF eager only in where it rounds.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from faircast_ds.align.fused import fused_rmsnorm, fused_swiglu
from faircast_ds.align.profiles import Rounding
from faircast_ds.align.regions import attention as attention_region
from faircast_ds.align.regions import rmsnorm_two_roundings, rope, wide


def fp32_table_rotary_forward(self: nn.Module, x: Tensor, position_ids: Tensor, *args: Any, **kw: Any):
    """Rotary module: return the fp32 cos/sin table, leaving its rounding to the rope region."""
    # HF's forward builds cos/sin in fp32 and casts them to x.dtype at the end; it reads only
    # x.device and x.dtype, so an empty fp32 probe stands in for x.
    probe = x.new_empty(0, dtype=torch.float32)
    return type(self).forward(self, probe, position_ids, *args, **kw)


def attention_forward(rounding: Rounding, kernel: Rounding | None = None) -> Callable[..., tuple[Tensor, Tensor | None]]:
    """Attention: HF's forward with RoPE rounded per ``rounding``; projections unchanged. The attention
    kernel is HF's (whatever ``attn_implementation`` says) unless ``kernel`` is a fused rounding: then
    scores, softmax and ``P·V`` are computed in fp32 and rounded once (``regions.attention``)."""

    def forward(
        self: nn.Module,
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor],
        attention_mask: Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
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
        if kernel is not None and kernel.fused:
            out = _fused_attention(self, query, key, value, attention_mask, kernel)
            return self.o_proj(out.reshape(*input_shape, -1).contiguous()), None
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


def _fused_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None,
                     kernel: Rounding) -> Tensor:
    """fp32 attention of ``[B, H, T, D]`` heads, GQA expanded as HF's eager path does; ``[B, T, H, D]`` out."""
    if module.training and module.attention_dropout:
        raise NotImplementedError("fp32 attention alignment has no attention dropout; set attention_dropout=0")
    groups = module.num_key_value_groups
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if mask is not None:
        mask = mask[:, :, :, : key.shape[-2]]
    return attention_region(query, key, value, mask, module.scaling, kernel).transpose(1, 2).contiguous()


def fused_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    """MLP: fp32 ``silu(gate)·up``, one rounding."""
    return self.down_proj(fused_swiglu(self.gate_proj(x), self.up_proj(x)))


def fused_norm_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
    """RMSNorm: fp32 ``x·rms·w``, one rounding; accepts the fp32 residual sum."""
    return fused_rmsnorm(hidden_states, self.weight, self.variance_epsilon)


def wide_input_norm_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
    """RMSNorm rounding as HF's (``x·rms`` rounded, ``·w`` rounded), also for the fp32 residual sum."""
    return rmsnorm_two_roundings(hidden_states, self.weight, self.variance_epsilon)


def fused_residual_layer_forward(
    self: nn.Module,
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    past_key_values: Any = None,
    use_cache: bool | None = False,
    position_embeddings: tuple[Tensor, Tensor] | None = None,
    **kwargs: Any,
) -> Tensor:
    """Decoder layer: norms see fp32 residual sums; the residual is kept rounded; returns fp32."""
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
    total = wide(hidden_states.to(attn_out.dtype)) + attn_out  # fp32 add, attn_out promoted exactly
    mlp_out = self.mlp(self.post_attention_layernorm(total))
    return wide(total.to(mlp_out.dtype)) + mlp_out
