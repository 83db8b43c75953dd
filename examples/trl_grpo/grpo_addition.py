"""GRPO with TRL on SmolLM2-135M-Instruct, Fair Cast on from the DeepSpeed JSON alone.

    accelerate launch --config_file examples/trl_grpo/accelerate_2ranks.yaml examples/trl_grpo/grpo_addition.py

What Fair Cast needs is in the configs, not here: the Accelerate config names the DeepSpeed JSON
(``deepspeed_config_file``), whose ``fair_cast`` section attaches the cast to TRL's policy engine. This
script adds two things of ours: ``FairCastCallback`` (Fair Cast's changed fraction, gap and lag in TRL's
own logs) and, with ``--vllm colocate``, ``install_trl_sync`` (TRL's colocated vLLM engine loaded through
the engine's reload path and read back through its kernels after every sync; TRL's own sync cannot load
into vLLM's CPU build). The rest is a plain TRL script: the addition task of docs/pretrained.md as a TRL
reward function, the model by its local folder (TRL builds its vLLM engine from ``model.name_or_path``).

On a CPU without bf16 arithmetic (no AVX-512 BF16 or AMX), PyTorch's and vLLM's bf16 matrix products take a
generic loop 5-20x slower than fp32 products of the same values: ``--gemm fp32`` (the default without a GPU)
computes them, in the trainer and in the colocated engine, as fp32 sums of the bf16 values rounded once, the
arithmetic of a GPU's bf16 GEMM. The served weights do not change; the sampled tokens may.

CPU-only lines, marked below: transformers refuses ``bf16=True`` without a GPU unless ``use_cpu=True``,
which turns DeepSpeed off; and Accelerate, under DeepSpeed on a machine without an accelerator, records no
process-group backend and then counts one process on every rank (``ddp_backend="gloo"`` names it).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re

import torch

PROMPT = "What is {a} + {b}?"  # the addition task of faircast_jobs/addition.py (docs/pretrained.md)
_INTEGER = re.compile(r"-?\d+")


def addition_reward(completions: list, answer: list[int], **_: object) -> list[float]:
    """1.0 when the last integer of the assistant's answer is the sum, else 0.0 (TRL passes the dataset's
    ``answer`` column; a conversational completion is a list with the assistant's message)."""
    rewards = []
    for completion, total in zip(completions, answer):
        text = completion[0]["content"] if isinstance(completion, list) else str(completion)
        numbers = _INTEGER.findall(text)
        rewards.append(1.0 if numbers and int(numbers[-1]) == int(total) else 0.0)
    return rewards


def addition_dataset(count: int, seed: int, low: int = 1, high: int = 9):
    """``count`` one-turn prompts "What is a + b?" with a, b uniform in [low, high], and their sums."""
    from datasets import Dataset

    draw = random.Random(seed)
    pairs = [(draw.randint(low, high), draw.randint(low, high)) for _ in range(count)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": PROMPT.format(a=a, b=b)}] for a, b in pairs],
                              "answer": [a + b for a, b in pairs]})


