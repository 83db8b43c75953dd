"""The TRL recipe's reward (examples/trl_grpo/grpo_addition.py) is the addition task's (faircast_jobs/addition.py):
the same answers score the same, scored by the task from token ids and by the recipe from the text TRL hands a
reward function (the completion decoded up to its end of turn)."""
from __future__ import annotations

import sys

import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "examples" / "trl_grpo"))
import grpo_addition as recipe  # noqa: E402

ANSWERS = ["7 + 5 = 12.", "12", "The answer is 12!", "It is 13, not 12", "12 is wrong, 13", "-12", "twelve", "",
           "1 2", "012", "12.5"]


def test_the_recipe_reward_scores_as_the_addition_task():
    from faircast_ds.models.pretrained import load_tokenizer
    from faircast_jobs.addition import AdditionTask

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    task = AdditionTask(tokenizer, gen_len=24)
    prompt = task.prompts[7, 5]
    rows, texts = [], []
    for text in ANSWERS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [task.eos] + tokenizer("99")["input_ids"]
        rows.append(prompt + ids + [task.eos] * (task.gen_len - len(ids)))
        texts.append([{"role": "assistant", "content": tokenizer.decode(ids[:ids.index(task.eos)])}])
    want = task.score(torch.tensor(rows)).tolist()
    got = recipe.addition_reward(texts, answer=[12] * len(texts))
    assert got == want
    assert sum(want) >= 3 and 0 in want  # both outcomes occur


def test_the_recipe_prompts_are_the_task_prompts():
    rows = recipe.addition_dataset(32, seed=5)
    for prompt, answer in zip(rows["prompt"], rows["answer"]):
        a, b = map(int, prompt[0]["content"].removeprefix("What is ").removesuffix("?").split(" + "))
        assert prompt == [{"role": "user", "content": f"What is {a} + {b}?"}] and answer == a + b and 1 <= a <= 9
