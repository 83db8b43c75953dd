"""Size of a delta weight sync and the sender's largest allocation, against a dense sync.

    python benchmarks/delta_sync_size.py [--numel 1048576] [--fractions 0.97,0.167,0.007]

One process, a sender and a receiver on loopback (the receiver in a thread): a bf16 model of one
square parameter of ``numel`` elements and one 64x64 one, a dense sync, then the low mantissa bit
of a random fraction of every parameter's elements flipped and a delta sync. Prints the bytes on the
channel of both and the largest storage a torch op allocated in the sender during the delta (views
and in-place results are not allocations), beside one bf16 copy of the large parameter.
"""
from __future__ import annotations

import argparse
import math
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from faircast_ds.export import WeightReceiver, WeightSender


class LargestAllocation(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def model(side: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(side, side, bias=False),
                               torch.nn.Linear(64, 64, bias=False)).to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--fractions", default="0.97,0.167,0.007")
    args = ap.parse_args()
    side = math.isqrt(args.numel)
    print("| changed | dense sync (B) | delta sync (B) | delta/dense | sender's largest allocation (B) | one bf16 parameter (B) |")
    print("|---|---|---|---|---|---|")
    for fraction in (float(f) for f in args.fractions.split(",")):
        sender_model, receiver_model = model(side, 0), model(side, 1)
        rx = WeightReceiver(receiver_model, host="127.0.0.1", port=0, timeout=60)
        serving = threading.Thread(target=lambda: (rx.accept(60), rx.receive(60), rx.receive(60), rx.receive(60)),
                                   daemon=True)
        serving.start()
        tx = WeightSender(sender_model, port=rx.port, timeout=60)
        dense = tx.sync(version=1)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in sender_model.parameters():
                bits = p.data.view(-1).view(torch.int16)
                bits[torch.randperm(bits.numel(), generator=g)[:round(fraction * bits.numel())]] ^= 1
        with LargestAllocation() as seen:
            delta = tx.sync(version=2)
        tx.close()
        serving.join(60)
        rx.close()
        print(f"| {fraction:.1%} | {dense.bytes:,} | {delta.bytes:,} | {delta.bytes / dense.bytes:.3f} | "
              f"{seen.largest:,} | {2 * side * side:,} |")


if __name__ == "__main__":
    main()
