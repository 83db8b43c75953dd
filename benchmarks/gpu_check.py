"""One short check of the GPU (Triton) casts, for a session that has a CUDA machine (e.g. one H200).

    python benchmarks/gpu_check.py [--numel 1.7e9] [--repeats 10] [--out DIR]

1. Bits: on awkward inputs (normal weights at several scales, exact bf16 values, subnormals,
   near-overflow values, signed zeros, ±Inf, NaNs of every payload, residual chains with huge and
   subnormal residuals), for every mode and several (seed, step, start) with words past 2^32,
   the Triton kernel must equal ``cast`` run on the same GPU and ``cast`` run on the CPU (NaN
   lanes of ``nearest`` excepted there: torch's own NaN differs between devices), including the
   residual and the two counts; a small slice is also checked against the slow reference.
2. Time: casting ``--numel`` fp32 elements to bf16, per mode, as multiples of a plain
   round-to-nearest ``bf16.copy_(fp32)`` of the same tensor (the memory floor: ~10.2 GB moved for
   1.7e9 elements, ~2.4 ms on an H200), with and without reading the old bits for the changed
   count, next to the eager torch path (timed on a 2^28 slice and scaled) and the 22-38 ms such
   casts take in published RL training stacks.

Prints one table and writes it, with the raw numbers as JSON, to benchmarks/results/ (and to $OUT
when that is set, so a device session gets the files back). Exits non-zero if any bit differs.
Needs only torch with CUDA, Triton, and this repository on the path.
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

from faircast_ds import kernels  # noqa: E402
from faircast_ds.casts import MODES, bf16_bits, cast, cast_into, fp32_bits  # noqa: E402
from faircast_ds.reference import cast_reference  # noqa: E402

PAPER_MS = (22.0, 38.0)
FLOOR_MS_H200 = 2.4
CASES = [(7, 3, 0), (0, 1, 11), (2**40 + 3, 2**33 + 5, 2**32 - 700), (123, 2**32, 2**32), (2**63 - 1, 2**63 - 1, 2**45)]


def from_bits(bits: list[int]) -> torch.Tensor:
    t = torch.tensor(bits, dtype=torch.int64)
    return (t - ((t & 0x80000000) << 1)).to(torch.int32).view(torch.float32)


def awkward(n: int = 20_000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    payload_nans = [0x7F800001, 0xFF800001, 0x7F80FFFF, 0x7FFF0000, 0x7F810000, 0xFFFFFFFF, 0x7FC00000, 0xFFC00000]
    return torch.cat([
        torch.randn(n, generator=g) * 0.02,
        torch.randn(n // 4, generator=g) * 30.0,
        torch.randn(n // 8, generator=g).to(torch.bfloat16).float(),
        torch.rand(n // 8, generator=g) * 1e-38,  # subnormals and tiny normals
        from_bits([0x00000001, 0x0000FFFF, 0x00012345, 0x807FFFFF, 0x00800000, 0x80008000, 0x80000001]),
        from_bits([0x7F7F7FFF, 0x7F7F0001, 0xFF7F7FFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F7EFFFF, 0x7F7FC000]),
        torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0**-126, 3.0e38, float("inf"), float("-inf")]),
        from_bits(payload_nans),
    ])


def check_bits(device: str) -> tuple[list[str], int]:
    """Triton vs cast on the GPU and on the CPU; returns (lines, number of failures)."""
    lines, failures = [], 0
    x_cpu = awkward()
    x = x_cpu.to(device)
    nan = torch.isnan(x_cpu)
    for mode in MODES:
        bad_gpu = bad_cpu = bad_counts = 0
        for seed, step, start in CASES:
            e_cpu = (torch.randn(x_cpu.shape, generator=torch.Generator().manual_seed(seed % 1000)) * 1e-4
                     if mode == "error_feedback" else None)
            if e_cpu is not None:
                e_cpu[:64] = 1e30
                e_cpu[64:96] = 1e-40
            e_gpu_eager = e_cpu.to(device).clone() if e_cpu is not None else None
            e_fused = e_cpu.to(device).clone() if e_cpu is not None else None
            kw = dict(seed=seed, step=step, name="model.layers.0.mlp.up_proj.weight", start=start)
            old = torch.randn(x.shape, device=device).to(torch.bfloat16)
            want_gpu = cast(x, mode, residual=e_gpu_eager, **kw)
            want_cpu = cast(x_cpu, mode, residual=e_cpu, **kw)
            out = old.clone()
            counts = cast_into(out, x, mode, residual=e_fused, **kw)
            got = bf16_bits(out.cpu())
            bad_gpu += int((got != bf16_bits(want_gpu.cpu())).sum())
            lanes = ~nan if mode == "nearest" else torch.ones_like(nan)
            bad_cpu += int((got[lanes] != bf16_bits(want_cpu)[lanes]).sum())
            want_counts = (int((bf16_bits(old.cpu()) != bf16_bits(want_gpu.cpu())).sum()),
                           int((~torch.isfinite(want_gpu.float())).sum()))
            bad_counts += counts != want_counts
            if e_cpu is not None:
                bad_gpu += int((fp32_bits(e_fused.cpu()) != fp32_bits(e_gpu_eager.cpu())).sum())
                bad_cpu += int((fp32_bits(e_fused.cpu()) != fp32_bits(e_cpu)).sum())
        # the slow, value-based reference on a slice
        xs = x_cpu[-600:]
        e_ref = torch.randn(600) * 1e-4 if mode == "error_feedback" else None
        e_got = e_ref.to(device).clone() if e_ref is not None else None
        ref = cast_reference(xs, mode, seed=5, step=2**33, name="w", start=2**32 - 9, residual=e_ref)
        out = torch.empty(600, dtype=torch.bfloat16, device=device)
        cast_into(out, xs.to(device), mode, seed=5, step=2**33, name="w", start=2**32 - 9, residual=e_got)
        lanes = ~torch.isnan(xs) if mode == "nearest" else torch.ones(600, dtype=torch.bool)
        bad_ref = int((bf16_bits(out.cpu())[lanes] != bf16_bits(ref)[lanes]).sum())
        if e_ref is not None:
            bad_ref += int((fp32_bits(e_got.cpu()) != fp32_bits(e_ref)).sum())
        total = bad_gpu + bad_cpu + bad_counts + bad_ref
        failures += total
        lines.append(f"bits {mode:15s} vs cast(GPU): {bad_gpu} differ; vs cast(CPU): {bad_cpu}; counts wrong: "
                     f"{bad_counts}; vs reference: {bad_ref}  -> {'OK' if total == 0 else 'FAIL'}")
    return lines, failures


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
            from faircast_ds.kernels import triton_cast

            key = kernels.noise_key(mode, **kw)
            no_count = time_ms(lambda: triton_cast.cast_into(out, x, mode, key=key, start=0, residual=res,
                                                             count_changed=False), repeats)
        xe, re = x[:eager_n], (residual[:eager_n] if res is not None else None)
        eager = time_ms(lambda: cast(xe, mode, residual=re, **kw), max(2, repeats // 3)) * numel / eager_n
        rows.append(dict(mode=mode, numel=numel, rn_ms=rn, fused_ms=fused, fused_no_count_ms=no_count,
                         eager_ms_scaled=eager, eager_numel=eager_n))
        del xe, re
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=float, default=1.7e9)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a dry run of this script with the CPU kernel (tiny --numel), no GPU needed")
    args = parser.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device: nothing to check")
            return 2
        assert kernels.backend_for(torch.device("cuda")) == "triton", "Triton path unavailable"
        import triton

        name = torch.cuda.get_device_name()
        header = [f"faircast-ds GPU check: {name}, torch {torch.__version__}, triton {triton.__version__}, "
                  f"CUDA {torch.version.cuda}, host {platform.node()}"]
    else:
        name = "cpu (dry run)"
        header = [f"faircast-ds GPU check, DRY RUN on the CPU kernel: torch {torch.__version__}"]
    t0 = time.perf_counter()
    bit_lines, failures = check_bits(args.device)
    bit_lines.append(f"(bit checks incl. Triton compiles: {time.perf_counter() - t0:.1f} s)")
    time_lines, rows = ([], []) if args.skip_timing else time_all(int(args.numel), args.repeats, args.device)
    text = "\n".join(header + [""] + bit_lines + [""] + time_lines)
    print(text)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for folder in filter(None, [args.out, os.environ.get("OUT")]):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"gpu_check_{stamp}.txt").write_text(text + "\n")
        (Path(folder) / f"gpu_check_{stamp}.json").write_text(json.dumps(
            dict(device=name, bit_failures=failures, timing=rows), indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
