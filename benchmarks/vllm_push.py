"""Push times into a separate vLLM engine process, on the same model: the `faircast` weight-transfer backend
into `vllm serve` (faircast_ds.vllm.transfer: vLLM's HTTP endpoints + the data
plane, the engine's check inside finish) against the push it replaces, faircast_ds.vllm.remote (its own engine server and control
protocol; only in commits before its removal), when that module is importable.

    python benchmarks/vllm_push.py [--hidden 256 --layers 4 --vocab 2048 --repeats 3 --planes shm net]

Prints one line per push and update kind (dense; a delta of 4 changed elements; a push with nothing
changed): median seconds of the whole push (verification included), bytes on the channel, HTTP calls and
collectives, then the median seconds of each stage (faircast_ds.export.source.Stages; stages overlap, e.g. the
HTTP update call waits while the trainer streams, so they do not sum to the push). One process, no DeepSpeed (an nn.Module); each push starts its own engine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def model_of(args):
    from faircast_bench.builders import tiny_causal_lm

    return tiny_causal_lm("qwen3", seed=0, init_std=0.3, norm_jitter=0.2, vocab_size=args.vocab,
                          hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                          num_attention_heads=args.hidden // 32, num_key_value_heads=max(1, args.hidden // 64),
                          head_dim=32, max_position_embeddings=64, tie_word_embeddings=False).eval()


def nudge(model, k: int) -> None:
    with torch.no_grad():
        model.model.layers[-1].mlp.up_proj.weight[0, 4 * k:4 * k + 4] += 0.25


def timed(push, model, repeats: int) -> dict[str, list]:
    """Per repeat: a dense push, 4 changed elements (delta), nothing changed; each verified by default."""
    out = {"dense": [], "delta": [], "nothing": []}
    for k in range(repeats):
        r = push(version=100 + 3 * k, kind="dense")
        out["dense"].append(r)
        nudge(model, k)
        out["delta"].append(push(version=101 + 3 * k, kind="delta"))
        out["nothing"].append(push(version=102 + 3 * k, kind="auto"))
    return out


def report(route: str, results: dict[str, list], numel: int) -> None:
    for kind, rows in results.items():
        med = statistics.median(r.seconds for r in rows)
        print(f"{route:<34} {kind:<7}  median {med * 1e3:8.1f} ms  {rows[0].bytes:>10,} bytes  "
              f"{getattr(rows[0], 'http_calls', '?')} HTTP calls, {getattr(rows[0], 'collectives', '?')} collectives  "
              f"({len(rows)} pushes, {numel:,} parameters)", flush=True)
        stages = getattr(rows[0], "stages", None)
        if stages:
            names = sorted({n for r in rows for n in r.stages}, key=lambda n: -statistics.median(
                r.stages.get(n, 0.0) for r in rows))
            for n in names:
                s = statistics.median(r.stages.get(n, 0.0) for r in rows)
                print(f"    {n:<28} {s * 1e3:8.1f} ms  {s / med:6.1%}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--planes", nargs="+", choices=("shm", "net"), default=["shm", "net"],
                    help="the faircast backend's data planes to time, one after the other on one server")
    ap.add_argument("--skip-remote", action="store_true", help="do not try the removed faircast_ds.vllm.remote")
    args = ap.parse_args()
    os.environ.setdefault("FAIRCAST_DS_SYNC_SECRET", "faircast-ds vllm push benchmark secret 0123")
    from faircast_ds.export import save_hf

    model = model_of(args)
    numel = sum(p.numel() for p in model.parameters())
    work = Path(tempfile.mkdtemp(prefix="vllm-push-"))
    save_hf(model, work / "export", version=0)

    from faircast_ds.vllm.transfer import ServedPush, VllmServer

    with VllmServer(work / "export", max_model_len=64, log_path=work / "server.log") as server:
        if "shm" in args.planes:
            push = ServedPush(model, server, plane="shm")
            report("faircast backend, shared memory", timed(push.push, model, args.repeats), numel)
            push.close()
        if "net" in args.planes:
            push = ServedPush(model, server, plane="net")
            report("faircast backend, net plane (loopback)", timed(push.push, model, args.repeats), numel)
            push.close()
    if args.skip_remote:
        return

    try:
        from faircast_ds.vllm.remote import RemoteEngine
    except ImportError:
        print("faircast_ds.vllm.remote: not in this commit (removed); run this script at an earlier commit for it")
        return
    from faircast_ds.export.channel import free_port

    port, control = free_port(), free_port()
    with open(work / "remote.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "faircast_ds.vllm.remote", str(work / "export"), "--port",
                                 str(port), "--control-port", str(control), "--max-model-len", "64",
                                 "--kv-cache-gib", str(1 / 16)], stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)))
        try:
            remote = RemoteEngine(model, port=port, control_port=control, timeout=600)

            def push_remote(version, kind):
                began = time.perf_counter()
                r = remote.push(version=version) if kind == "delta" else _dense(remote, version)
                return type("R", (), {"seconds": time.perf_counter() - began, "bytes": r.bytes, "stages": {}})

            report("faircast_ds.vllm.remote (old)", timed(push_remote, model, args.repeats), numel)
            remote.close(shutdown=True)
            proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()


def _dense(remote, version):
    remote.sender.close()  # a new session: the sync is dense
    return remote.push(version=version)


if __name__ == "__main__":
    main()
