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


def test_the_newest_checkpoint_is_the_highest_complete_step(tmp_path):
    assert recipe.newest_checkpoint(str(tmp_path / "absent")) is None
    assert recipe.newest_checkpoint(str(tmp_path)) is None
    for step, complete in ((9, True), (10, True), (100, False), (20, True), (3, True)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        if complete:  # TRL writes trainer_state.json last
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-final").mkdir()  # not a step: passed over
    assert recipe.newest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-20")  # by number, not by name


def test_the_rows_file_holds_the_step_rows_once_and_is_rewritten_whole(tmp_path):
    import json

    history = [{"step": 1, "reward": 0.25, "loss": 0.1, "fair_cast/changed_fraction": 0.04},
               {"step": 2, "reward": 0.5, "sampling/importance_sampling_ratio/min": 0.9},
               {"step": 2, "train_runtime": 80.0}]  # the run's summary row: not a step
    path = recipe.write_rows(str(tmp_path / "run"), history)
    rows = [json.loads(line) for line in open(path)]
    assert rows == [{"step": 1, "reward": 0.25, "fair_cast/changed_fraction": 0.04},
                    {"step": 2, "reward": 0.5, "sampling/importance_sampling_ratio/min": 0.9}]
    recipe.write_rows(str(tmp_path / "run"), history[:1])  # a resumed run's history, back from its checkpoint
    assert [json.loads(line)["step"] for line in open(path)] == [1]


def test_the_recipe_refuses_a_negative_interval():
    import pytest

    with pytest.raises(SystemExit):
        recipe.parse(["--save-every", "-1"])
    args = recipe.parse(["--resume", "--save-every", "5"])
    assert args.resume and args.save_every == 5
