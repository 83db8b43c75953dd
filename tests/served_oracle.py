"""The framework tests' oracle: served bits against ``cast(master, mode, seed, step)`` element by element.

The expected bits come from :func:`faircast_ds.casting.reference.cast_reference`, the slow element-by-element
statement of each cast (value comparisons in float64 and its own statement of the noise), not from the
code that serves them (``faircast_ds.shard.caster`` -> ``faircast_ds.casting.rules`` -> the fused kernels).
The masters, served bits and forward weights come from the launched scripts
(tests/dist/served_record.py), which read them through DeepSpeed's and torch's own interfaces with
the parameter names and step numbers the framework used.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from faircast_ds.casting.reference import cast_reference


def expected_bits(master: torch.Tensor, mode: str, *, seed: int, step: int, name: str) -> torch.Tensor:
    """The int16 bits the oracle serves for a whole parameter's fp32 master at ``step``."""
    return cast_reference(master.reshape(-1).float(), mode, seed=seed, step=step, name=name).view(torch.int16)


def _mismatch(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.shape != want.shape:
        return f"{name}: {tuple(got.shape)} served elements, {tuple(want.shape)} expected"
    bad = (got != want).nonzero().flatten()
    if not bad.numel():
        return None
    i = int(bad[0])
    return (f"{name}: {bad.numel()} of {got.numel()} served elements differ from the oracle, first at {i} "
            f"(served 0x{int(got[i]) & 0xFFFF:04x}, expected 0x{int(want[i]) & 0xFFFF:04x})")


def check_snapshot(snap: dict[str, Any], mode: str, seed: int, frozen: dict[str, torch.Tensor] | None = None,
                   ) -> dict[str, torch.Tensor]:
    """Assert that every trainable parameter's served bits are the oracle's cast of its master at the
    snapshot's step, and that every frozen one (no fp32 master) is served as ``frozen`` has it.
    Returns the expected bits per parameter (what a forward at the next step must multiply by)."""
    step, problems, expected = snap["step"], [], {}
    for name, served in snap["served"].items():
        master = snap["master"][name]
        if master is None:
            if frozen is None or name not in frozen:
                problems.append(f"{name}: no fp32 master and no loaded weights to compare with")
                continue
            expected[name] = frozen[name]
        else:
            expected[name] = expected_bits(master, mode, seed=seed, step=step, name=name)
        problem = _mismatch(name, served, expected[name])
        if problem:
            problems.append(problem)
    assert not problems, f"step {step}, mode {mode}, seed {seed}:\n" + "\n".join(problems)
    return expected


def rn_fraction(snap: dict[str, Any]) -> float:
    """The fraction of trainable elements whose served bits differ from torch's round-to-nearest of the
    master (the check is only telling when this is well above 0 for an unbiased mode)."""
    differ = total = 0
    for name, master in snap["master"].items():
        if master is not None:
            differ += int((snap["served"][name] != master.to(torch.bfloat16).view(torch.int16)).sum())
            total += master.numel()
    return differ / total


def check_forward(tap: dict[str, Any], expected_at: dict[int, dict[str, torch.Tensor]],
                  required: dict[str, int], steps: list[int]) -> None:
    """Assert that every forward weight the tap kept at step ``k`` (the weights served after ``k``
    optimizer steps) is ``expected_at[k]``'s bits, that each of ``steps`` was seen in each phase of
    ``required`` with at least that many layers, and that the tap noted no problem."""
    assert not tap["problems"], "\n".join(tap["problems"][:20])
    seen: dict[tuple[int, str], int] = {}
    wrong = []
    for key, bits in tap["weights"].items():
        step_s, phase, name = key.split("/", 2)
        step = int(step_s)
        assert step in expected_at, f"{key}: a forward at step {step}, which has no snapshot"
        want = expected_at[step].get(name)
        assert want is not None, f"{key}: a weight no snapshot has"
        seen[step, phase] = seen.get((step, phase), 0) + 1
        problem = _mismatch(key, bits, want)
        if problem:
            wrong.append(problem)
    assert not wrong, "forward weights are not the served ones:\n" + "\n".join(wrong[:20])
    for step in steps:
        for phase, layers in required.items():
            assert seen.get((step, phase), 0) >= layers, \
                f"step {step}, phase {phase}: {seen.get((step, phase), 0)} layers tapped, {layers} expected; {seen}"


# vLLM's fused layers in its Llama and Qwen models (stated here, not read from vLLM or faircast_ds)
VLLM_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def vllm_keyed_checksums(named_bits: dict[str, torch.Tensor]) -> dict[str, str]:
    """SHA-256 of HF-named bf16 bits (int16 tensors) under vLLM's keys, as the engine's checksum endpoint
    reports them: fused layers' parts concatenated in order; ±0 and subnormals (exponent field 0) as +0; a
    model that serves no head has the embedding's digest under ``lm_head.weight`` too (a tied head)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, bits in named_bits.items():
        path, _, attr = name.rpartition(".")
        parent, _, leaf = path.rpartition(".")
        fused = next((f for f, members in VLLM_FUSED.items() if leaf in members), None)
        parts.setdefault(name if fused is None else f"{parent}.{fused}.{attr}", {})[leaf] = bits
    out = {}
    for key, members in parts.items():
        leaf = key.rpartition(".")[0].rpartition(".")[2]
        order = VLLM_FUSED.get(leaf, tuple(members))
        bits = torch.cat([members[m].reshape(-1) for m in order]).clone()
        bits[(bits & 0x7F80) == 0] = 0
        out["dp0:pp0:pcp0:tp0:" + key] = hashlib.sha256(bits.numpy().tobytes()).hexdigest()
    embedding = "dp0:pp0:pcp0:tp0:model.embed_tokens.weight"
    if embedding in out and "lm_head.weight" not in named_bits:
        # no head served: vLLM ties one to the embedding, and the endpoint reports what its logits kernel
        # computes with under the head's name, the embedding's bits
        out["dp0:pp0:pcp0:tp0:lm_head.weight"] = out[embedding]
    return out
