"""Aligning whole HF models: bitwise agreement with the reference, gradients, reversibility, errors."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.qwen3 import modeling_qwen3

from faircast_ds.align import (
    ENGINES,
    REGIONS,
    AlignRoundingConfig,
    UnsupportedModelError,
    align_model,
    apply_from_config,
    reference_logits,
)
from faircast_ds.align.meter import token_logprobs
from faircast_ds.align.patch import is_aligned
from faircast_bench.builders import alignment_lm, single_thread, token_ids

FAMILIES = ("qwen3", "qwen2", "llama")
NON_HF = ("vllm-cuda", "vllm-inductor", "sglang")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def loss(model_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return -token_logprobs(model_logits, ids).mean()


def instance_forwards(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


# --- forward: bit for bit -------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_reference_reproduces_transformers_eager_bitwise(family):
    model, ids = alignment_lm(family), token_ids()
    assert torch.equal(reference_logits(model, ids, "hf"), logits(model, ids))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("engine", ENGINES)
def test_aligned_trainer_logprobs_equal_engine_reference_bitwise(family, engine):
    model, ids = alignment_lm(family), token_ids()
    expected = reference_logits(model, ids, engine)
    with align_model(model, engine):
        got = logits(model, ids)
    assert torch.equal(got, expected)
    assert torch.equal(token_logprobs(got, ids), token_logprobs(expected, ids))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("engine", NON_HF)
@pytest.mark.parametrize("region", REGIONS)
def test_each_region_aligned_alone_equals_its_reference_bitwise(family, engine, region):
    model, ids = alignment_lm(family), token_ids()
    with align_model(model, engine, [region]):
        got = logits(model, ids)
    assert torch.equal(got, reference_logits(model, ids, engine, [region]))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("engine", NON_HF)
def test_unaligned_trainer_differs_measurably_from_the_engine(family, engine):
    model, ids = alignment_lm(family), token_ids()
    gap = token_logprobs(logits(model, ids), ids) - token_logprobs(reference_logits(model, ids, engine), ids)
    assert gap.pow(2).mean().sqrt() > 3e-3  # measured 0.02–0.05 on these tiny models


# --- backward -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("engine", NON_HF)
def test_aligned_gradients_match_reference_autograd(family, engine):
    model, ids = alignment_lm(family), token_ids()
    params = list(model.parameters())
    with align_model(model, engine):
        aligned = torch.autograd.grad(loss(model(input_ids=ids).logits, ids), params)
    reference = torch.autograd.grad(loss(reference_logits(model, ids, engine), ids), params)
    hf = torch.autograd.grad(loss(model(input_ids=ids).logits, ids), params)
    # Tolerance: relative L2 error 1e-3 per tensor, room for a rare 1-ulp bf16 flip where the
    # fused norm's backward orders its fp32 math differently from autograd (today: bitwise equal).
    for a, r in zip(aligned, reference, strict=True):
        assert (a.float() - r.float()).norm() <= 1e-3 * r.float().norm()
    # The check has teeth: HF eager's gradients are further from the reference than that.
    hf_error = max((h.float() - r.float()).norm() / r.float().norm() for h, r in zip(hf, reference, strict=True))
    assert hf_error > 1e-3


def test_aligned_gradient_agrees_with_finite_differences_in_fp64():
    # In fp64 nothing rounds, so this checks the fused backward formulas and the patched
    # dataflow against the loss itself. HF eager's softmax stays fp32, hence eps=1e-3 along the
    # gradient direction (largest signal) and rtol 1e-3 (measured 4e-5).
    model, ids = alignment_lm("qwen3", dtype=torch.float64), token_ids()
    params = list(model.parameters())
    with align_model(model, "sglang"):
        grads = torch.autograd.grad(loss(model(input_ids=ids).logits, ids), params)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        direction = [g / norm for g in grads]
        eps = 1e-3
        with torch.no_grad():
            for p, d in zip(params, direction, strict=True):
                p.add_(eps * d)
            plus = loss(model(input_ids=ids).logits, ids)
            for p, d in zip(params, direction, strict=True):
                p.sub_(2 * eps * d)
            minus = loss(model(input_ids=ids).logits, ids)
    finite_difference = (plus - minus) / (2 * eps)
    assert torch.isclose(finite_difference, norm, rtol=1e-3)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_recomputes_the_aligned_forward(use_reentrant):
    model, ids = alignment_lm("qwen3"), token_ids()
    model.train()  # checkpointing is active in training mode only
    params = list(model.parameters())

    def grads() -> list[torch.Tensor]:  # .backward(): reentrant checkpointing refuses autograd.grad
        model.zero_grad(set_to_none=True)
        loss(model(input_ids=ids).logits, ids).backward()
        return [p.grad.clone() for p in params]

    with align_model(model, "sglang"):
        plain = grads()
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.20's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        checkpointed = grads()
    for a, b in zip(plain, checkpointed, strict=True):
        assert torch.equal(a, b)


# --- reversibility and isolation ------------------------------------------------------------


def test_remove_restores_hf_eager_bits_and_leaves_parameters_alone():
    model, ids = alignment_lm("qwen3"), token_ids()
    before = logits(model, ids)
    storage = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
    handle = align_model(model, "sglang")
    assert handle.active and is_aligned(model) and instance_forwards(model)
    assert not torch.equal(logits(model, ids), before)
    handle.remove()
    assert torch.equal(logits(model, ids), before)
    assert instance_forwards(model) == [] and not handle.active and not is_aligned(model)
    handle.remove()  # idempotent
    for name, p in model.named_parameters():
        assert p.data_ptr() == storage[name][0] and torch.equal(p, storage[name][1])


def test_patches_are_per_instance_not_per_class():
    aligned, other, ids = alignment_lm("qwen3"), alignment_lm("qwen3"), token_ids()
    class_forward = modeling_qwen3.Qwen3MLP.forward
    other_before = logits(other, ids)
    with align_model(aligned, "sglang"):
        assert torch.equal(logits(other, ids), other_before)
        assert modeling_qwen3.Qwen3MLP.forward is class_forward
        assert instance_forwards(other) == []


def test_engine_that_rounds_like_hf_in_a_region_leaves_it_unpatched():
    model = alignment_lm("qwen3")
    with align_model(model, "vllm-cuda") as handle:
        assert handle.patched_regions == ("rope",)
        patched = set(instance_forwards(model))
    assert patched == {"model.rotary_emb", "model.layers.0.self_attn", "model.layers.1.self_attn"}


def test_apply_from_config_takes_the_model_or_its_raw_dict():
    model, ids = alignment_lm("llama"), token_ids()
    expected = reference_logits(model, ids, "vllm-inductor", ["swiglu", "rmsnorm"])
    for cfg in (
        {"engine": "vllm-inductor", "regions": ["swiglu", "rmsnorm"]},
        AlignRoundingConfig(engine="vllm-inductor", regions=["swiglu", "rmsnorm"]),
    ):
        with apply_from_config(model, cfg) as handle:
            assert handle.regions == ("swiglu", "rmsnorm")
            assert torch.equal(logits(model, ids), expected)


# --- errors ---------------------------------------------------------------------------------


def test_unknown_engine_or_region_is_a_clear_error():
    model = alignment_lm("qwen3")
    with pytest.raises(ValueError, match="unknown engine 'tensorrt'"):
        align_model(model, "tensorrt")
    with pytest.raises(ValueError, match=r"unknown region\(s\) \['softmax'\]"):
        align_model(model, "sglang", ["rope", "softmax"])
    assert instance_forwards(model) == []


def test_unsupported_model_class_is_a_clear_error():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel has no supported decoder layers"):
        align_model(gpt2, "sglang")
    with pytest.raises(UnsupportedModelError):
        reference_logits(gpt2, token_ids(vocab=50), "sglang")
    with pytest.raises(UnsupportedModelError, match="ForCausalLM"):
        reference_logits(alignment_lm("qwen3").model, token_ids(), "sglang")


def test_non_silu_mlp_is_refused_for_swiglu_only():
    model = alignment_lm("llama", hidden_act="gelu")
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'"):
        align_model(model, "sglang", ["swiglu"])
    assert instance_forwards(model) == []
    with align_model(model, "sglang", ["rope", "rmsnorm"]):
        pass


def test_aligning_twice_or_over_a_foreign_patch_is_refused():
    model = alignment_lm("qwen3")
    with align_model(model, "sglang"), pytest.raises(RuntimeError, match="already aligned"):
        align_model(model, "vllm-cuda")
    mlp = model.model.layers[0].mlp
    mlp.forward = lambda x: x  # someone else's instance patch
    with pytest.raises(RuntimeError, match="instance-level forward"):
        align_model(model, "sglang")
    assert instance_forwards(model) == ["model.layers.0.mlp"]  # nothing of ours was applied
