"""`faircast-ds predict` at a real size: the CI-sized Qwen3-0.6B (2 layers, 187M parameters), real AdamW steps.

    nice -n 10 python3 benchmarks/predict_realsize.py                       # lr 1e-6, 1e-5, 1e-4; 45 min on 2 loaded cores
    nice -n 10 python3 benchmarks/predict_realsize.py --lrs 1e-5 --steps 2  # one lr
    ... --json out.json                                                     # the figures as one object as well

Memory: the training process peaks at ~6.8 GB (fp32 masters, AdamW moments, the bf16 copy), each
``faircast-ds predict`` child at ~1.5 GB. Not run by the test suite (too slow for a slow test on 2 cores).

One process, plain torch, no DeepSpeed. The model is ``faircast_bench.builders.real_causal_lm('qwen3-0.6b',
layers=2)`` (the published architecture at its published init, tied embeddings), built once in bf16 and
saved as a Hugging Face checkpoint (``save_pretrained``: safetensors): the user's bf16 checkpoint. Its
fp32 masters are then trained with ``torch.optim.AdamW`` (weight decay 0) on a tiny batch of random
tokens (2 x 16, a new batch each step, causal-LM loss), from two starts:

- **on the grid**: the masters are the bf16 weights themselves (an RL run from a bf16 checkpoint);
- **off the grid**: each master moved to a seeded uniform point inside its round-to-nearest cell (fp32
  bits = bf16 bits << 16 plus an offset in [-0x7FFF, 0x7FFF]; its RN cast is still the bf16 weight), as
  a checkpoint of fp32 masters mid-run has them; saved as an fp32 safetensors checkpoint too.

Measured after every step: the share of elements whose RN bf16 copy changed, with the RN cast made by
torch itself (``tensor.to(torch.bfloat16)``, bits compared), not by faircast_ds. Predicted by the
``faircast-ds predict --json`` command on the saved checkpoints (no moments there: the lr-only model):

- on the grid, step 1: RN changes the weights whose step reaches half a spacing, ``1 - share_below_half_spacing``
  (AdamW's first step is ``lr * g / (|g| + eps)``, so every weight moves by lr: the lr-only model's own
  assumption holds exactly here);
- on the grid, steps 1..N: ``predicted_changed_fraction_over_run`` (``--steps N``);
- off the grid, step 1 and steps 1..N: ``predicted_changed_fraction`` (``min(1, d/s)`` per step for a master
  anywhere in its cell);
- off the grid, step N+1: the moments model (``faircast_ds.tools.predict.adam_step`` on the optimizer's
  ``exp_avg``/``exp_avg_sq`` after step N, what the command computes from a DeepSpeed checkpoint's moments).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere: the repository's faircast_ds, not another install

ARCH, LAYERS = "qwen3-0.6b", 2


def offgrid_master(name: str, served: torch.Tensor, seed: int) -> torch.Tensor:
    """fp32 masters at seeded uniform points inside the RN cells of the bf16 ``served`` values (zeros stay)."""
    import hashlib

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:4], "little"))
    offset = torch.randint(-0x7FFF, 0x8000, served.shape, generator=gen, dtype=torch.int32)
    bits = served.view(torch.int16).to(torch.int32) << 16  # the bf16 value as fp32 bits (sign included)
    offset = torch.where(served == 0, torch.zeros_like(offset), offset)
    master = (bits + offset).view(torch.float32)
    assert torch.equal(master.to(torch.bfloat16).view(torch.int16), served.view(torch.int16)), name
    return master


def predict_cli(path: str, lr: float, steps: int) -> dict[str, Any]:
    """``faircast-ds predict PATH --lr LR --steps N --json`` in a child process (the installed command)."""
    cmd = [sys.executable, "-m", "faircast_ds.tools.cli", "predict", path, "--lr", repr(lr), "--steps",
           str(steps), "--json"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    report = json.loads(out.stdout)
    report["peak_rss_mib_children"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return report


def moments_prediction(model: torch.nn.Module, opt: torch.optim.Optimizer, lr: float) -> float:
    """RN's changed fraction per step that predict's moments model gives from the optimizer's state now."""
    from faircast_ds.casting.bits import bf16_spacing
    from faircast_ds.tools.predict import Tally, TensorState, adam_step

    total = Tally()
    b1, b2 = opt.param_groups[0]["betas"]
    eps = opt.param_groups[0]["eps"]
    chunk = 1 << 23  # the sums are additive: take the 155M-element embedding in slices, not whole in float64
    for name, p in model.named_parameters():
        st = opt.state[p]
        flat, avg, sq = p.detach().reshape(-1), st["exp_avg"].reshape(-1), st["exp_avg_sq"].reshape(-1)
        for lo in range(0, flat.numel(), chunk):
            part = slice(lo, lo + chunk)
            t = TensorState(name, flat[part], avg[part], sq[part], float(st["step"]))
            total.add(bf16_spacing(flat[part].bfloat16()).double(),
                      adam_step(t, flat[part].double(), lr, (b1, b2), eps, 0.0), None)
    return total.figures(None)["predicted_changed_fraction"]


