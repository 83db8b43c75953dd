"""Time the GPU (Triton) casts, for a session that has a CUDA machine (e.g. one H200).

    python benchmarks/gpu_check.py [--numel 1.7e9] [--repeats 10] [--out DIR] [--ipc [--ipc-mib 1137]]

Casting ``--numel`` fp32 elements to bf16, per mode, as multiples of a plain round-to-nearest
``bf16.copy_(fp32)`` of the same tensor (the memory floor: ~10.2 GB moved for 1.7e9 elements, ~2.4 ms
on an H200), with and without reading the old bits for the changed count, next to the eager torch
path (timed on a 2^28 slice and scaled) and the 22-38 ms such casts take in published RL training
stacks.

The bits are checked by tests/casting/test_gpu.py (the Triton kernel against ``cast`` on the GPU and on the
CPU and against the slow reference, on awkward inputs, residual and counts included); run it first:
``python -m pytest -q tests/casting/test_gpu.py``.

``--trl`` adds TRL's own colocated vLLM sync on the GPU: the recipe of examples/trl_grpo/ for 2 steps on one
rank (``grpo_addition.py --load trl``: TRL's ``load_weights`` loads, ``install_trl_sync`` reads the engine's
kernels back after each sync and fails unless they are the served bits; needs TRL, vLLM, DeepSpeed,
Accelerate and the model folder, ``--trl-model``).

``--ipc`` adds the bucket part (``benchmarks/gpu_buckets.py``): served slices moved from a trainer-rank
process into an engine process through CUDA IPC bucket slots, in GB/s against a device memcpy, the bits
checked against a direct write.

Prints one table and writes it, with the raw numbers as JSON, to benchmarks/results/ (and to $OUT
when that is set, so a device session gets the files back). Needs only torch with CUDA, Triton, and
this repository on the path.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from faircast_ds.casting import kernels, modes  # noqa: E402
from faircast_ds.casting.modes import MODES
from faircast_ds.casting.rules import cast, cast_into  # noqa: E402

PAPER_MS = (22.0, 38.0)
FLOOR_MS_H200 = 2.4


def time_ms(fn, repeats: int) -> float:
    fn()
    if not torch.cuda.is_available():  # --device cpu: a dry run of this script's own logic
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, (time.perf_counter() - t0) * 1e3)
        return best
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def time_all(numel: int, repeats: int, device: str) -> tuple[list[str], list[dict]]:
    x = torch.randn(numel, device=device) * 0.02
    out = torch.empty(numel, dtype=torch.bfloat16, device=device)
    residual = torch.zeros(numel, device=device)
    rn = time_ms(lambda: out.copy_(x), repeats)
    gbytes = numel * 6 / 1e9
    eager_n = min(numel, 1 << 28)
    rows = []
    for mode in MODES:
        res = residual if mode == "error_feedback" else None
        kw = dict(seed=1, step=2, name="bench.w")
        fused = time_ms(lambda: cast_into(out, x, mode, residual=res, **kw), repeats)
        no_count = float("nan")
        if device == "cuda":
            from faircast_ds.casting.kernels import triton_cast

            key = modes.noise_key(mode, **kw)
            no_count = time_ms(lambda: triton_cast.cast_into(out, x, mode, key=key, start=0, residual=res,
                                                             count_changed=False), repeats)
        x_eager, res_eager = x[:eager_n], (residual[:eager_n] if res is not None else None)
        eager = time_ms(lambda: cast(x_eager, mode, residual=res_eager, **kw), max(2, repeats // 3)) * numel / eager_n
        rows.append(dict(mode=mode, numel=numel, rn_ms=rn, fused_ms=fused, fused_no_count_ms=no_count,
                         eager_ms_scaled=eager, eager_numel=eager_n))
        x_eager = res_eager = None
        if device == "cuda":
            torch.cuda.empty_cache()
    head = f"{'mode':15s} {'RN copy_ ms':>11s} {'fused ms':>9s} {'fused/RN':>8s} {'no-count ms':>11s} " \
           f"{'no-count/RN':>11s} {'eager ms*':>10s} {'eager/fused':>11s} {'vs 22-38 ms':>12s}"
    lines = [f"timing {numel:.3g} fp32 -> bf16 elements ({gbytes:.1f} GB at the floor; RN copy_ {rn:.2f} ms = "
             f"{gbytes / rn:.2f} TB/s; H200 floor ~{FLOOR_MS_H200} ms), min of {repeats} after warm-up", head]
    for r in rows:
        lines.append(f"{r['mode']:15s} {r['rn_ms']:11.2f} {r['fused_ms']:9.2f} {r['fused_ms'] / r['rn_ms']:7.2f}x "
                     f"{r['fused_no_count_ms']:11.2f} {r['fused_no_count_ms'] / r['rn_ms']:10.2f}x "
                     f"{r['eager_ms_scaled']:10.1f} {r['eager_ms_scaled'] / r['fused_ms']:10.1f}x "
                     f"{PAPER_MS[0] / r['fused_ms']:5.1f}-{PAPER_MS[1] / r['fused_ms']:.1f}x")
    lines.append(f"* eager timed on {eager_n:,} elements and scaled linearly; 'no-count' skips reading the old bf16 "
                 "bits (2 of 8 bytes per element) that the changed count needs")
    return lines, rows


def trl_sync_check(model: str, out: Path) -> tuple[list[str], dict]:
    """The recipe with TRL's own sync on one GPU rank, 2 steps; its exit status says whether every sync left
    the engine computing with the served bits (docs/integrations.md, TRL's colocated vLLM)."""
    import subprocess

    recipe = ROOT / "examples" / "trl_grpo"
    config = out / "accelerate_1rank.yaml"
    config.write_text((recipe / "accelerate_2ranks.yaml").read_text().replace("num_processes: 2", "num_processes: 1")
                      .replace("examples/trl_grpo/ds_zero3_fair_cast.json", str(recipe / "ds_zero3_fair_cast.json")))
    log = out / "trl_sync.log"
    began = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(["accelerate", "launch", "--config_file", str(config), str(recipe / "grpo_addition.py"),
                               "--model", model, "--steps", "2", "--load", "trl", "--output", str(out / "trl_grpo")],
                              cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    syncs = [json.loads(line)["sync"] for line in log.read_text().splitlines() if line.startswith('{"sync"')]
    result = {"exit": done.returncode, "seconds": time.perf_counter() - began, "syncs": syncs}
    verified = sum(1 for r in syncs if r.get("verified"))
    return [f"TRL's own colocated sync (load_weights), 2 steps: exit {done.returncode}, {verified} of {len(syncs)} "
            f"syncs read back equal to the served bits (log {log})"], result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=float, default=1.7e9)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a dry run of this script with the CPU kernel (tiny --numel), no GPU needed")
    parser.add_argument("--ipc", action="store_true", help="also time the bucket stream between two processes")
    parser.add_argument("--ipc-mib", type=int, default=1137, help="served MiB the bucket stream moves")
    parser.add_argument("--bucket-mib", type=int, default=256, help="bytes per bucket slot, MiB")
    parser.add_argument("--trl", action="store_true", help="also run TRL's own colocated vLLM sync, checked (2 steps)")
    parser.add_argument("--trl-model", default="smollm2-135m-instruct", help="the recipe's --model (a local folder)")
    args = parser.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device: nothing to time")
            return 2
        assert kernels.backend_for(torch.device("cuda")) == "triton", "Triton path unavailable"
        import triton

        name = torch.cuda.get_device_name()
        header = [f"faircast-ds GPU timing: {name}, torch {torch.__version__}, triton {triton.__version__}, "
                  f"CUDA {torch.version.cuda}, host {platform.node()}"]
    else:
        name = "cpu (dry run)"
        header = [f"faircast-ds GPU timing, DRY RUN on the CPU kernel: torch {torch.__version__}"]
    time_lines, rows = time_all(int(args.numel), args.repeats, args.device)
    stream = None
    if args.ipc:
        import gpu_buckets

        stream_lines, stream = gpu_buckets.run(args.ipc_mib << 20, args.bucket_mib << 20, args.device)
        time_lines += [""] + stream_lines
    trl = None
    if args.trl:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        trl_lines, trl = trl_sync_check(args.trl_model, Path(args.out))
        time_lines += [""] + trl_lines
    text = "\n".join(header + [""] + time_lines)
    print(text)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for folder in filter(None, [args.out, os.environ.get("OUT")]):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"gpu_check_{stamp}.txt").write_text(text + "\n")
        (Path(folder) / f"gpu_check_{stamp}.json").write_text(json.dumps(
            dict(device=name, timing=rows, bucket_stream=stream, trl_sync=trl), indent=2))
    if trl is not None and trl["exit"] != 0:
        return 1
    return 1 if stream is not None and (not stream["bits_equal"] or stream["trainer_exit"] != 0) else 0


if __name__ == "__main__":
    sys.exit(main())
