"""Which models alignment supports: HF Qwen3, Qwen2 and Llama from transformers 5.x."""
from __future__ import annotations

import transformers
from torch import nn
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

_FAMILIES = {"Qwen3": modeling_qwen3, "Qwen2": modeling_qwen2, "Llama": modeling_llama}


def _classes(kind: str) -> tuple[type, ...]:
    return tuple(getattr(module, f"{family}{kind}") for family, module in _FAMILIES.items())


# Exact types only: a subclass may override the forward that the aligned one stands in for.
DECODER_LAYERS = _classes("DecoderLayer")
ATTENTIONS = _classes("Attention")
MLPS = _classes("MLP")
RMS_NORMS = _classes("RMSNorm")
ROTARIES = _classes("RotaryEmbedding")
SILU_NAMES = ("silu", "swish")


class UnsupportedModelError(TypeError):
    """The model (or a part of it) is not one that alignment knows how to handle."""


def check_transformers_version() -> None:
    """The aligned forwards mirror the 5.x module structure; refuse any other major version."""
    major = int(transformers.__version__.split(".")[0])
    if major != 5:
        raise UnsupportedModelError(f"alignment supports transformers 5.x, found {transformers.__version__}")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The supported decoder layers in ``model``; :class:`UnsupportedModelError` if there are none."""
    layers = [m for m in model.modules() if type(m) in DECODER_LAYERS]
    if not layers:
        names = ", ".join(c.__name__ for c in DECODER_LAYERS)
        raise UnsupportedModelError(f"{type(model).__name__} has no supported decoder layers; supported: {names}")
    return layers


def checked(module: nn.Module, allowed: tuple[type, ...]) -> nn.Module:
    """``module`` if its exact type is in ``allowed``, else :class:`UnsupportedModelError`."""
    if type(module) not in allowed:
        names = ", ".join(c.__name__ for c in allowed)
        raise UnsupportedModelError(f"cannot align {type(module).__name__}; supported: {names}")
    return module


def check_silu(config: object) -> None:
    """SwiGLU needs a SiLU gate; :class:`UnsupportedModelError` otherwise."""
    act = getattr(config, "hidden_act", None)
    if act not in SILU_NAMES:
        raise UnsupportedModelError(f"SwiGLU alignment needs a SiLU-gated MLP, got hidden_act={act!r}")
