"""The pretrained model's RL task: small additions asked through the model's chat template, rewarded from
the parsed answer.

A prompt is one user turn, ``"What is {a} + {b}?"`` with ``a, b`` drawn uniformly from ``[low, high]``,
rendered by the tokenizer's chat template (:func:`faircast_ds.models.pretrained.chat_prompt_ids`), ending where the
assistant answers. A completion is ``gen_len`` sampled tokens; the answer is its text up to the first
end-of-turn token (``<|im_end|>``), and the reward is 1 when the last integer in that answer is ``a + b``,
else 0. Tokens after the end of the turn are not trained on (:meth:`AdditionTask.mask`).

Every operand pair must render to the same number of prompt tokens (single digits do: SmolLM2's
tokenizer splits numbers into digits), so a step's prompts stack into one tensor. The draw is keyed by
(seed, step, rank), as the tiny job's task: every cast mode sees the same prompts, and ``--engine vllm``
gives each rollout a seed of its own (jobs/rollouts.py), so modes are compared on common random numbers.
Measured on SmolLM2-135M-Instruct at temperature 1 (docs/pretrained.md): about 0.18 of the answers are
right for one-digit operands, and most groups of 4 hold both a right and a wrong answer.
"""
from __future__ import annotations

import re
from typing import Any

import torch

TEMPLATE = "What is {a} + {b}?"
_INTEGER = re.compile(r"-?\d+")


class AdditionTask:
    """Prompts, sampling noise, the reward and the trained-token mask of the addition task."""

    name = "addition"

    def __init__(self, tokenizer: Any, *, gen_len: int = 16, group: int = 4, low: int = 1, high: int = 9,
                 template: str = TEMPLATE) -> None:
        from faircast_ds.models.pretrained import chat_prompt_ids

        if not 0 <= low <= high:
            raise ValueError(f"operands must satisfy 0 <= low <= high, got low={low}, high={high}")
        if gen_len < 1 or group < 2:
            raise ValueError(f"gen_len must be >= 1 and group >= 2, got {gen_len}, {group}")
        self.tokenizer, self.gen_len, self.group, self.low, self.high = tokenizer, gen_len, group, low, high
        self.eos = int(tokenizer.eos_token_id)
        self.vocab = len(tokenizer)
        self.answers: dict[tuple[int, ...], int] = {}
        self.prompts: dict[tuple[int, int], list[int]] = {}
        for a in range(low, high + 1):
            for b in range(low, high + 1):
                ids = chat_prompt_ids(tokenizer, template.format(a=a, b=b))
                self.prompts[a, b] = ids
                self.answers[tuple(ids)] = a + b
        lengths = {len(ids) for ids in self.prompts.values()}
        if len(lengths) != 1:
            raise ValueError(f"operands in [{low}, {high}] render to prompts of {sorted(lengths)} tokens; "
                             "the task needs one length (use operands of one digit count)")
        self.prompt_len = lengths.pop()

    def generator(self, seed: int, step: int, rank: int) -> torch.Generator:
        return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + rank)

    def draw(self, rollouts: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``rollouts`` prompts (``rollouts // group`` distinct draws, each repeated ``group`` times) and
        uniforms ``[rollouts, gen_len]`` (the HF engine samples with them; vLLM uses only their shape)."""
        if rollouts % self.group:
            raise ValueError(f"rollouts per rank ({rollouts}) must be a multiple of the group size ({self.group})")
        pairs = torch.randint(self.low, self.high + 1, (rollouts // self.group, 2), generator=generator)
        prompts = torch.tensor([self.prompts[int(a), int(b)] for a, b in pairs.tolist()], dtype=torch.long)
        uniforms = torch.rand(rollouts, self.gen_len, generator=generator, dtype=torch.float64)
        return prompts.repeat_interleave(self.group, dim=0), uniforms

    def answer_text(self, completion: list[int]) -> str:
        """The assistant's answer: the completion's text up to the first end-of-turn token."""
        if self.eos in completion:
            completion = completion[:completion.index(self.eos)]
        return self.tokenizer.decode(completion)

    def score(self, seqs: torch.Tensor) -> torch.Tensor:
        """Per sequence (prompt + completion): 1.0 when the last integer of the answer is ``a + b``."""
        out = []
        for row in seqs.tolist():
            prompt, completion = tuple(row[:self.prompt_len]), row[self.prompt_len:]
            if prompt not in self.answers:
                raise ValueError("a sequence whose prompt is not one of this task's")
            numbers = _INTEGER.findall(self.answer_text(completion))
            out.append(1.0 if numbers and int(numbers[-1]) == self.answers[prompt] else 0.0)
        return torch.tensor(out)

    def mask(self, completions: torch.Tensor) -> torch.Tensor:
        """1.0 for the tokens of the assistant's turn (up to and including the first end-of-turn), 0 after."""
        ended = (completions == self.eos).long().cumsum(dim=1)
        return ((ended - (completions == self.eos).long()) == 0).float()

    def fixed_batch(self, count: int = 8) -> tuple[torch.Tensor, int]:
        """A fixed batch of whole chat turns (prompt + the right answer ``"a + b = c."`` + end of turn) with
        two-digit sums (so the rows are of one length): the sequences the served and master policies are
        compared on, and where the answer starts."""
        pairs = [(a, b) for a in range(self.low, self.high + 1) for b in range(self.low, self.high + 1) if a + b >= 10]
        if not pairs:
            raise ValueError("no operand pair with a two-digit sum for the fixed batch")
        chosen = [pairs[(i * 7) % len(pairs)] for i in range(count)]
        rows = []
        for a, b in chosen:
            answer = self.tokenizer(f"{a} + {b} = {a + b}.", add_special_tokens=False)["input_ids"]
            rows.append(self.prompts[a, b] + list(answer) + [self.eos])
        if len({len(r) for r in rows}) != 1:
            raise ValueError("the fixed batch's rows differ in length")
        return torch.tensor(rows, dtype=torch.long), self.prompt_len
