"""The inference side of the weight-sync tests: a plain process (not in the training job) with its
own Hugging Face model, started by the test. It accepts `--sessions` senders one after another;
after every applied update it records the weights' digest and the greedy tokens its model now
generates, and after every failure what it reported. Writes its port to `--port-file` first."""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export_common import append_jsonl, digest, greedy  # noqa: E402
from faircast_bench.builders import tiny_qwen3  # noqa: E402  (as from_pretrained(dtype=bfloat16) builds it)

from faircast_ds.export import WeightReceiver, WeightSyncError  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--sessions", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--allow-rollback", action="store_true", help="each session is a new trainer starting at step 0")
    args = ap.parse_args()
    model = tiny_qwen3(seed=99).eval()  # not the trainer's weights: everything it serves must arrive
    append_jsonl(args.log, {"initial_tokens": greedy(model), "initial_digest": digest(model.named_parameters())})
    rx = WeightReceiver(model, host="127.0.0.1", port=0, timeout=args.timeout,
                        allow_rollback=args.allow_rollback)
    with open(args.port_file + ".tmp", "w") as f:
        f.write(str(rx.port))
    os.replace(args.port_file + ".tmp", args.port_file)
    for session in range(args.sessions):
        try:
            rx.accept(timeout=args.timeout)
            while True:
                t0 = time.perf_counter()
                report = rx.receive(timeout=args.timeout)
                if report is None:
                    break
                with rx.lock:
                    record = {"session": session, "version": report.version, "kind": report.kind,
                              "bytes": report.bytes, "changed": report.changed, "params": report.params,
                              "receive_s": time.perf_counter() - t0,
                              "digest": digest(model.named_parameters()), "tokens": greedy(model)}
                append_jsonl(args.log, record)
        except WeightSyncError as exc:
            append_jsonl(args.log, {"session": session, "error": type(exc).__name__, "message": str(exc),
                                    "version": rx.version})
    rx.close()
    append_jsonl(args.log, {"done": True})


if __name__ == "__main__":
    main()
