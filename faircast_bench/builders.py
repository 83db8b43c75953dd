"""Randomly initialised HF causal LMs built in code (no downloads): the one model builder that tests,
the main job and the benchmarks share (tiny ones, and real architectures from their published
configs: :func:`real_causal_lm`), plus small helpers for running them in tests."""
from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from faircast_ds.models.pretrained import Partitioning

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


@dataclass(frozen=True)
class Architecture:
    """A published model's shape: its HF family and config (the fields that set the parameters), and
    the parameter count its model card states."""

    family: str
    config: dict[str, Any] = field(hash=False)
    published_params: str

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])


# From the models' published config.json files (Qwen/Qwen3-0.6B, Qwen/Qwen2.5-0.5B); the fields that do
# not change a parameter's shape or initial value (RoPE, max positions, norm epsilon) are kept too, so
# that an export loads in an engine as the real model's architecture would.
ARCHITECTURES: dict[str, Architecture] = {
    "qwen3-0.6b": Architecture("qwen3", dict(
        vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=40_960, rope_theta=1_000_000.0, rms_norm_eps=1e-6, initializer_range=0.02,
        attention_bias=False, hidden_act="silu"), "596M"),
    "qwen2.5-0.5b": Architecture("qwen2", dict(
        vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
        max_position_embeddings=32_768, rope_theta=1_000_000.0, rms_norm_eps=1e-6, initializer_range=0.02,
        hidden_act="silu"), "494M"),
}


def architecture(name: str) -> Architecture:
    """The :data:`ARCHITECTURES` entry ``name``, or a ValueError naming the accepted ones."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown model {name!r}; accepted: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def real_config(name: str, *, layers: int | None = None) -> Any:
    """The HF config of architecture ``name``; ``layers`` cuts the depth (vocabulary and widths stay)."""
    arch = architecture(name)
    settings = dict(arch.config)
    if layers is not None:
        if not 1 <= layers <= arch.layers:
            raise ValueError(f"{name} has {arch.layers} layers; --layers must be in 1..{arch.layers}, got {layers}")
        settings["num_hidden_layers"] = layers
    config_cls, _ = _family(arch.family)
    return config_cls(**settings)


def real_causal_lm(name: str, *, layers: int | None = None, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                   partitioning: Partitioning | None = None, device: str | torch.device | None = None) -> Any:
    """A randomly initialised ``*ForCausalLM`` of the published architecture ``name`` (see
    :data:`ARCHITECTURES`), at the published init: every linear and embedding weight normal with
    std ``initializer_range`` (0.02), biases zero, RMSNorm weights one — HF's own ``_init_weights`` rule.

    ``partitioning``: build the model partitioned from the start, as users build large models (each rank
    holds only its partition; ZeRO-3: ``faircast_bench.zero_init.real_causal_lm``), each weight
    initialised while whole, one at a time. The values depend only on
    ``(seed, parameter name)``, drawn in fp32 and rounded to ``dtype``: the same model under ZeRO-3,
    ZeRO-2 or no DeepSpeed at all. Parameters are in ``dtype``, buffers (RoPE's ``inv_freq``) stay fp32,
    as ``from_pretrained(dtype=dtype)`` builds it. ``device="meta"`` builds shapes only (for counting).
    """
    config = real_config(name, layers=layers)
    _, model_cls = _family(architecture(name).family)
    if partitioning is not None and device is not None:
        raise ValueError("real_causal_lm: give partitioning or device, not both")
    if partitioning is not None:
        building = partitioning.building(dtype)
    else:
        building = torch.device(device) if device is not None else contextlib.nullcontext()
    with building, _no_init():  # HF's own init would draw every weight once more, only to be overwritten
        model = model_cls._from_config(config, dtype=dtype)
        model.tie_weights()  # HF ties inside its weight init, which no_init_weights skips
    if device is not None and torch.device(device).type == "meta":
        return model
    _initialise(model, config.initializer_range, seed, partitioning)
    return model


def _no_init() -> Any:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def _initial_values(name: str, shape: torch.Size, std: float, seed: int) -> torch.Tensor:
    """One parameter's initial fp32 values, a function of (seed, name) only."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name:
        return torch.ones(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    # the CPU generator keeps 32 bits of its seed (Mersenne Twister): hash (seed, name) into them
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:4], "little"))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def _initialise(model: torch.nn.Module, std: float, seed: int, partitioning: Partitioning | None) -> None:
    """Overwrite every parameter with its :func:`_initial_values` (partitioned: made whole one at a time;
    every rank computes the same values)."""
    for name, param in model.named_parameters():  # a tied weight is listed once, under its first name
        if partitioning is not None:
            with partitioning.modifying(param):
                param.data.copy_(_initial_values(name, param.shape, std, seed))
        else:
            param.copy_(_initial_values(name, param.shape, std, seed))


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