def train(model: torch.nn.Module, start: dict[str, torch.Tensor], lr: float, steps: int, batch_seed: int,
          moments_before_last: bool) -> tuple[list[float], float | None]:
    """Set the masters to ``start``, take ``steps`` AdamW steps; per step the measured RN changed fraction
    (torch's own bf16 cast, bits compared). With ``moments_before_last``: also the moments model's
    prediction for the last step, made from the optimizer's state before it."""
    from faircast_bench.builders import token_ids

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(start[name])
    served = {n: p.detach().to(torch.bfloat16).view(torch.int16) for n, p in params.items()}
    numel = sum(p.numel() for p in params.values())
    opt = torch.optim.AdamW(params.values(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    vocab = model.config.vocab_size
    changed, predicted = [], None
    for t in range(1, steps + 1):
        if moments_before_last and t == steps:
            predicted = moments_prediction(model, opt, lr)
        ids = token_ids(batch=2, length=16, vocab=vocab, seed=batch_seed + t)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        n = 0
        with torch.no_grad():
            for name, p in params.items():
                now = p.detach().to(torch.bfloat16).view(torch.int16)
                n += int((now != served[name]).sum())
                served[name] = now
        changed.append(n / numel)
    del opt
    return changed, predicted


def run(lrs: list[float], steps: int, workdir: str, seed: int = 0) -> dict[str, Any]:
    from faircast_bench.builders import real_causal_lm

    started = time.time()
    model = real_causal_lm(ARCH, layers=LAYERS, seed=seed)  # bf16 parameters: the user's bf16 checkpoint
    numel = sum(p.numel() for p in model.parameters())
    ongrid_dir, offgrid_dir = os.path.join(workdir, "bf16"), os.path.join(workdir, "fp32-offgrid")
    model.save_pretrained(ongrid_dir)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}  # bf16
    model.float()  # fp32 masters, exactly on the bf16 grid
    off = {n: offgrid_master(n, v, seed) for n, v in init.items()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(off[n])
    model.save_pretrained(offgrid_dir)  # fp32 masters inside their cells
    rows, peak_child = [], 0.0
    for lr in lrs:
        on_pred = predict_cli(ongrid_dir, lr, steps)
        off_pred = predict_cli(offgrid_dir, lr, steps)
        on_meas, _ = train(model, {n: v.float() for n, v in init.items()}, lr, steps, 1000, False)
        off_meas, mom_pred = train(model, off, lr, steps + 1, 1000, True)
        rows.append({
            "lr": lr, "steps": steps,
            "ongrid_step1": {"predicted": 1 - on_pred["share_below_half_spacing"], "measured": on_meas[0]},
            "ongrid_run": {"predicted": on_pred["predicted_changed_fraction_over_run"],
                           "measured": sum(on_meas) / steps},
            "offgrid_step1": {"predicted": off_pred["predicted_changed_fraction"], "measured": off_meas[0]},
            "offgrid_run": {"predicted": off_pred["predicted_changed_fraction"], "measured": sum(off_meas[:steps]) / steps},
            "offgrid_next_moments": {"predicted": mom_pred, "measured": off_meas[steps]},
            "measured_per_step": {"ongrid": on_meas, "offgrid": off_meas},
            "predict_model": on_pred["model"], "predicted_delay_steps": on_pred["predicted_delay_steps"],
            "predicted_delay_peak_step": on_pred["predicted_delay_peak_step"],
        })
        peak_child = max(peak_child, on_pred["peak_rss_mib_children"], off_pred["peak_rss_mib_children"])
    return {"model": f"{ARCH}, {LAYERS} layers", "numel": numel, "seed": seed, "wall_s": time.time() - started,
            "rows": rows, "predict_peak_rss_mib": peak_child,
            "this_process_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


LABELS = {
    "ongrid_step1": ("on grid, step 1", "1 - share_below_half_spacing"),
    "ongrid_run": ("on grid, steps 1..N", "predicted_changed_fraction_over_run"),
    "offgrid_step1": ("off grid, step 1", "predicted_changed_fraction"),
    "offgrid_run": ("off grid, steps 1..N", "predicted_changed_fraction"),
    "offgrid_next_moments": ("off grid, step N+1", "moments model (after step N)"),
}


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['model']}: {result['numel']:,} parameters, AdamW (wd 0) on 2 x 16 random tokens per step, "
             f"N = {result['rows'][0]['steps']} steps; wall {result['wall_s']:.0f} s",
             f"peak memory: this process {result['this_process_peak_rss_mib']:.0f} MiB, the faircast-ds predict "
             f"command {result['predict_peak_rss_mib']:.0f} MiB (largest of its runs)",
             f"{'lr':>8}  {'what':<21} {'predicted by':<37} {'predicted':>10} {'measured':>10} {'pred/meas':>9}"]
    for row in result["rows"]:
        for key, (what, by) in LABELS.items():
            p, m = row[key]["predicted"], row[key]["measured"]
            ratio = f"{p / m:9.3f}" if m else "        —"
            lines.append(f"{row['lr']:>8g}  {what:<21} {by:<37} {100 * p:9.4f}% {100 * m:9.4f}% {ratio}")
        lines.append(f"{'':>8}  predicted delay from the bf16 checkpoint: {row['predicted_delay_steps']:.1f} steps "
                     f"(peak at step {row['predicted_delay_peak_step']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lrs", default="1e-6,1e-5,1e-4", help="comma-separated AdamW learning rates")
    parser.add_argument("--steps", type=int, default=3, help="N: steps per start (off the grid: N + 1)")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--keep", help="keep the two checkpoints in this folder (default: a temporary one)")
    args = parser.parse_args(argv)
    lrs = [float(x) for x in args.lrs.split(",")]
    if args.steps < 1 or not lrs or min(lrs) <= 0:
        parser.error("--steps must be >= 1 and every lr > 0")
    workdir = args.keep or tempfile.mkdtemp(prefix="predict-realsize-")
    try:
        result = run(lrs, args.steps, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