def model_folder(name: str) -> str:
    """A local folder as it is; a model name of faircast-ds (``smollm2-135m-instruct``) as its cached bf16
    folder, built once from the installed GGUF file (faircast_ds.models.pretrained)."""
    if os.path.isdir(name):
        return name
    from faircast_ds.models.pretrained import checkpoint

    return str(checkpoint(name))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="a local HF folder or smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm", choices=("off", "colocate"), default="colocate",
                   help="roll out from a vLLM engine in each training process, or from the trainer's model")
    p.add_argument("--load", choices=("reload", "trl"), default="reload",
                   help="colocate: load through the engine's reload path, or TRL's own load_weights (GPUs only)")
    p.add_argument("--verify-every", type=int, default=1,
                   help="read the engine's kernels back after every Nth sync (0: never)")
    p.add_argument("--gemm", choices=("auto", "native", "fp32"), default="auto",
                   help="bf16 matrix products of the trainer and the colocated engine: fp32 sums of the bf16 values "
                        "rounded once (a CPU without bf16 arithmetic is 5-20x faster so), or PyTorch's and vLLM's "
                        "own; auto: fp32 without a GPU, native with one")
    p.add_argument("--output", default="runs/trl_grpo_addition")
    p.add_argument("--save-every", type=int, default=10,
                   help="a checkpoint (TRL's, with DeepSpeed's and Fair Cast's state) every N steps, the newest kept "
                        "(0: none)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint-* in --output (start afresh when there is none)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.save_every < 0 or args.verify_every < 0:
        p.error(f"--steps must be >= 1 and --save-every, --verify-every >= 0 (got {args.steps}, {args.save_every}, "
                f"{args.verify_every})")
    return args


def newest_checkpoint(output: str) -> str | None:
    """The checkpoint-<step> folder of ``output`` with the highest step whose trainer state was written (TRL writes
    it last: a folder without it was cut off mid-save and is passed over), or None."""
    if not os.path.isdir(output):
        return None
    steps = sorted((int(m[1]), name) for name in os.listdir(output) if (m := re.fullmatch(r"checkpoint-(\d+)", name)))
    for _, name in reversed(steps):
        if os.path.exists(os.path.join(output, name, "trainer_state.json")):
            return os.path.join(output, name)
    return None


ROW_KEYS = ("step", "reward", "reward_std", "step_time", "sampling/importance_sampling_ratio/min",
            "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/max",
            "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
            "fair_cast/changed_fraction", "fair_cast/gap_spacings", "fair_cast/lag_steps")


def rows_path(output: str) -> str:
    """Where a run's per-step rows live: ``<output>/steps.jsonl``."""
    return os.path.join(output, "steps.jsonl")


def write_rows(output: str, log_history: list[dict]) -> str:
    """TRL's per-step log rows (``ROW_KEYS``, those present) as ``<output>/steps.jsonl``, written whole (a
    resumed run's history comes back from its checkpoint, so rows after the last checkpoint are logged again
    rather than twice); atomic (a killed write leaves the previous file)."""
    path = rows_path(output)
    os.makedirs(output, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        for row in log_history:
            if "reward" in row:  # a training step's row (the last row is the run's summary)
                f.write(json.dumps({k: row[k] for k in ROW_KEYS if k in row}) + "\n")
    os.replace(path + ".tmp", path)
    return path


def RowsFile(output: str):
    """A TRL callback that rewrites ``<output>/steps.jsonl`` (``write_rows``) after every logged step on the main
    process, so a run stopped between checkpoints leaves its rows so far."""
    from transformers import TrainerCallback

    class _RowsFile(TrainerCallback):
        def on_log(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                write_rows(output, state.log_history)

    return _RowsFile()


def build_trainer(args: argparse.Namespace, *, rewards: tuple = (), callbacks: tuple = ()):
    """TRL's GRPOTrainer as this recipe configures it (``rewards``, ``callbacks``: more of each, for a test)."""
    gemm = args.gemm if args.gemm != "auto" else ("native" if torch.cuda.is_available() else "fp32")
    if gemm == "fp32":  # read by faircast's vLLM plugin when TRL builds its engine (faircast_ds/vllm/cpu_gemm.py)
        os.environ["FAIRCAST_VLLM_CPU_GEMM"] = "fp32"
    if not torch.cuda.is_available():  # CPU only: bf16 on DeepSpeed without use_cpu (which turns DeepSpeed off)
        import transformers.training_args

        transformers.training_args.is_torch_bf16_gpu_available = lambda: True
        # vLLM's CPU build: the KV cache in whole GiB per engine; no warm-up forward of TRL's 4096-token batch
        # (it sizes nothing when the KV cache is given) and dynamo's eager backend rather than inductor's
        # compile; no thread pinning (the trainer shares the cores)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from trl import GRPOConfig, GRPOTrainer

    from faircast_ds.transformers import FairCastCallback

    config = GRPOConfig(
        output_dir=args.output, max_steps=args.steps, learning_rate=args.lr, seed=args.seed,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=16, temperature=1.0,
        bf16=True, logging_steps=1, report_to=[], dataloader_num_workers=0,
        save_strategy="steps" if args.save_every else "no", save_steps=args.save_every or 500, save_total_limit=1,
        use_vllm=args.vllm == "colocate", vllm_mode="colocate", vllm_max_model_length=256,
        ddp_backend=None if torch.cuda.is_available() else "gloo",  # CPU only: see the docstring
    )
    trainer = GRPOTrainer(model=model_folder(args.model), reward_funcs=[addition_reward, *rewards], args=config,
                          train_dataset=addition_dataset(max(64, 8 * args.steps), seed=args.seed),
                          callbacks=[FairCastCallback(), *callbacks])
    if gemm == "fp32":  # the policy's bf16 linear layers multiply in fp32 and round once (faircast_ds/models/gemm.py)
        from faircast_ds.models.gemm import use_fp32_accumulation

        routed = use_fp32_accumulation(trainer.model)
        print(f"[grpo_addition] --gemm fp32: {routed} bf16 linear layers of the policy multiply in fp32", flush=True)
    if config.use_vllm:
        from faircast_ds.vllm import install_trl_sync

        install_trl_sync(trainer, load=args.load, verify=args.verify_every)
    return trainer


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    start = newest_checkpoint(args.output) if args.resume else None
    trainer = build_trainer(args, callbacks=(RowsFile(args.output),))
    if trainer.accelerator.is_main_process:
        print(f"[grpo_addition] {'resuming from ' + start if start else 'starting at step 0'}", flush=True)
    trainer.train(resume_from_checkpoint=start)
    if trainer.accelerator.is_main_process:
        for row in trainer.state.log_history:
            print(json.dumps({k: row[k] for k in ROW_KEYS if k in row}), flush=True)
        print(f"[grpo_addition] rows: {rows_path(args.output)}", flush=True)  # written by RowsFile
        sync = getattr(trainer.vllm_generation.sync_weights, "__self__", None) if trainer.args.use_vllm else None
        for record in getattr(sync, "history", []):  # install_trl_sync's account of each sync
            print(json.dumps({"sync": record}), flush=True)


if __name__ == "__main__":
    main()
