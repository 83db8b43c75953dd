"""A trainer for the weight-update fault tests (tests/vllm_tests/transfer/test_vllm_faults.py), in pytest's process or as its
own process (``python fault_trainer.py URL DIR VERSION... [--pause-at N]``) so that it can be killed.

The served weights are a plain bf16 module, not a DeepSpeed engine: the faults concern the transport
and the engine, and a plain process starts in seconds. :func:`set_version` gives every version its own
weights (a subset of the parameters moves, so deltas are partial).

As a process: pushes each VERSION in turn through ``ServedPush(plane=PLANE)`` (``--plane``, default net);
writes DIR/pushed-<v> after each; with ``--pause-at N`` the last version's write stops after N slices
(ServedPush's ``pause``: the engine has part of the write, no report), with ``--pause-before-finish``
once rank 0 committed it and vLLM's update holds it but before ``finish_weight_update``; then it writes
DIR/paused and waits to be killed.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# the tiny Qwen3 of the other tests with head_dim 32: vLLM's CPU attention has no kernel for head_dim 8
MODEL = dict(std=0.1, head_dim=32)
PROMPTS = [[3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14]]
SEEDS = [1, 2, 3]
# how vLLM fuses HF projections in Qwen3 (restated: the test's checksums use no Fair Cast code)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def build_model() -> torch.nn.Module:
    from faircast_bench.builders import tiny_qwen3

    return tiny_qwen3(seed=0, **MODEL)


def set_version(model: torch.nn.Module, version: int) -> None:
    """The weights of ``version``: the initial ones, with layer ``version % 2``'s MLP and the final norm
    moved by an amount that depends on the version (version 0: the initial weights)."""
    fresh = dict(build_model().named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = fresh[name].detach().float()
            if version and (f"layers.{version % 2}.mlp." in name or name == "model.norm.weight"):
                idx = torch.arange(w.numel(), dtype=torch.float32).reshape(w.shape)
                w = w + 0.02 * version * torch.sin(0.7 * idx + version)
            p.copy_(w.to(p.dtype))


def version_masters(version: int) -> dict[str, torch.Tensor]:
    """The fp32 weights of ``version`` (what :func:`set_version` rounds to bf16)."""
    fresh = dict(build_model().named_parameters())
    out = {}
    for name, p in fresh.items():
        w = p.detach().float()
        if version and (f"layers.{version % 2}.mlp." in name or name == "model.norm.weight"):
            idx = torch.arange(w.numel(), dtype=torch.float32).reshape(w.shape)
            w = w + 0.02 * version * torch.sin(0.7 * idx + version)
        out[name] = w
    return out


class CastTrainer:
    """The plain module's served weights written by Fair Cast's own caster (mode ``nearest``: the same
    bits as :func:`set_version`), one flat shard per parameter, with a reader that offers the casts'
    change marks: a delta push then reads the marks instead of keeping a copy of the bits it sent."""

    def __init__(self, model: torch.nn.Module) -> None:
        from faircast_ds.casting.marks import MarkSet
        from faircast_ds.config.section import FairCastConfig
        from faircast_ds.export.source import ModelReader, provide
        from faircast_ds.shard.caster import ShardCaster, ShardSlice

        self.model = model
        self.caster = ShardCaster(FairCastConfig(mode="nearest", seed=0))
        self.marks = MarkSet([self.caster.track_changes()])
        self.params = dict(model.named_parameters())
        self.slices = {n: [ShardSlice(n, 0, p.numel(), 0)] for n, p in self.params.items()}
        for name, p in self.params.items():  # registered before the first cast, as FairCast.change_marks does
            self.caster.marks.for_cast(name, p.data.view(-1), p.device)
        trainer = self

        class Reader(ModelReader):
            def change_marks(self):
                return trainer.marks

        provide(model, Reader(model))

    def set_version(self, version: int) -> None:
        self.caster.begin_step()
        for name, w in version_masters(version).items():
            p = self.params[name]
            self.caster.cast_flat(name, w.reshape(-1), p.data.view(-1), self.slices[name])


def canonical_bits(t: torch.Tensor) -> torch.Tensor:
    """int16 bits, ±0 and subnormals as +0 (the CPU kernels flush them)."""
    bits = t.detach().contiguous().reshape(-1).view(torch.int16)
    return torch.where((bits & 0x7F80) == 0, torch.zeros_like(bits), bits)


def expected_checksums(model: torch.nn.Module, prefix: str = "dp0:pp0:pcp0:tp0:") -> dict[str, str]:
    """What vLLM's /weight_checker must answer for ``model``'s bf16 weights: SHA-256 of each engine
    parameter's canonical bits, fused layers being their HF parts concatenated along rows."""
    params = dict(model.named_parameters())
    out, done = {}, set()
    for name, p in params.items():
        path, _, attr = name.rpartition(".")
        parent, _, leaf = path.rpartition(".")
        fused = next((f for f, parts in FUSED.items() if leaf in parts), None)
        if fused is None:
            out[prefix + name] = hashlib.sha256(canonical_bits(p).numpy().tobytes()).hexdigest()
        elif (parent, fused) not in done:
            done.add((parent, fused))
            h = hashlib.sha256()
            for part in FUSED[fused]:
                h.update(canonical_bits(params[f"{parent}.{part}.{attr}"]).numpy().tobytes())
            out[f"{prefix}{parent}.{fused}.{attr}"] = h.hexdigest()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("dir", type=Path)
    parser.add_argument("versions", type=int, nargs="+")
    parser.add_argument("--pause-at", type=int, default=None)
    parser.add_argument("--pause-before-finish", action="store_true",
                        help="the last version's update: all sent and received, then stop before finish_weight_update")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--plane", default="net")
    args = parser.parse_args()
    from faircast_ds.vllm.transfer import ServedPush, VllmServer

    model = build_model()
    push = ServedPush(model, args.url, plane=args.plane, timeout=args.timeout, verify=False)
    for i, version in enumerate(args.versions):
        set_version(model, version)
        last = i == len(args.versions) - 1
        def hold(*_: Any) -> None:
            (args.dir / "paused").write_text(str(version))
            while True:  # until killed
                time.sleep(1)

        if last and args.pause_at is not None:
            push.pause = lambda k: hold() if k == args.pause_at else None
            push.push(version)
        elif last and args.pause_before_finish:
            VllmServer.finish_weight_update = hold  # the engine has the whole update, staged
            push.push(version)
        else:
            report = push.push(version)
            (args.dir / f"pushed-{version}").write_text(report.kind)


if __name__ == "__main__":
    main()
