"""Push times into a separate vLLM engine process, on the same model: the `faircast` weight-transfer backend
into `vllm serve` (faircast_ds.vllm.transfer: vLLM's HTTP routes + the authenticated channel + vLLM's
/weight_checker) against the route it replaces, faircast_ds.vllm.remote (its own engine server and control
protocol; only in commits before its removal), when that module is importable.

    python benchmarks/vllm_push.py [--hidden 256 --layers 4 --vocab 2048 --repeats 3]

Prints one line per route and update kind: median seconds of the whole push (verification included) and
bytes on the channel. One process, no DeepSpeed (an nn.Module); each route starts its own engine.
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
    from faircast_ds.models.builders import tiny_causal_lm

    return tiny_causal_lm("qwen3", seed=0, init_std=0.3, norm_jitter=0.2, vocab_size=args.vocab,
                          hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                          num_attention_heads=args.hidden // 32, num_key_value_heads=max(1, args.hidden // 64),
                          head_dim=32, max_position_embeddings=64, tie_word_embeddings=False).eval()


def nudge(model, k: int) -> None:
    with torch.no_grad():
        model.model.layers[-1].mlp.up_proj.weight[0, 4 * k:4 * k + 4] += 0.25


def timed(push, model, repeats: int) -> dict[str, list]:
    out = {"dense": [], "delta": []}
    for k in range(repeats):
        r = push(version=100 + 2 * k, kind="dense")
        out["dense"].append((r.seconds, r.bytes))
        nudge(model, k)
        r = push(version=101 + 2 * k, kind="delta")
        out["delta"].append((r.seconds, r.bytes))
    return out


def report(route: str, results: dict[str, list], numel: int) -> None:
    for kind, rows in results.items():
        print(f"{route:<34} {kind:<5}  median {statistics.median(s for s, _ in rows) * 1e3:8.1f} ms  "
              f"{rows[0][1]:>10,} bytes  ({len(rows)} pushes, {numel:,} parameters)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("FAIRCAST_DS_SYNC_SECRET", "faircast-ds vllm push benchmark secret 0123")
    from faircast_ds.export import save_hf

    model = model_of(args)
    numel = sum(p.numel() for p in model.parameters())
    work = Path(tempfile.mkdtemp(prefix="vllm-push-"))
    save_hf(model, work / "export", version=0)

    from faircast_ds.vllm.transfer.server import ServedPush, VllmServer

    with VllmServer(work / "export", max_model_len=64, log_path=work / "server.log") as server:
        push = ServedPush(model, server)
        report("faircast backend (vllm serve)", timed(push.push, model, args.repeats), numel)
        push.close()

    try:
        from faircast_ds.vllm.remote import RemoteEngine
    except ImportError:
        print("faircast_ds.vllm.remote: not in this commit (removed); run this script at an earlier commit for it")
        return
    from faircast_ds.vllm.transfer.trainer import free_port

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
                return type("R", (), {"seconds": time.perf_counter() - began, "bytes": r.bytes})

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
