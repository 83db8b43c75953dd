"""The RL task of the GRPO job: generated in code, with a verifiable reward.

A prompt is a few random token ids; a completion is ``gen_len`` sampled tokens; the reward is the
share of completion tokens whose id is below ``vocab // 4`` (a random policy scores about 0.25).
Everything random is drawn from a generator keyed by (seed, step, rank), so every cast mode sees the
same prompts and the same sampling noise: rollouts are drawn by inverse CDF from shared uniforms
(common random numbers), so two policies that agree sample the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LowTokenTask:
    """Prompts, sampling noise and the reward of the "say low token ids" task."""

    vocab: int
    prompt_len: int = 4
    gen_len: int = 8
    group: int = 8  # completions per prompt (the GRPO group)
    # prompt tokens are drawn from ids [0, prompt_vocab) (0: the whole vocabulary). A small prompt
    # vocabulary makes the contexts alike, so every rollout pushes the weights the same way and the
    # reward moves more per unit of weight change
    prompt_vocab: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.prompt_vocab <= self.vocab:
            raise ValueError(f"prompt_vocab must be in [0, vocab={self.vocab}], got {self.prompt_vocab}")

    def generator(self, seed: int, step: int, rank: int) -> torch.Generator:
        return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + rank)

    def draw(self, rollouts: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``rollouts`` prompts (``rollouts // group`` distinct ones, each repeated ``group`` times)
        and the uniforms ``[rollouts, gen_len]`` that pick the sampled tokens."""
        if rollouts % self.group:
            raise ValueError(f"rollouts per rank ({rollouts}) must be a multiple of the group size ({self.group})")
        prompts = torch.randint(0, self.prompt_vocab or self.vocab, (rollouts // self.group, self.prompt_len),
                                generator=generator)
        uniforms = torch.rand(rollouts, self.gen_len, generator=generator, dtype=torch.float64)
        return prompts.repeat_interleave(self.group, dim=0), uniforms

    def reward(self, completions: torch.Tensor) -> torch.Tensor:
        """Per completion: the share of its tokens below ``vocab // 4`` (in [0, 1])."""
        return (completions < self.vocab // 4).float().mean(dim=1)


def sample_token(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample one token per row from ``softmax(logits)`` by inverse CDF at ``uniforms`` ([B] in [0, 1))."""
    cdf = torch.softmax(logits.double(), dim=-1).cumsum(dim=-1)
    token = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1))
    return token.clamp_max(logits.shape[-1] - 1)


def group_advantages(rewards: torch.Tensor, group: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, over the group's standard deviation."""
    r = rewards.view(-1, group)
    return ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)).view(-1)
