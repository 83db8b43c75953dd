"""A plain Accelerate training loop, started by `accelerate launch --config_file acc.yaml`, whose
YAML names a DeepSpeed JSON file (``deepspeed_config: {deepspeed_config_file: ...}``): the one way
Accelerate's config carries a ``fair_cast`` section (its inline DeepSpeed keys cannot). The script
knows nothing of Fair Cast; afterwards it reports, per rank, the banner's source, and how many
served weights differ from round-to-nearest of the fp32 masters.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import batch, finish_and_exit, gather_shards, tiny_qwen3, write_json  # noqa: E402


def main() -> None:
    from accelerate import Accelerator

    from faircast_ds import get_fair_cast

    accelerator = Accelerator()
    model = tiny_qwen3(std=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, optimizer = accelerator.prepare(model, optimizer)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for step in range(3):
        x = batch(step, rank)
        loss = engine(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    fc = get_fair_cast(engine)
    numels = {n: int(p.ds_numel) for n, p in engine.module.named_parameters()}
    masters, served = gather_shards(fc, numels)
    rn_diff = sum(int((served[n] != (masters[n].to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF)).sum())
                  for n in numels)
    if rank == 0:
        write_json(os.path.join(os.environ["OUT_DIR"], "accelerate.json"), {
            "engine": type(engine).__name__, "source": fc.source, "mode": fc.config.mode,
            "world": world, "accelerate_distributed_type": str(accelerator.distributed_type), "step": fc.caster.step,
            "served_vs_rn": rn_diff, "numel": sum(numels.values())})
    finish_and_exit()


if __name__ == "__main__":
    main()
