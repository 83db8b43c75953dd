"""How many served bf16 weights does each optimizer step change? One ZeRO-3 run per cast mode.

Launch: ``deepspeed --num_gpus 2 --module faircast_jobs.staleness [--steps 30]``.
A tiny transformers Qwen3 (built from a config, no download) trains on a synthetic next-token task
with AdamW at an RL learning rate; the fp32 master starts on the bf16 grid, as when fine-tuning a
bf16 checkpoint. Per step and mode it prints how many served weights changed, then a summary, and
writes ``<out>/staleness.csv``.
"""
from __future__ import annotations

import argparse
import csv
import os
from typing import Any

import torch

from faircast_ds.casting.modes import MODES


def build_model(hidden: int, layers: int, vocab: int, seed: int) -> torch.nn.Module:
    """bf16 parameters (the fp32 master starts on the bf16 grid), fp32 buffers as from_pretrained builds them."""
    from faircast_bench.builders import tiny_causal_lm

    return tiny_causal_lm("qwen3", seed=seed, init_std=0.1, vocab_size=vocab, hidden_size=hidden,
                          intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=128,
                          tie_word_embeddings=False)


def run_mode(mode: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import deepspeed

    from faircast_ds import get_fair_cast

    model = build_model(args.hidden, args.layers, args.vocab, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000},
        "steps_per_print": 10**9,
        "fair_cast": {"enabled": True, "mode": mode, "seed": args.seed},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    fair_cast = get_fair_cast(engine)
    rank = engine.global_rank
    rows = []
    for step in range(1, args.steps + 1):
        g = torch.Generator().manual_seed(10_000 * step + rank)
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        x[:, 1::2] = (x[:, 0::2] * 7 + 3) % args.vocab  # a learnable pattern
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        stats = fair_cast.stats()
        rows.append({"mode": mode, "step": step, "loss": float(loss.detach()), "changed": int(stats["changed"]),
                     "numel": int(stats["numel"]), "changed_fraction": stats["changed_fraction"]})
        if rank == 0:
            print(f"step {step:4d}  {mode:<15} loss {rows[-1]['loss']:.4f}  served weights changed "
                  f"{rows[-1]['changed']:>8d} / {rows[-1]['numel']} = {100 * stats['changed_fraction']:.3f}%",
                  flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-6)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default="runs/staleness")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo" if os.environ.get("DS_ACCELERATOR") == "cpu" else None)
    rows = [row for mode in args.modes.split(",") for row in run_mode(mode, args)]
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "staleness.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"\nserved weights changed per step (lr {args.lr:g}, {args.steps} steps, "
              f"world size {dist.get_world_size()}):")
        print(f"{'mode':<15} {'mean':>9} {'min':>9} {'max':>9}  final loss")
        for mode in args.modes.split(","):
            fr = [r["changed_fraction"] for r in rows if r["mode"] == mode]
            last = [r["loss"] for r in rows if r["mode"] == mode][-1]
            print(f"{mode:<15} {100 * sum(fr) / len(fr):8.3f}% {100 * min(fr):8.3f}% {100 * max(fr):8.3f}%  {last:.4f}")
        print(f"per-step CSV: {os.path.join(args.out, 'staleness.csv')}")
    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
