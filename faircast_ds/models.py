"""Tiny randomly initialised HF causal LMs built in code (no downloads): the one model builder that
tests, the main job and the benchmarks share, plus small helpers for running them in tests."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

# the smallest model the tests use; sizes chosen not to divide by 2 or 3 where it matters
TINY = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


def _family(family: str) -> tuple[Any, Any]:
    import transformers

    families = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                "llama": ("LlamaConfig", "LlamaForCausalLM")}
    if family not in families:
        raise ValueError(f"unknown model family {family!r}; accepted: {', '.join(families)}")
    config_name, model_name = families[family]
    return getattr(transformers, config_name), getattr(transformers, model_name)


FAMILIES = ("qwen3", "qwen2", "llama")


def tiny_causal_lm(family: str = "qwen3", *, seed: int = 0, init_std: float = 0.02,
                   dtype: torch.dtype = torch.bfloat16, as_from_pretrained: bool = True, norm_jitter: float = 0.0,
                   attn: str | None = None, **config: Any) -> Any:
    """A tiny ``*ForCausalLM`` of ``family``; ``config`` overrides :data:`TINY` and any HF config key.

    ``as_from_pretrained``: build it as ``from_pretrained(dtype=dtype)`` does — parameters in ``dtype``,
    buffers (RoPE's ``inv_freq``) kept fp32, so the served copy's forward matches an engine loading
    the export; otherwise build in fp32 and cast the whole module (buffers too). ``norm_jitter`` draws
    RMSNorm weights around 1 (a weight of exactly 1 makes HF's second rounding exact and would hide it).
    ``attn`` sets the attention implementation (HF's default when None).
    """
    config_cls, model_cls = _family(family)
    settings = {**TINY, "initializer_range": init_std, **config}
    if attn is not None:
        settings["attn_implementation"] = attn
    torch.manual_seed(seed)
    if as_from_pretrained:
        model = model_cls._from_config(config_cls(**settings), dtype=dtype)
    else:
        model = model_cls(config_cls(**settings)).to(dtype)
    if norm_jitter:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.copy_(1 + norm_jitter * torch.randn_like(param))
    return model


def tiny_qwen3(seed: int = 0, std: float = 0.02, **config: Any) -> Any:
    """The tiny Qwen3 the distributed tests train: bf16 parameters, fp32 buffers, untied embeddings,
    identical on every rank."""
    return tiny_causal_lm("qwen3", seed=seed, init_std=std, max_position_embeddings=64, tie_word_embeddings=False,
                          **config)


def alignment_lm(family: str = "qwen3", *, seed: int = 0, init_std: float = 0.3,
                 dtype: torch.dtype = torch.bfloat16, attn: str = "eager", **config: Any) -> Any:
    """The tiny model the alignment tests compare engines on (eval mode): a large ``init_std`` so that
    rounding differences show in log-probs, RMSNorm weights around 1, built in fp32 and cast."""
    return tiny_causal_lm(family, seed=seed, init_std=init_std, dtype=dtype, as_from_pretrained=False,
                          norm_jitter=0.2, attn=attn, **config).eval()


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
