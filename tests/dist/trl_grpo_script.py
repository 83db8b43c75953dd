"""TRL's GRPOTrainer under the `deepspeed` runner, ZeRO-3, with a KL penalty (beta > 0): TRL builds a
reference engine from a deep copy of the same DeepSpeed config, without an optimizer
(DeepSpeedZeRoOffload). The script is what a TRL user writes; the Fair Cast parts are the config's
section and the FairCastCallback. CPU-only lines: the bf16 availability stub (TrainingArguments
refuses bf16 without a GPU unless use_cpu=True, which turns DeepSpeed off). One rank (two CPU ranks
under DeepSpeed need Accelerate told its backend, ``ddp_backend="gloo"``, or Accelerate counts one process and
its gathers fail: docs/integrations.md; tests/transformers_tests/test_trl_colocate.py runs two).

The model and tokenizer are built in code and saved to a local folder (TRL loads the reference
model from the policy's path). Afterwards it writes trl_grpo.json (the reference engine's class, what
the Trainer logged) and trl_grpo.pt for the bitwise checks (tests/served_oracle.py): the initial
weights; after every optimizer step (a callback at on_step_end) the fp32 masters and served bits
(tests/dist/served_record.py); the weights every Linear of the policy multiplied by, by step and
phase (TRL's generation, the loss's forward, other no-grad forwards); the reference engine's served
bits before and after training and the weights its forward multiplied by. With FAIR_CAST_LORA=1 the
same (frozen base weights included) in trl_grpo_lora.pt, plus TRL's LoRA weight-sync sequence.
"""
from __future__ import annotations

import os
import sys

import torch
import transformers.training_args

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import finish_and_exit, tiny_qwen3, write_json  # noqa: E402
from served_record import ForwardTap, initial_bits, served, snapshot  # noqa: E402

transformers.training_args.is_torch_bf16_gpu_available = lambda: True  # CPU-only machine

MODE = os.environ.get("FAIR_CAST_MODE", "stochastic")
LORA = os.environ.get("FAIR_CAST_LORA") == "1"  # PEFT LoRA: frozen base (then TRL has no reference engine)
VOCAB = 101


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<eos>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(VOCAB - len(specials))])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")


def reward_w7(completions, **kwargs):
    """More 'w7' tokens in the completion, more reward (any signal will do)."""
    return [float(str(c).split().count("w7")) for c in completions]


class Recorder:
    """Stands for W&B/TensorBoard: a callback registered before FairCastCallback, recording what it is shown."""

    seen: list[dict] = []


