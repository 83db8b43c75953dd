"""The TRL recipe (examples/trl_grpo/) as CI runs it: under ``accelerate launch`` with the recipe's own
Accelerate config and DeepSpeed JSON, 2 CPU ranks, TRL's ``vllm_mode="colocate"`` with
``install_trl_sync``, for tests/transformers_tests/test_trl_colocate.py.

The model is a SmolLM2-shaped tiny Llama (tied embeddings, SmolLM2's tokenizer and chat template) the test
writes to a folder (``--model``); the recipe's addition reward is joined by a length reward (a tiny random model
never adds right, and a reward without variance in a group gives no gradient, so no master would move).

Records, through DeepSpeed's, vLLM's and torch's own interfaces (never Fair Cast's): on every rank, after
each of TRL's syncs, the trainer's step and every weight this rank's engine computes with, read back by this
script's own code (:func:`engine_weights`: a linear layer and the LM head applied to identity rows through
their own ``quant_method``, the embedding looked up for every id, other parameters as tensors); on rank 0,
after each optimizer step, the fp32 masters and served bits (tests/dist/served_record.py), and the
Trainer's log history. Files: OUT_DIR/trl_colocate_rank{r}.pt and OUT_DIR/trl_colocate.json (rank 0).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

STARTED = time.time()  # before the imports: what a launch spends, phase by phase, goes to the JSON

import torch
import trl  # noqa: F401  (missing TRL fails the launch, and so the test)
import vllm  # noqa: F401  (missing vLLM fails the launch, and so the test)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "examples" / "trl_grpo"))
import grpo_addition as recipe  # noqa: E402
from common import finish_and_exit, write_json  # noqa: E402
from served_record import snapshot  # noqa: E402

def length_reward(completions: list, **_: object) -> list[float]:
    """The answer's length in characters / 100: variance within a group, so the loss has a gradient."""
    return [len(c[0]["content"] if isinstance(c, list) else str(c)) / 100 for c in completions]


def engine_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight ``model`` (a vLLM model) computes with, by vLLM parameter name, as int16 bits."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    out: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for path, module in model.named_modules():
            own = dict(module.named_parameters(recurse=False))
            if isinstance(module, (LinearBase, ParallelLMHead)):
                width = module.input_size_per_partition if isinstance(module, LinearBase) else module.embedding_dim
                eye = torch.eye(width, dtype=torch.bfloat16)
                w = module.quant_method.apply(module, eye).t().contiguous()  # [out, in]: no bias applied
                vocab = getattr(module, "org_vocab_size", None)
                out[f"{path}.weight"] = (w[:vocab] if vocab else w).view(torch.int16).clone()
                own.pop("weight", None)
            elif isinstance(module, VocabParallelEmbedding):
                ids = torch.arange(module.org_vocab_size)
                out[f"{path}.weight"] = module(ids).to(torch.bfloat16).view(torch.int16).clone()
                own.pop("weight", None)
            for name, p in own.items():
                if p.numel():
                    out[f"{path}.{name}"] = p.detach().to(torch.bfloat16).view(torch.int16).clone()
    return out


def main() -> None:
    from transformers import TrainerCallback

    out = Path(os.environ["OUT_DIR"])
    args = recipe.parse(sys.argv[1:])
    snapshots: list[dict] = []
    syncs: list[dict] = []

    class Snapshots(TrainerCallback):
        """After each optimizer step, with the Trainer's step number (a collective: every rank)."""

        def on_step_end(self, args, state, control, **kwargs):
            snapshots.append(snapshot(trainer.model_wrapped.module, state.global_step))

    class SecondEngine(TrainerCallback):
        """Another engine under Fair Cast in the same processes (as a critic would be), stepped with the
        policy: the figures in TRL's log must stay the policy's."""

        engine = None

        def on_train_begin(self, args, state, control, **kwargs):
            import deepspeed

            from faircast_bench.builders import tiny_qwen3

            config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                      "zero_optimization": {"stage": 3}, "steps_per_print": 10**9,
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_force_ds_cpu_optimizer": False,
                      "fair_cast": {"enabled": True, "mode": "stochastic", "seed": 99, "diagnostics": {"every": 1, "log": False}}}
            model = tiny_qwen3(seed=1, std=0.1)
            self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def on_step_end(self, args, state, control, **kwargs):
            x = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(state.global_step))
            self.engine.backward(self.engine(input_ids=x, labels=x).loss)
            self.engine.step()

    second = SecondEngine()
    phases = {"imported": time.time() - STARTED}
    trainer = recipe.build_trainer(args, rewards=(length_reward,), callbacks=(Snapshots(), second))
    generation = trainer.vllm_generation
    installed = generation.sync_weights  # the sync install_trl_sync put there
    reload_sync = installed.__self__

    def recorded() -> None:
        installed()
        syncs.append({"step": trainer.state.global_step, "weights": engine_weights(reload_sync.engine_model())})

    generation.sync_weights = recorded
    phases["built"] = time.time() - STARTED  # the policy engine, the colocated vLLM engine, TRL's trainer
    trainer.train()
    phases["trained"] = time.time() - STARTED
    # TRL's own sync (the engine model's load_weights), once more after training: on a CPU where vLLM repacked
    # its linear weights (oneDNN builds a bf16 matmul) it cannot load; where it kept them, the bits it loads
    qkv = reload_sync.engine_model().model.layers[0].self_attn.qkv_proj
    own = {"weights_kept": qkv.weight.numel() > 0, "step": trainer.state.global_step}
    try:
        reload_sync.trl_sync()  # a collective: every rank fails or succeeds at the same tensor
        own.update(ok=True, weights=engine_weights(reload_sync.engine_model()))
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        own.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    from faircast_ds import get_fair_cast

    second_figures = get_fair_cast(second.engine).report()  # a collective: every rank
    state = trainer.accelerator.state
    rank = torch.distributed.get_rank()
    torch.save({"syncs": syncs, "snapshots": snapshots if rank == 0 else [], "process_index": state.process_index,
                "trl_own_sync": own},
               out / f"trl_colocate_rank{rank}.pt")
    if rank == 0:
        fc = get_fair_cast(trainer.model_wrapped)
        write_json(str(out / "trl_colocate.json"), {
            "world": torch.distributed.get_world_size(), "num_processes": state.num_processes,
            "backend": state.backend, "engine_class": type(reload_sync.engine_model()).__name__,
            "attached": fc is not None, "caster_step": None if fc is None else fc.caster.step,
            "global_step": trainer.state.global_step, "history": trainer.state.log_history,
            "sync_history": reload_sync.history, "second_engine": second_figures,
            "phases": phases | {"recorded": time.time() - STARTED},
        })
    finish_and_exit()


if __name__ == "__main__":
    main()
