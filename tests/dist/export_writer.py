"""Writes one export of a small bf16 model (a plain process, no DeepSpeed) for the atomic-export tests.

`--pause data` stops (prints PAUSED, sleeps) after the first tensor of the second weight file is
written; `--pause publish` stops after every file is written and fsynced, just before the rename.
The test SIGKILLs the process while it sleeps there."""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export_common import plain_model  # noqa: E402

from faircast_ds.export import atomic, hf, safetensors_stream  # noqa: E402


def pause() -> None:
    print("PAUSED", flush=True)
    time.sleep(120)  # the test kills us here
    raise SystemExit("not killed")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--pause", choices=("none", "data", "publish"), default="none")
    args = ap.parse_args()
    model = plain_model(seed=args.seed)
    if args.pause == "data":
        write = safetensors_stream.SafetensorsFile.write
        opened = []

        def slow_write(self, name, tensor):
            if self.path not in opened:
                opened.append(self.path)
            write(self, name, tensor)
            if len(opened) == 2:
                pause()

        safetensors_stream.SafetensorsFile.write = slow_write
    elif args.pause == "publish":
        fsync_tree = atomic.fsync_tree

        def fsync_then_pause(root):
            fsync_tree(root)
            pause()

        atomic.fsync_tree = fsync_then_pause
    result = hf.save_hf(model, args.target, max_shard_bytes=20_000, version=args.seed)
    print("DONE", sorted(result.files), flush=True)


if __name__ == "__main__":
    main()
