"""Time Fair Cast's refresh on Megatron-Core's DistributedOptimizer, for a session with a CUDA machine.

    python benchmarks/megatron_gpu_check.py [--hidden 4096] [--layers 3] [--steps 3] [--repeats 20]
    torchrun --nproc_per_node N benchmarks/megatron_gpu_check.py      # N GPUs: shards cut across ranks

Needs torch with CUDA (Triton for the fused cast), megatron-core 0.16.1, and this repository. No
Transformer Engine or Apex is needed. Builds a stack of bf16 ``nn.Linear`` layers (``--hidden``² each;
the defaults give ~50M parameters) under Megatron's DDP with ``use_distributed_optimizer=True``,
``get_megatron_optimizer(bf16=True)`` (Adam, fp32 main params), takes ``--steps`` steps per mode, then
times the refresh (``_copy_main_params_to_model_params``: the cast of all shards plus nothing else)
per mode against Megatron's own round-to-nearest copy, median of ``--repeats`` calls.

The bits are checked by tests/casting/test_gpu.py (which builds its model with this file's ``build``, ``step``
and ``set_masters``): every served shard equals ``faircast_ds.casting`` of its fp32 main shard computed
on the CPU, and ``nearest`` is Megatron's own copy bit for bit. Run it first:
``python -m pytest -q tests/casting/test_gpu.py``.

Prints a table and writes JSON to benchmarks/results/megatron_gpu_check.json (and to $OUT when set).
``--allow-cpu`` runs it on the CPU (only to smoke-test the script, with tests/dist/megatron_cpu.py's
stand-ins enabled by the caller).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from faircast_ds.casting.bits import bf16_bits
from faircast_ds.casting.modes import MODES  # noqa: E402

SEED = 1234


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def init(allow_cpu: bool) -> torch.device:
    if not torch.cuda.is_available() and not allow_cpu:
        sys.exit("no CUDA device: this check is for a GPU session (--allow-cpu only smoke-tests the script)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class Stack(torch.nn.Module):
    def __init__(self, config, hidden: int, layers: int, device: torch.device) -> None:
        super().__init__()
        self.config = config
        # an odd extra width so that the data-parallel cut falls inside a parameter
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden + (i == layers - 1) * 3, bias=True,
                                                          dtype=torch.bfloat16, device=device)
                                          for i in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def build(args, device: torch.device):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=2, bf16=True,
                               params_dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                          grad_reduce_in_fp32=True),
                                    Stack(config, args.hidden, args.layers, device))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-5, bf16=True,
                                                       use_distributed_optimizer=True), [model])
    return model, optimizer


def shards(optimizer):
    from faircast_ds.megatron.adapters import distributed_optimizers, parameter_names
    from faircast_ds.megatron.shards import low_precision_shards

    for opt in distributed_optimizers(optimizer):
        yield from low_precision_shards(opt, parameter_names(opt))


def set_masters(optimizer) -> None:
    """fp32 main values that depend only on (parameter, index): the same for any sharding."""
    from faircast_ds.casting.noise import name_id

    for shard, main, _ in shards(optimizer):
        idx = torch.arange(shard.start, shard.start + shard.numel, dtype=torch.float64, device=main.device)
        main.data.copy_((0.05 * torch.sin(0.37 * idx + name_id(shard.name) % 1000) + 1e-6 * math.pi).float())


def step(model, optimizer, args, device, n: int) -> None:
    g = torch.Generator(device="cpu").manual_seed(100 * n + torch.distributed.get_rank())
    x = torch.randn(8, args.hidden, generator=g).to(device=device, dtype=torch.bfloat16)
    optimizer.zero_grad()
    model.zero_grad_buffer()
    model(x).float().pow(2).mean().backward()
    model.finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok, "optimizer step skipped"


def served_full(model) -> dict[str, torch.Tensor]:
    return {n.removeprefix("module."): bf16_bits(p.detach().reshape(-1)).cpu()
            for n, p in model.named_parameters() if p.dtype == torch.bfloat16}


def refresh_ms(mode: str | None, args, device) -> dict:
    """mode None: Megatron's own copy. ``--steps`` steps (the kernels compiled, the state warm), then the
    median time of the refresh alone."""
    from faircast_ds.megatron import attach

    model, optimizer = build(args, device)
    if mode:
        attach(optimizer, {"mode": mode, "seed": SEED}, route=args.route)
    set_masters(optimizer)
    for n in range(1, args.steps + 1):
        step(model, optimizer, args, device, n)
    times = []
    for opt in (getattr(optimizer, "chained_optimizers", None) or [optimizer])[:1]:
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            opt._copy_main_params_to_model_params()
            sync()
            times.append(1e3 * (time.perf_counter() - t0))
    return {"refresh_ms": statistics.median(times), "numel": sum(s.numel for s, _, _ in shards(optimizer))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--route", choices=("auto", "runtime", "hook"), default="auto")
    parser.add_argument("--allow-cpu", action="store_true")
    args = parser.parse_args()
    device = init(args.allow_cpu)
    rank = torch.distributed.get_rank()
    results = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "world": torch.distributed.get_world_size(), "args": vars(args), "modes": {}}
    baseline = refresh_ms(None, args, device)
    for mode in MODES:
        r = refresh_ms(mode, args, device)
        results["modes"][mode] = {"refresh_ms": r["refresh_ms"], "vs_megatron_copy": r["refresh_ms"] / baseline["refresh_ms"],
                                  "local_elements": r["numel"]}
    results["megatron_copy_ms"] = baseline["refresh_ms"]
    if rank == 0:
        print(f"{results['device']}, world {results['world']}, {baseline['numel']:,} local bf16 elements; "
              f"Megatron's own copy {baseline['refresh_ms']:.3f} ms")
        print(f"{'mode':16s} {'refresh ms':>11s} {'x copy':>7s}")
        for mode, r in results["modes"].items():
            print(f"{mode:16s} {r['refresh_ms']:11.3f} {r['vs_megatron_copy']:7.2f}")
        folders = [ROOT / "benchmarks" / "results"] if torch.cuda.is_available() else []
        folders += [Path(os.environ["OUT"])] if os.environ.get("OUT") else []
        for folder in folders:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "megatron_gpu_check.json").write_text(json.dumps(results, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
