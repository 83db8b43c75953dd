"""A plain Accelerate training loop, started by `accelerate launch --config_file acc.yaml`, whose
YAML names a DeepSpeed JSON file (``deepspeed_config: {deepspeed_config_file: ...}``): the one way
Accelerate's config carries a ``fair_cast`` section (its inline DeepSpeed keys cannot). The script
knows nothing of Fair Cast; afterwards it reports the banner's source and writes accelerate.pt for
the bitwise checks (tests/served_oracle.py): the initial weights, after every optimizer step the fp32
masters and served bits (tests/dist/served_record.py), and per rank the weights every Linear
multiplied by in the loop's forward, by step.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import batch, finish_and_exit, tiny_qwen3, write_json  # noqa: E402
from served_record import ForwardTap, initial_bits, snapshot  # noqa: E402


def main() -> None:
    from accelerate import Accelerator

    from faircast_ds import get_fair_cast

    accelerator = Accelerator()
    model = tiny_qwen3(std=0.1)
    initial = initial_bits(model)
    done = {"steps": 0}  # the loop's own count of optimizer steps
    tap = ForwardTap(model, step=lambda: done["steps"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, optimizer = accelerator.prepare(model, optimizer)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    snapshots = []
    for step in range(3):
        x = batch(step, rank)
        loss = engine(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        done["steps"] = step + 1
        snapshots.append(snapshot(engine.module, done["steps"]))
    fc = get_fair_cast(engine)
    taps = [None] * world
    torch.distributed.all_gather_object(taps, tap.record())
    if rank == 0:
        out = os.environ["OUT_DIR"]
        torch.save({"initial": initial, "snapshots": snapshots, "taps": taps}, os.path.join(out, "accelerate.pt"))
        write_json(os.path.join(out, "accelerate.json"), {
            "engine": type(engine).__name__, "origin": fc.origin, "mode": fc.config.mode,
            "world": world, "accelerate_distributed_type": str(accelerator.distributed_type), "step": fc.caster.step})
    finish_and_exit()


if __name__ == "__main__":
    main()
