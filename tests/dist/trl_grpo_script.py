"""TRL's GRPOTrainer under the `deepspeed` runner, ZeRO-3, with a KL penalty (beta > 0): TRL builds a
reference engine from a deep copy of the same DeepSpeed config, without an optimizer
(DeepSpeedZeRoOffload). The script is what a TRL user writes; the Fair Cast parts are the config's
section and the FairCastCallback. CPU-only lines: the bf16 availability stub (TrainingArguments
refuses bf16 without a GPU unless use_cpu=True, which turns DeepSpeed off). One rank: at two CPU
ranks Accelerate's gather over gloo fails inside TRL's generation step.

The model and tokenizer are built in code and saved to a local folder (TRL loads the reference
model from the policy's path). Afterwards it writes trl_grpo.json: per-parameter served bits vs
round-to-nearest of the fp32 masters, the reference engine's class and whether its weights moved,
and what the Trainer logged.
"""
from __future__ import annotations

import os
import sys

import torch
import transformers.training_args

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import finish_and_exit, full_served_bits, gather_shards, tiny_qwen3, write_json  # noqa: E402

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
    trainer = GRPOTrainer(model=path, reward_funcs=reward_w7, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=tokenizer(), peft_config=peft,
                          callbacks=[Reporter(), FairCastCallback(lora_merge=LORA)])
    if LORA:
        trainer.train()
        return lora_report(trainer, out, rank)
    ref = trainer.ref_model
    ref_before = full_served_bits(ref)
    trainer.train()
    engine = trainer.model_wrapped
    fc = get_fair_cast(engine)
    numels = {n: int(getattr(p, "ds_numel", p.numel())) for n, p in engine.module.named_parameters()}
    masters, served = gather_shards(fc, numels)
    per_param = {}
    for name in numels:
        rn = masters[name].to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
        per_param[name] = [int((served[name] != rn).sum()), numels[name]]
    ref_after = full_served_bits(ref)
    keys = ("fair_cast/changed_fraction", "fair_cast/gap_spacings", "fair_cast/lag_steps")
    if rank == 0:
        write_json(os.path.join(out, "trl_grpo.json"), {
            "engine": type(engine).__name__,
            "optimizer": type(engine.optimizer).__name__,
            "ref_engine": type(ref).__name__,
            "ref_optimizer": type(ref.optimizer).__name__,
            "ref_attached": get_fair_cast(ref) is not None,
            "ref_changed": sum(int((ref_before[n] != ref_after[n]).sum()) for n in ref_before),
            "served_vs_rn": per_param,
            "caster_step": fc.caster.step,
            "global_step": trainer.state.global_step,
            "history": [{k: h[k] for k in keys if k in h} | {"step": h.get("step")} for h in trainer.state.log_history],
            "reporter_saw": [{k: s[k] for k in keys if k in s} for s in Recorder.seen],
            "kl_logged": any("kl" in h for h in trainer.state.log_history),
        })
    finish_and_exit()


def lora_report(trainer, out, rank) -> None:
    """What TRL's weight sync does for a PEFT model under ZeRO-3 (trl/generation/vllm_generation.py):
    gather everything, merge_adapter, read the merged weights, unmerge_adapter. Per merged layer: how
    many merged bits differ from round-to-nearest of W + B A s computed in fp32, and whether the
    unmerge gave the base weights back bit for bit."""
    import deepspeed

    from faircast_ds import get_fair_cast
    from faircast_ds.transformers import lora_layers

    engine = trainer.model_wrapped
    model = engine.module
    fc = get_fair_cast(engine)
    layers = lora_layers(model)
    report = {}
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        before = {n: l.get_base_layer().weight.detach().clone() for n, l in layers}
        rn = {}
        for n, l in layers:
            a, b = l.lora_A["default"].weight.float(), l.lora_B["default"].weight.float()
            rn[n] = (before[n].float() + (b @ a) * l.scaling["default"]).to(torch.bfloat16)
        model.merge_adapter()
        merged = {n: l.get_base_layer().weight.detach().clone() for n, l in layers}
        model.unmerge_adapter()
        for n, l in layers:
            report[n] = {"vs_rn": int((merged[n].view(torch.int16) != rn[n].view(torch.int16)).sum()),
                         "numel": merged[n].numel(),
                         "restored": bool(torch.equal(l.get_base_layer().weight.view(torch.int16),
                                                      before[n].view(torch.int16)))}
    if rank == 0:
        write_json(os.path.join(out, "trl_grpo_lora.json"), {
            "attached": fc is not None, "caster_step": fc.caster.step, "global_step": trainer.state.global_step,
            "ref_model": trainer.ref_model is None, "local_numel": fc.local_numel(), "layers": report,
            "trainable": sum(int(p.ds_numel) for p in model.parameters() if p.requires_grad),
            "history_has_figures": any("fair_cast/changed_fraction" in h for h in trainer.state.log_history)})
    finish_and_exit()


if __name__ == "__main__":
    main()
