"""Tiny randomly initialised HF models for tests and examples (built in code, no downloads)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

FAMILIES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
}

TINY = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


def tiny_causal_lm(
    family: str = "qwen3",
    *,
    seed: int = 0,
    init_std: float = 0.3,
    dtype: torch.dtype = torch.bfloat16,
    attn: str = "eager",
    **overrides: Any,
) -> PreTrainedModel:
    """A tiny ``*ForCausalLM`` of ``family`` in ``dtype`` (eval mode).

    ``init_std`` is large so rounding differences show in log-probs; RMSNorm weights are drawn
    around 1 because a weight of exactly 1 makes HF's second rounding (``weight *``) exact and
    would hide it.
    """
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(**{**TINY, "initializer_range": init_std, "attn_implementation": attn, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
    return model


def token_ids(batch: int = 2, length: int = 16, vocab: int = TINY["vocab_size"], seed: int = 1) -> torch.Tensor:
    """Deterministic random token ids ``[batch, length]``."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one intra-op thread, then restore the previous count.

    Tiny tensors gain nothing from threads, and OpenMP workers spinning against other processes
    on a busy machine can make a millisecond op take a second.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
