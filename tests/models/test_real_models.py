"""The real architectures (faircast_bench.builders.real_causal_lm): shapes from the published configs, the
published parameter counts, the published init, and a depth cut that keeps vocabulary and widths.

The parameter counts are worked out here from the shapes alone (embedding, attention, MLP, norms),
not read from the model, so a wrong width, head count, bias or tie in ARCHITECTURES fails them."""
from __future__ import annotations

import pytest
import torch

from faircast_bench.builders import ARCHITECTURES, real_causal_lm, real_config


def _expected_params(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                     qkv_bias: bool, qk_norm: bool, tied: bool) -> int:
    """A decoder-only transformer's parameter count from its shapes."""
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden  # q, k, v, o projections
    if qkv_bias:
        attention += q + 2 * kv
    if qk_norm:
        attention += 2 * head_dim  # Qwen3's per-head RMSNorm of q and k
    mlp = 3 * hidden * inter  # gate, up, down
    layer = attention + mlp + 2 * hidden  # two RMSNorms
    embedding = vocab * hidden
    return embedding * (1 if tied else 2) + layers * layer + hidden  # + the final norm


QWEN3_06B = dict(vocab=151_936, hidden=1024, inter=3072, heads=16, kv_heads=8, head_dim=128, qkv_bias=False,
                 qk_norm=True, tied=True)
QWEN25_05B = dict(vocab=151_936, hidden=896, inter=4864, heads=14, kv_heads=2, head_dim=64, qkv_bias=True,
                  qk_norm=False, tied=True)


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight is one parameter


@pytest.mark.parametrize("name, shape, layers, published", [
    ("qwen3-0.6b", QWEN3_06B, 28, 596e6), ("qwen2.5-0.5b", QWEN25_05B, 24, 494e6)])
def test_published_parameter_counts(name, shape, layers, published):
    model = real_causal_lm(name, device="meta")
    expected = _expected_params(layers=layers, **shape)
    assert _count(model) == expected
    assert round(expected / 1e6) == published / 1e6  # the model cards' figure
    assert ARCHITECTURES[name].published_params == f"{round(published / 1e6)}M"
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one 151,936-row embedding


@pytest.mark.parametrize("name, shape", [("qwen3-0.6b", QWEN3_06B), ("qwen2.5-0.5b", QWEN25_05B)])
def test_layers_cut_the_depth_and_keep_the_widths(name, shape):
    model = real_causal_lm(name, layers=2, device="meta")
    assert _count(model) == _expected_params(layers=2, **shape)
    assert tuple(model.model.embed_tokens.weight.shape) == (shape["vocab"], shape["hidden"])
    assert len(model.model.layers) == 2
    with pytest.raises(ValueError, match="layers must be in 1..28"):
        real_config("qwen3-0.6b", layers=29)
    with pytest.raises(ValueError, match="unknown model 'qwen3-7b'"):
        real_config("qwen3-7b")


def test_qwen3_2_layers_is_the_ci_size():
    assert _expected_params(layers=2, **QWEN3_06B) == 187_045_376  # the "187M" of the CI-sized run


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen2.5-0.5b"])
def test_published_init_and_dtypes(name):
    model = real_causal_lm(name, layers=1, seed=3)
    std = ARCHITECTURES[name].config["initializer_range"]
    assert std == 0.02
    for pname, p in model.named_parameters():
        assert p.dtype == torch.bfloat16, pname
        values = p.detach().float()
        if "norm" in pname:
            assert torch.equal(values, torch.ones_like(values)), pname
        elif pname.endswith("bias"):
            assert torch.equal(values, torch.zeros_like(values)), pname
        else:  # 1M+ draws each: the sample std is within 1% of the published one
            assert abs(values.std().item() / std - 1) < 0.01, (pname, values.std().item())
            assert abs(values.mean().item()) < 1e-3 * std * 10, pname
    for bname, b in model.named_buffers():
        assert b.dtype == torch.float32, bname  # RoPE's inv_freq, as from_pretrained keeps it
    again = real_causal_lm(name, layers=1, seed=3)
    other = real_causal_lm(name, layers=1, seed=4)
    pairs = list(zip(model.parameters(), again.parameters(), other.parameters()))
    assert all(torch.equal(a, b) for a, b, _ in pairs)  # a function of (seed, name): reproducible
    assert not torch.equal(pairs[0][0], pairs[0][2])  # and the seed matters
