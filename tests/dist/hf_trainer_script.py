"""A plain Hugging Face Trainer script: it knows nothing of faircast_ds.

DeepSpeed is initialized by Trainer/Accelerate from the config dict below, which has a
`fair_cast` section. The only CPU-specific line is the bf16 availability stub (transformers refuses bf16 without a GPU unless use_cpu=True, and use_cpu=True turns DeepSpeed off).
After training it reports, from DeepSpeed's own API, how many served weights the last step changed,
and writes hf_trainer.pt for the bitwise checks (tests/served_oracle.py): after every optimizer step
(a callback at the Trainer's on_step_end, then one more engine.step() outside the Trainer) the fp32
masters and served bits (tests/dist/served_record.py), and the weights every Linear of the model
multiplied by in the Trainer's forward, by step.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import transformers.training_args
from transformers import Trainer, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import tiny_qwen3  # noqa: E402
from served_record import ForwardTap, initial_bits, snapshot  # noqa: E402

transformers.training_args.is_torch_bf16_gpu_available = lambda: True  # CPU-only machine

MODE = os.environ.get("FAIR_CAST_MODE", "stochastic")
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 40},
    "fair_cast": {"enabled": True, "mode": MODE, "seed": 7},
}


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 101, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def served_bits(engine) -> torch.Tensor:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return torch.cat([p.detach().reshape(-1).view(torch.int16).clone() for p in params])


def main() -> None:
    from transformers import TrainerCallback

    out = os.environ["OUT_DIR"]
    args = TrainingArguments(output_dir=os.path.join(out, "hf"), per_device_train_batch_size=2, max_steps=3,
                             learning_rate=1e-5, bf16=True, deepspeed=DS_CONFIG, report_to=[], save_strategy="no",
                             logging_steps=1, optim="adamw_torch", dataloader_num_workers=0)
    snapshots = []

    class Snapshots(TrainerCallback):
        """After each optimizer step, with the Trainer's step number (and DeepSpeed's, to compare)."""

        def on_step_end(self, args, state, control, **kwargs):
            engine = trainer.model_wrapped
            snapshots.append(snapshot(engine.module, state.global_step, ds_step=engine.global_steps))

    model = tiny_qwen3()
    initial = initial_bits(model)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Snapshots()])
    tap = ForwardTap(model, step=lambda: trainer.state.global_step)
    trainer.train()
    engine = trainer.model_wrapped
    before = served_bits(engine)
    batch = Tokens()[0]
    loss = engine(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss
    engine.backward(loss)
    engine.step()  # outside the Trainer: DeepSpeed's own step count numbers it
    snapshots.append(snapshot(engine.module, engine.global_steps, ds_step=engine.global_steps))
    changed = int((served_bits(engine) != before).sum())
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"initial": initial, "snapshots": snapshots, "tap": tap.record()},
                   os.path.join(out, "hf_trainer.pt"))
        with open(os.path.join(out, "hf_trainer.json"), "w") as f:
            json.dump({"engine": type(engine).__name__, "changed": changed, "numel": before.numel()}, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
