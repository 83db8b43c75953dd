"""Issue 32 item 4: a delta push into ``vllm serve`` with the engine writing the update in place
(``ServedPush(inplace=True)``, the default) against the same pushes loaded through vLLM's reload
(``inplace=False``), side by side on one server, interleaved.

The model has Qwen3-0.6B's widths and vocabulary (hidden 1,024, 3,072 MLP, 16/8 heads of 128, 151,936
tokens, untied head) at ``--layers`` layers; it is a plain bf16 module in this process (no DeepSpeed: the
engine side is what differs). Each round runs, for each setting, one push session: a dense push, then
one delta per ``--shares`` value, after ``share`` of every tensor's elements moved one bf16 spacing (what
one RL step at lr 1e-6 does to a few percent of them), each verified by the engine's sampled check. A
delta lists its changed elements (a change list) below 1/32 of a tensor and sends a bitmap above; the
engine writes in place only what was listed. Prints, per setting and share, the median over rounds of
the whole push and of the engine's load (its account: ``load_seconds``, of which ``inplace_seconds`` and
``reload_seconds``), and the ratios.

    python benchmarks/inplace_push.py [--layers 2] [--plane tcp] [--rounds 2] [--shares 0.003 0.01 0.03 0.1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(layers: int):
    from faircast_bench.builders import tiny_causal_lm

    return tiny_causal_lm("qwen3", seed=0, init_std=0.02, norm_jitter=0.2, vocab_size=151936, hidden_size=1024,
                          intermediate_size=3072, num_hidden_layers=layers, num_attention_heads=16,
                          num_key_value_heads=8, head_dim=128, max_position_embeddings=64,
                          tie_word_embeddings=False).eval()


def step(model, share: float, seed: int) -> int:
    """Move ``share`` of every tensor's elements one bf16 spacing; the number moved."""
    g = torch.Generator().manual_seed(seed)
    moved = 0
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=g) < share
            p.view(torch.int16)[mask] += 1
            moved += int(mask.sum())
    return moved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--plane", choices=("tcp", "shm", "net"), default="tcp",
                    help="tcp lists the changed elements; shm and net name only the changed parameters")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shares", type=float, nargs="+", default=[0.003, 0.01, 0.03, 0.1])
    args = ap.parse_args()
    os.environ.setdefault("FAIRCAST_DS_SYNC_SECRET", "faircast-ds in-place push benchmark secret 0123")
    from faircast_ds.export import save_hf
    from faircast_ds.vllm.transfer import ServedPush, VllmServer

    model = build(args.layers)
    numel = sum(p.numel() for p in model.parameters())
    work = Path(tempfile.mkdtemp(prefix="inplace-push-"))
    save_hf(model, work / "export", version=0)
    rows: dict[tuple[bool, float], list[dict]] = {(i, share): [] for i in (True, False) for share in args.shares}
    version = 0
    with VllmServer(work / "export", max_model_len=64, log_path=work / "server.log", worker_extension=True) as server:
        for r in range(args.rounds):
            for inplace in ((True, False) if r % 2 == 0 else (False, True)):
                push = ServedPush(model, server, plane=args.plane, inplace=inplace)
                try:
                    version += 1
                    push.push(version, kind="dense")
                    for share in args.shares:
                        moved = step(model, share, seed=version)
                        version += 1
                        rep = push.push(version)
                        engine = server.engine_report()
                        assert rep.kind == "delta" and rep.verified, rep
                        rows[(inplace, share)].append({"push": rep.seconds, "moved": moved, **engine,
                                                       **{f"stage {k}": v for k, v in (rep.stages or {}).items()}})
                        print(f"round {r + 1} inplace={inplace} {share:.1%} moved: push {rep.seconds:.3f} s, engine load "
                              f"{engine['load_seconds']:.3f} s (in place {engine.get('inplace', 0)} tensors "
                              f"{engine.get('inplace_seconds', 0.0):.3f} s, vLLM reload {engine.get('reloaded', 0)} "
                              f"tensors {engine.get('reload_seconds', 0.0):.3f} s), check "
                              f"{engine.get('check_seconds', 0.0):.3f} s", flush=True)
                finally:
                    push.close()

    def med(key: tuple[bool, float], field: str) -> float:
        return statistics.median(float(x.get(field, 0.0)) for x in rows[key])

    print(f"\n{numel:,} parameters ({args.layers} layers at Qwen3-0.6B's widths, untied head), plane {args.plane}, "
          f"{args.rounds} rounds per setting, each delta verified (sampled); medians")
    print(f"{'moved':>6} {'engine load':<20} {'push s':>7} {'load s':>7} {'in place s':>10} {'reload s':>9} "
          f"{'probe s':>8} {'check s':>8} {'in place/reloaded':>18} {'x reload: push':>15} {'load':>6}")
    for share in args.shares:
        for inplace, label in ((True, "in place (default)"), (False, "vLLM's reload")):
            k, base = (inplace, share), (False, share)
            print(f"{share:>6.1%} {label:<20} {med(k, 'push'):>7.3f} {med(k, 'load_seconds'):>7.3f} "
                  f"{med(k, 'inplace_seconds'):>10.3f} {med(k, 'reload_seconds'):>9.3f} {med(k, 'probe_seconds'):>8.3f} "
                  f"{med(k, 'check_seconds'):>8.3f} {int(med(k, 'inplace')):>9}/{int(med(k, 'reloaded')):<8} "
                  f"{med(k, 'push') / med(base, 'push'):>15.2f} {med(k, 'load_seconds') / med(base, 'load_seconds'):>6.2f}")
    # where an in-place push's seconds go, by the push's own stages (faircast_ds.export.source.Stages; they overlap:
    # the HTTP update call waits while the trainer walks and sends)
    keys = [(True, share) for share in args.shares]
    stages = sorted({f for k in keys for x in rows[k] for f in x if f.startswith("stage ")},
                    key=lambda f: -max(med(k, f) for k in keys))
    print(f"\nin place: median seconds per stage of the push\n{'stage':<34}" +
          "".join(f"{share:>9.1%}" for share in args.shares))
    for f in stages:
        print(f"{f[6:]:<34}" + "".join(f"{med(k, f):>9.3f}" for k in keys))


if __name__ == "__main__":
    main()
