"""HF names and vLLM names of fused layers: the one place that maps between them.

vLLM fuses some Hugging Face projections into one layer (``packed_modules_mapping`` of its Llama, Qwen2
and Qwen3 models): ``qkv_proj`` is ``q_proj``, ``k_proj`` and ``v_proj`` concatenated along the output
dimension, ``gate_up_proj`` is ``gate_proj`` and ``up_proj``. A fused layer is rebuilt from all of its
parts together, so every push sends whole groups (:func:`packed_groups`); the checksums of both ends
name a fused layer by its vLLM name (:func:`vllm_name`); the engine finds an HF tensor's module
through the mapping (:func:`part_of`). Each function takes the mapping an engine reports
(``model.packed_modules_mapping``) or, where no engine is at hand (the trainer side), :data:`FUSED`.
"""
from __future__ import annotations

from typing import Mapping, Sequence

# how vLLM fuses HF projections (its models' packed_modules_mapping for Llama/Qwen2/Qwen3), restated here
FUSED: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

Packed = Mapping[str, Sequence[str]]


def split(name: str) -> tuple[str, str, str]:
    """``model.layers.0.self_attn.q_proj.weight`` -> (``model.layers.0.self_attn``, ``q_proj``, ``weight``)."""
    path, _, attr = name.rpartition(".")
    parent, _, leaf = path.rpartition(".")
    return parent, leaf, attr


def join(parent: str, leaf: str, attr: str) -> str:
    return f"{parent}.{leaf}.{attr}" if parent else f"{leaf}.{attr}"


def part_of(name: str, packed: Packed = FUSED) -> tuple[str, int] | None:
    """(the fused layer's leaf name, the index of ``name``'s part in it) for an HF tensor that vLLM
    fuses, else None: ``...q_proj.weight`` -> (``qkv_proj``, 0)."""
    leaf = split(name)[1]
    for fused, parts in packed.items():
        if leaf in parts:
            return fused, list(parts).index(leaf)
    return None


def vllm_name(name: str, packed: Packed = FUSED) -> str:
    """The vLLM name of the tensor that holds HF tensor ``name``: ``...q_proj.weight`` ->
    ``...qkv_proj.weight``; a tensor vLLM does not fuse keeps its name."""
    found = part_of(name, packed)
    if found is None:
        return name
    parent, _, attr = split(name)
    return join(parent, found[0], attr)


def packed_groups(names: Sequence[str], packed: Packed = FUSED) -> dict[str, tuple[str, ...]]:
    """For each HF tensor name, the names that one vLLM layer is rebuilt from together (itself alone,
    or e.g. ``q_proj``/``k_proj``/``v_proj`` for ``qkv_proj``), as far as they exist in ``names``."""
    present = set(names)
    groups: dict[str, tuple[str, ...]] = {}
    for name in names:
        found = part_of(name, packed)
        if found is None:
            groups[name] = (name,)
            continue
        parent, _, attr = split(name)
        members = (join(parent, p, attr) for p in packed[found[0]])
        groups[name] = tuple(m for m in members if m in present)
    return groups
