"""Issue 32 item 4's CPU question, measured side by side in one run on this machine's CPU: could the
engine apply a delta in place instead of reloading every layer it touches?

vLLM on CPU computes a bf16 linear layer with oneDNN over a copy of the weight that oneDNN repacked at
load (``create_onednn_mm``; the layer's ``.weight`` is then left empty), falling back to torch's
``F.linear`` over the plain weight when oneDNN cannot build a bf16 matmul for the CPU. Only the plain
weight can take a delta in place. For the matrices of one Qwen3-0.6B decoder layer (``qkv_proj``,
``o_proj``, ``gate_up_proj``, ``down_proj``; bf16) this prints:

1. **which path vLLM takes here**: whether oneDNN builds a bf16 matmul on this CPU;
2. **compute**: one layer's four GEMMs at M = 1, 16 and 256 tokens through ``F.linear`` over the plain
   weight, through oneDNN's repacked weight (when it builds), and ``F.linear`` in fp32 for scale;
3. **load**: the same layer's repack (``create_onednn_mm``, what a reload pays per matrix on the oneDNN
   path), a whole copy of the new weight (the least a reload of plain weights pays), and an in-place
   apply of a delta at 1%, 4% and 10% of the elements changed: the old values at those indices kept as
   an undo record, then the new values written (what an all-or-nothing in-place apply costs).

Every figure is the best of 3; ratios are taken within this run.

    python benchmarks/inplace_apply.py [--threads 2]
"""
from __future__ import annotations

import argparse
import platform

import torch
import torch.nn.functional as F

from timing import best

HIDDEN, Q, KV, INTER = 1024, 2048, 1024, 3072  # Qwen3-0.6B: 16 query and 8 key/value heads of 128
LAYER = {"qkv_proj": (Q + 2 * KV, HIDDEN), "o_proj": (HIDDEN, Q), "gate_up_proj": (2 * INTER, HIDDEN),
         "down_proj": (HIDDEN, INTER)}  # [N, K]: vLLM's fused shapes
TOKENS = (1, 16, 256)
SHARES = (0.01, 0.04, 0.10)


def _onednn():
    """vLLM's oneDNN ops, or the reason they are not there."""
    try:
        import vllm._custom_ops as ops
    except Exception as exc:  # noqa: BLE001 - any import failure means: not measurable here
        return None, f"vLLM's ops do not import ({type(exc).__name__}: {exc})"
    if not ops._supports_onednn:
        return None, "this vLLM build has no oneDNN matmul"
    return ops, ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = {n: (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16) for n, shape in LAYER.items()}
    ops, why = _onednn()
    handlers, repack = {}, None
    if ops is not None:
        try:
            repack = sum(best(lambda w=w: ops.create_onednn_mm(w.t(), 32)) for w in weights.values())
            handlers = {n: ops.create_onednn_mm(w.t(), 32) for n, w in weights.items()}
        except RuntimeError as exc:
            why = f"oneDNN builds no bf16 matmul for this CPU ({str(exc).splitlines()[0]})"
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"CPU: {platform.processor() or platform.machine()}, torch {torch.__version__} capability {capability}, "
          f"avx512_bf16 {torch.cpu._is_avx512_bf16_supported()}, {args.threads} thread(s)")
    elements = sum(w.numel() for w in weights.values())
    print(f"one Qwen3-0.6B decoder layer's matrices: {', '.join(f'{n} {list(s)}' for n, s in LAYER.items())} "
          f"({elements:,} bf16 elements)")
    if handlers:
        print("vLLM's path here: oneDNN over a repacked copy (.weight left empty): a delta cannot be applied in place")
    else:
        print(f"vLLM's path here: torch F.linear over the plain weight ({why}): a delta can be applied in place")

    print("\ncompute, one layer's four GEMMs (ms)")
    print(f"{'tokens':>6}  {'F.linear bf16':>13}  {'oneDNN bf16':>11}  {'F.linear fp32':>13}  {'bf16 / fp32':>11}  "
          f"{'F.linear / oneDNN':>17}")
    fp32 = {n: w.float() for n, w in weights.items()}
    for m in TOKENS:
        xs = {n: torch.randn(m, s[1], generator=g).to(torch.bfloat16) for n, s in LAYER.items()}
        plain = sum(best(lambda n=n: F.linear(xs[n], weights[n])) for n in LAYER)
        single = sum(best(lambda n=n: F.linear(xs[n].float(), fp32[n])) for n in LAYER)
        dnn = sum(best(lambda n=n: ops.onednn_mm(handlers[n], xs[n], None)) for n in LAYER) if handlers else None
        print(f"{m:>6}  {plain * 1e3:>13.2f}  {f'{dnn * 1e3:.2f}' if dnn else '-':>11}  {single * 1e3:>13.2f}  "
              f"{plain / single:>11.1f}  {f'{plain / dnn:.1f}' if dnn else '-':>17}")

    print("\nload, the same layer (ms)")
    copy = sum(best(lambda w=w: w.clone()) for w in weights.values())  # a whole new weight written
    print(f"whole copy of the new weights (a reload of plain weights, at least): {copy * 1e3:.2f}")
    if repack is not None:
        print(f"oneDNN repack (create_onednn_mm per matrix, what a reload on the oneDNN path pays): {repack * 1e3:.2f}")
    print(f"{'changed':>7}  {'undo record':>11}  {'write':>8}  {'in place':>8}  {'x whole copy':>12}  "
          f"{'x repack':>8}")
    for share in SHARES:
        undo_s = write_s = 0.0
        for w in weights.values():
            flat = w.view(-1)
            index = (torch.rand(flat.numel(), generator=g) < share).nonzero().view(-1)
            values = flat[index] + 1e-3
            undo_s += best(lambda: flat.index_select(0, index))
            write_s += best(lambda: flat.index_copy_(0, index, values))
        total = undo_s + write_s
        print(f"{share:>7.0%}  {undo_s * 1e3:>11.2f}  {write_s * 1e3:>8.2f}  {total * 1e3:>8.2f}  {total / copy:>12.2f}  "
              f"{f'{total / repack:.2f}' if repack else '-':>8}")


if __name__ == "__main__":
    main()
