"""A trainer stand-in for the weight-sync failure tests: a plain process (no DeepSpeed) that sends the
small model's weights to a receiver, then exits or misbehaves on request.

  --versions 1,2,3      sync these versions in order (the model changes a little between them)
  --pause-in V          during version V, stop after sending 5 parameters (print PAUSED, sleep):
                        the test SIGKILLs or SIGSTOPs us there
  --intermediate N      build a model of another shape (a mismatched sender)
Prints one JSON line per acknowledged sync with the digest of the weights it sent."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export_common import digest, plain_model  # noqa: E402

from faircast_ds.export import WeightSender, WeightSyncError  # noqa: E402
from faircast_ds.export.channel import Channel  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--versions", default="1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pause-in", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=30)
    args = ap.parse_args()
    model = plain_model(seed=args.seed, intermediate=args.intermediate)
    sender = WeightSender(model, host="127.0.0.1", port=args.port, timeout=args.timeout)
    current = {"version": None, "params": 0}
    send_tensor = Channel.send_tensor

    def counting_send(self, t):
        if t.dtype == torch.int64 and t.numel() == 3 and int(t[0]) >= 0:  # a parameter's header
            current["params"] += 1
            if current["version"] == args.pause_in and current["params"] > 5:
                print("PAUSED", flush=True)
                time.sleep(120)  # killed or stopped by the test here
        send_tensor(self, t)

    Channel.send_tensor = counting_send
    g = torch.Generator().manual_seed(args.seed)
    try:
        for i, version in enumerate(int(v) for v in args.versions.split(",")):
            if i:
                with torch.no_grad():  # a training step's worth of change
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 1e-2)
            current.update(version=version, params=0)
            report = sender.sync(version=version)
            print(json.dumps({"version": version, "kind": report.kind, "digest": digest(model.named_parameters())}),
                  flush=True)
    except WeightSyncError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        sys.exit(3)
    sender.close()


if __name__ == "__main__":
    main()