def main() -> None:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from faircast_ds import get_fair_cast
    from faircast_ds.transformers import FairCastCallback

    class Reporter(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            Recorder.seen.append(dict(logs or {}))

    out = os.environ["OUT_DIR"]
    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(out, "policy")
    if rank == 0:
        tiny_qwen3(std=0.1).save_pretrained(path)
        tokenizer().save_pretrained(path)
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 40},
        "fair_cast": {"enabled": True, "mode": MODE, "seed": 11, "diagnostics": {"every": 1, "log": False}},
    }
    prompts = [" ".join(f"w{(7 * i + j) % 90 + 3}" for j in range(4)) for i in range(8)]
    args = GRPOConfig(output_dir=os.path.join(out, "grpo"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, beta=0.04, max_steps=3, learning_rate=1e-4, bf16=True,
                      deepspeed=ds_config, report_to=[], save_strategy="no", logging_steps=1,
                      optim="adamw_torch", dataloader_num_workers=0, use_vllm=False, temperature=1.0)
    peft = None
    if LORA:
        from peft import LoraConfig

        peft = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    snapshots: list[dict] = []

    class Snapshots(TrainerCallback):
        """After each optimizer step, with the Trainer's step number."""

        def on_step_end(self, args, state, control, **kwargs):
            snapshots.append(snapshot(trainer.model_wrapped.module, state.global_step))

    trainer = GRPOTrainer(model=path, reward_funcs=reward_w7, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=tokenizer(), peft_config=peft,
                          callbacks=[Reporter(), FairCastCallback(lora_merge=LORA), Snapshots()])
    policy = trainer.model  # not wrapped by DeepSpeed until train()
    initial = initial_bits(policy)
    tap = ForwardTap(policy, step=lambda: trainer.state.global_step, phase=phase_of(policy))
    record = {"initial": initial, "snapshots": snapshots, "tap": tap}
    if LORA:
        trainer.train()
        return lora_report(trainer, out, rank, record)
    ref = trainer.ref_model
    ref_tap = ForwardTap(ref.module, step=lambda: trainer.state.global_step)
    ref_before = served(ref.module)
    trainer.train()
    engine = trainer.model_wrapped
    fc = get_fair_cast(engine)
    ref_after = served(ref.module)
    keys = ("fair_cast/changed_fraction", "fair_cast/gap_spacings", "fair_cast/lag_steps")
    if rank == 0:
        torch.save({**record, "tap": tap.record(), "ref_before": ref_before, "ref_after": ref_after,
                    "ref_tap": ref_tap.record()}, os.path.join(out, "trl_grpo.pt"))
        write_json(os.path.join(out, "trl_grpo.json"), {
            "engine": type(engine).__name__,
            "optimizer": type(engine.optimizer).__name__,
            "ref_engine": type(ref).__name__,
            "ref_optimizer": type(ref.optimizer).__name__,
            "ref_attached": get_fair_cast(ref) is not None,
            "caster_step": fc.caster.step,
            "global_step": trainer.state.global_step,
            "history": [{k: h[k] for k in keys if k in h} | {"step": h.get("step")} for h in trainer.state.log_history],
            "reporter_saw": [{k: s[k] for k in keys if k in s} for s in Recorder.seen],
            "kl_logged": any("kl" in h for h in trainer.state.log_history),
        })
    finish_and_exit()


def phase_of(model):
    """The phase a forward of ``model`` runs in: "generate" inside its generate() (TRL calls it on the
    unwrapped model, gathered under ZeRO-3), else "train" with gradients, "no_grad" without."""
    inside = {"generate": False}
    generate = model.generate

    def tracked(*args, **kwargs):
        inside["generate"] = True
        try:
            return generate(*args, **kwargs)
        finally:
            inside["generate"] = False

    model.generate = tracked  # an instance attribute: what TRL's unwrapped_model.generate finds
    return lambda: "generate" if inside["generate"] else ("train" if torch.is_grad_enabled() else "no_grad")


def lora_report(trainer, out, rank, record) -> None:
    """What TRL's weight sync does for a PEFT model under ZeRO-3 (trl/generation/vllm_generation.py):
    gather everything, merge_adapter, read the merged weights, unmerge_adapter. Per merged layer: the
    fp32 W + B A s (computed here from the served bits), the merged bits, how many of them differ from
    round-to-nearest of it, and whether the unmerge gave the base weights back bit for bit."""
    import deepspeed
    from peft.tuners.lora.layer import Linear

    from faircast_ds import get_fair_cast

    engine = trainer.model_wrapped
    model = engine.module
    fc = get_fair_cast(engine)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    report, merges = {}, {}
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        before = {n: l.get_base_layer().weight.detach().clone() for n, l in layers}
        target = {}
        for n, l in layers:
            a, b = l.lora_A["default"].weight.float(), l.lora_B["default"].weight.float()
            target[n] = before[n].float() + (b @ a) * l.scaling["default"]
        model.merge_adapter()
        merged = {n: l.get_base_layer().weight.detach().clone() for n, l in layers}
        model.unmerge_adapter()
        for n, l in layers:
            rn = target[n].to(torch.bfloat16)
            report[n] = {"vs_rn": int((merged[n].view(torch.int16) != rn.view(torch.int16)).sum()),
                         "numel": merged[n].numel(),
                         "restored": bool(torch.equal(l.get_base_layer().weight.view(torch.int16),
                                                      before[n].view(torch.int16)))}
            merges[n] = {"target": target[n].reshape(-1).clone(), "merged": merged[n].reshape(-1).view(torch.int16).clone()}
    if rank == 0:
        torch.save({**record, "tap": record["tap"].record(), "merges": merges, "merge_step": trainer.state.global_step},
                   os.path.join(out, "trl_grpo_lora.pt"))
        write_json(os.path.join(out, "trl_grpo_lora.json"), {
            "attached": fc is not None, "caster_step": fc.caster.step, "global_step": trainer.state.global_step,
            "ref_model": trainer.ref_model is None, "local_numel": fc.local_numel(), "layers": report,
            "trainable": sum(int(p.ds_numel) for p in model.parameters() if p.requires_grad),
            "history_has_figures": any("fair_cast/changed_fraction" in h for h in trainer.state.log_history)})
    finish_and_exit()


if __name__ == "__main__":
    main()
