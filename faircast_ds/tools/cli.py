"""The ``faircast-ds`` command."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys


def _check(args: argparse.Namespace) -> int:
    from faircast_ds.deepspeed import check as preflight

    return preflight.run(args.config)


def _to_universal(args: argparse.Namespace) -> int:
    """DeepSpeed's universal-checkpoint conversion, carrying Fair Cast's state along. Our state is
    already keyed by (parameter, index), so it is copied as is and re-sharded when loaded."""
    from faircast_ds.shard.state import STATE_DIR, state_dir

    source = state_dir(args.input_folder)
    if not os.path.isdir(source):
        print(f"error: {source} does not exist: {args.input_folder} has no Fair Cast state", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", args.input_folder,
           "--output_folder", args.output_folder, "--num_extract_workers", "1", "--num_merge_workers", "1",
           # ZeRO-1/2 checkpoints of plain data parallelism carry no universal_checkpoint_info (Megatron-DeepSpeed
           # writes it); without it ds_to_universal stops, with the default one (no TP patterns) it converts
           "--inject_missing_state"]
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        return proc.returncode
    target = os.path.join(args.output_folder, STATE_DIR)
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    print(f"copied Fair Cast state {source} -> {target}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from faircast_ds.deepspeed.masters import reader
    from faircast_ds.tools.inspect import main as inspect_main

    return inspect_main(args.path, args.checkpoint, args.by, args.json, masters=reader)


def _predict(args: argparse.Namespace) -> int:
    from faircast_ds.tools.predict import AdamSettings, PredictError, parse_betas
    from faircast_ds.tools.predict import main as predict_main

    try:
        settings = AdamSettings(lr=args.lr, betas=parse_betas(args.betas) if args.betas is not None else None,
                                eps=args.eps, weight_decay=args.weight_decay)
    except PredictError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return predict_main(args.checkpoint, settings, args.json, args.steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="faircast-ds", description="Fair Cast for DeepSpeed")
    sub = parser.add_subparsers(dest="command", required=True)
    chk = sub.add_parser("check", help="pre-flight before a long job: the interpreter-start hook, the DeepSpeed release, "
                                       "the fused kernel, where the fair_cast section comes from, and every error "
                                       "initialize would raise about it; exit status 0 when nothing would stop it")
    chk.add_argument("config", nargs="?", help="the DeepSpeed JSON config the job will use (optional)")
    uni = sub.add_parser("to-universal", help="convert a checkpoint tag folder to DeepSpeed's universal format, "
                                              "Fair Cast state included (to resume at another world size)")
    uni.add_argument("input_folder", help="a checkpoint tag folder, e.g. ckpt/global_step100")
    uni.add_argument("output_folder", help="e.g. ckpt/global_step100_universal")
    insp = sub.add_parser("inspect", help="summarize a checkpoint tag folder's Fair Cast state or an export "
                                           "directory, per parameter group")
    insp.add_argument("path", help="a checkpoint tag folder (with fair_cast/) or an export directory (*.safetensors)")
    insp.add_argument("--checkpoint", help="with an export: the checkpoint tag folder of the same step, to report "
                                           "mean |master - served| in bf16 spacings")
    insp.add_argument("--by", choices=("type", "layer", "param"), default="type",
                      help="group parameters by module type (layer index folded), by layer, or not at all")
    insp.add_argument("--json", action="store_true", help="print the report as JSON")
    pred = sub.add_parser("predict", help="from a checkpoint (HF safetensors or a DeepSpeed ZeRO tag folder) and a "
                                          "learning rate: the share of weights whose AdamW step is below half a bf16 "
                                          "spacing, RN's predicted changed fraction per step and delay, and whether "
                                          "Fair Cast will matter (docs/predict.md)")
    pred.add_argument("checkpoint", help="a safetensors file or directory, or a DeepSpeed checkpoint (tag folder, "
                                         "or save dir with a 'latest' file)")
    pred.add_argument("--lr", type=float, required=True, help="the AdamW learning rate of the run to predict")
    pred.add_argument("--betas", help="B1,B2 (default: the checkpoint's, else 0.9,0.999)")
    pred.add_argument("--eps", type=float, help="AdamW eps (default: the checkpoint's, else 1e-8)")
    pred.add_argument("--weight-decay", type=float, help="decoupled weight decay (default: the checkpoint's, else 0)")
    pred.add_argument("--steps", type=int, help="also predict the mean lag and changed fraction over a run this long")
    pred.add_argument("--json", action="store_true", help="print one JSON object")
    sub.add_parser("bench", help="moved: the benchmarks run from a clone of the repository "
                                 "(python3 -m faircast_bench, docs/performance.md)", add_help=False)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its arguments are the moved command's, not this parser's
        command = " ".join(["python3 -m faircast_bench", *argv[1:]])
        print(f"error: `faircast-ds bench` moved out of the installed package: from a clone of the repository, "
              f"run `{command}` (docs/performance.md)", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command == "check":
        return _check(args)
    if args.command == "to-universal":
        return _to_universal(args)
    if args.command == "inspect":
        return _inspect(args)
    if args.command == "predict":
        return _predict(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
