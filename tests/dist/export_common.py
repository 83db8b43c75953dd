"""Helpers shared by the export test processes (trainer worker, receiver, sender, writer)."""
from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any, Iterable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PROMPT = [[5, 17, 42, 8, 99, 3]]
NEW_TOKENS = 8


def plain_model(seed: int = 0, intermediate: int = 64) -> torch.nn.Module:
    """A small bf16 MLP with 14 parameters, for the processes that need no transformers (which takes
    seconds to import)."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Embedding(101, 32)]
    for _ in range(3):
        layers += [torch.nn.LayerNorm(32), torch.nn.Linear(32, intermediate, bias=False),
                   torch.nn.Linear(intermediate, 32, bias=False)]
    layers += [torch.nn.Linear(32, 101, bias=False)]
    return torch.nn.Sequential(*layers).to(torch.bfloat16)


def digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over names and bit patterns."""
    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def bits_digest(bits: dict[str, torch.Tensor]) -> str:
    """The same digest from `common.full_served_bits` (int64 bf16 bit patterns)."""
    from faircast_ds.casting.bits import bf16_from_bits

    return digest((n, bf16_from_bits(b)) for n, b in bits.items())


@torch.no_grad()
def greedy(model: torch.nn.Module) -> list[int]:
    out = model.generate(torch.tensor(PROMPT), do_sample=False, max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, pad_token_id=0)
    return out[0, len(PROMPT[0]):].tolist()


def append_jsonl(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
