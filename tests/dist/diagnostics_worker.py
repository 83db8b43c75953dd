"""Diagnostics under the `deepspeed` runner: record the full master and served trajectory (test only)
next to what Fair Cast reports, for tests/shard/test_diagnostics.py. Writes $OUT_DIR/diagnostics.pt."""
from __future__ import annotations

import os
import sys

import deepspeed
import deepspeed.comm as dist
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ds_config, finish_and_exit, gather_shards, tiny_qwen3, train_step  # noqa: E402

STEPS = 40
DIAG = {"every": 5, "sample": 3000, "horizon": 64}
TRAJECTORY = ("nearest", "stochastic")  # the others report only their estimates
# the noisy regime: one Adam step comparable to half a spacing, where the L2 lag search reads 0
NOISY = {"lr": 1e-4, "modes": ("nearest", "stochastic", "dither", "error_feedback")}


def run(mode: str, diagnostics: dict, out: str, csv: bool = False, lr: float = 3e-6, trajectory: bool = True) -> dict:
    from faircast_ds import get_fair_cast

    # the regime that matters: lr small against the weights (init std 0.1, lr 3e-6; see README)
    model = tiny_qwen3(seed=0, std=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    cfg = ds_config(mode, diagnostics=diagnostics)
    if csv:
        cfg["csv_monitor"] = {"enabled": True, "output_path": os.path.join(out, "csv"), "job_name": "fc"}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    fc = get_fair_cast(engine)
    numels = {n: p.ds_numel for n, p in engine.module.named_parameters()}
    reports, masters, served = {}, [], []
    for step in range(1, STEPS + 1):
        train_step(engine, step, engine.global_rank)
        if trajectory and mode in TRAJECTORY:
            m, b = gather_shards(fc, numels)
            masters.append(torch.cat(list(m.values())))
            served.append(torch.cat(list(b.values())))
        if fc.diagnostics.last and fc.diagnostics.last["step"] == step:
            reports[step] = dict(fc.diagnostics.last)
    return {"reports": reports, "masters": masters, "served": served, "sample": fc.diagnostics.sample_size()}


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    out = os.environ["OUT_DIR"]
    results = {mode: run(mode, DIAG, out, csv=(mode == "nearest"))
               for mode in ("nearest", "stochastic", "dither", "error_feedback")}
    results["noisy"] = {mode: run(mode, DIAG, out, lr=NOISY["lr"], trajectory=False) for mode in NOISY["modes"]}
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out, "diagnostics.pt"))
    finish_and_exit()


if __name__ == "__main__":
    from common import freeze_the_imports

    freeze_the_imports()  # gc.collect() (DeepSpeed's and ours) then skips the imported modules
    main()
