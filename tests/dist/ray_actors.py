"""Ray actors laid out as OpenRLHF lays out a job, for tests/system/test_ray.py.

- :class:`TrainerRank`: one DeepSpeed rank per actor (OpenRLHF's ``DistributedTorchRayActor``: the
  actor sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` itself and
  ``deepspeed.initialize`` joins the group). The DeepSpeed config comes from OpenRLHF's own builder
  (``get_train_ds_config``, loaded from the installed package's file, as in
  tests/dist/openrlhf_style_script.py) and has no ``fair_cast`` key: the section reaches the ranks
  only through ``FAIRCAST_DS_CONFIG`` in the job's Ray runtime environment.
- :class:`EngineActor`: a ``vllm.LLM`` inside an actor (OpenRLHF's ``LLMRayActor``) started with
  ``weight_transfer_config={"backend": "faircast"}``; it exposes the weight-sync methods vLLM's
  ``RayVLLMWeightSyncClient`` calls, by delegation to the ``LLM``.

Updates go the way vLLM documents for Ray: each rank builds the trainer engine through
``WeightTransferTrainerFactory.trainer_init`` with a ``RayVLLMWeightSyncClient`` on the engine actor's
handle, and ``send_weights()`` on every rank (a collective under ZeRO-3) drives start/update/finish.

What the engine computes with is read back here, with code of this file only (no Fair Cast code): each
linear layer (and the LM head) applied through its own ``quant_method`` to identity rows, each
embedding looked up for every id, other tensors read as they are; fused layers split back into their
HF parts by ``output_sizes``. The test compares those bits with its oracle.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# the tiny Qwen3 of the other tests with head_dim 32: vLLM's CPU attention has no kernel for head_dim 8
MODEL = dict(std=0.1, head_dim=32)
# how vLLM's Qwen3 fuses HF projections (its packed_modules_mapping), restated for the read-back
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class TrainerRank:
    """One DeepSpeed ZeRO-3 rank of the policy, as an actor."""

    def __init__(self, rank: int, world: int, master_port: int) -> None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
        self.rank = rank
        self.engine: Any = None
        self.transfer: Any = None

    def build(self) -> dict[str, Any]:
        """OpenRLHF's train config and ``deepspeed.initialize`` (as its strategy calls it); what Fair Cast says."""
        import functools

        import deepspeed
        from openrlhf_style_script import openrlhf_builders, train_config
        from transformers.trainer import get_scheduler

        from faircast_ds import get_fair_cast
        from faircast_bench.builders import tiny_qwen3

        builders, _ = openrlhf_builders()
        cfg = train_config(builders)
        model = tiny_qwen3(**MODEL)
        params = builders.get_optimizer_grouped_parameters(model, 0.0)
        sched = functools.partial(get_scheduler, "cosine_with_min_lr", num_warmup_steps=0, num_training_steps=10,
                                  scheduler_specific_kwargs={"min_lr_rate": 0.1})
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=None, model_parameters=params,
                                               lr_scheduler=sched, config=cfg, args={"local_rank": self.rank},
                                               dist_init_required=True)
        fc = get_fair_cast(self.engine)
        return {"config_has_section": "fair_cast" in cfg, "attached": fc is not None,
                "origin": fc.origin if fc else None, "mode": fc.config.mode if fc else None,
                "seed": fc.config.seed if fc else None, "zero_stage": self.engine.zero_optimization_stage()}

    def step(self) -> int:
        from common import train_step

        train_step(self.engine, int(self.engine.global_steps), self.rank)
        return int(self.engine.global_steps)

    def snapshot(self) -> dict[str, Any] | None:
        """DeepSpeed's fp32 masters and the gathered served bits (a collective), on rank 0."""
        from served_record import snapshot

        snap = snapshot(self.engine.module, int(self.engine.global_steps))
        return snap if self.rank == 0 else None

    def connect(self, engine_handle: Any, timeout: float) -> None:
        """The trainer side of the ``faircast`` backend through vLLM's factory and Ray client (every rank)."""
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from faircast_ds.vllm.transfer import FairCastTrainerInitInfo, register

        register()  # a trainer process need not have run vLLM's plugin loader
        self.transfer = WeightTransferTrainerFactory.trainer_init(
            FairCastTrainerInitInfo(rank=self.rank, port=0, timeout=timeout),
            client=RayVLLMWeightSyncClient(engine_handle), source=self.engine)

    def push(self) -> dict[str, Any]:
        """One update round at DeepSpeed's step count (every rank)."""
        report = self.transfer.send_weights()
        return {"version": report.version, "kind": report.kind, "params": report.params,
                "changed": report.changed, "numel": report.numel}

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.shutdown()


class EngineActor:
    """A vLLM engine in an actor, with the weight-sync surface ``RayVLLMWeightSyncClient`` drives."""

    def __init__(self, model_dir: str, seed: int = 0) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in the actor: one process
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM

        self.llm = LLM(model=model_dir, dtype="bfloat16", seed=seed, enforce_eager=True, max_model_len=64,
                       kv_cache_memory_bytes=64 << 20, skip_tokenizer_init=True,
                       weight_transfer_config={"backend": "faircast"})

    # -- what RayVLLMWeightSyncClient calls ---------------------------------------------------
    def init_weight_transfer_engine(self, request: Any) -> None:
        self.llm.init_weight_transfer_engine(request)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, request: Any) -> None:
        self.llm.update_weights(request)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def update_weight_version(self, version: str) -> None:
        self.llm.update_weight_version(version)

    # -- what the test reads -----------------------------------------------------------------
    def weight_version(self) -> str:
        return self.llm.get_weight_version()

    def kernel_bits(self) -> dict[str, torch.Tensor]:
        """HF name -> int16 bits of what the engine's kernels compute with."""
        return self.llm.collective_rpc(_read_kernel_bits)[0]

    def generate(self, prompts: list[list[int]], seeds: list[int], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=1.0, seed=s,
                                 ignore_eos=True, detokenize=False) for s in seeds]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def _read_kernel_bits(worker: Any) -> dict[str, torch.Tensor]:
    """Run inside vLLM's worker (``collective_rpc``): the bits each kernel multiplies by, HF-named."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    model = worker.model_runner.get_model()
    dtype = worker.model_config.dtype
    out: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for path, module in model.named_modules():
            own = dict(module.named_parameters(recurse=False))
            if not own:
                continue
            for attr, param in own.items():
                if attr == "weight" and isinstance(module, (LinearBase, ParallelLMHead)):
                    width = module.input_size_per_partition if isinstance(module, LinearBase) else module.embedding_dim
                    eye = torch.eye(width, dtype=dtype)
                    t = module.quant_method.apply(module, eye).t()  # W^T's rows: exact (one term per sum)
                    vocab = getattr(module, "org_vocab_size", None)
                    t = t[:vocab] if isinstance(module, ParallelLMHead) and vocab else t
                elif attr == "weight" and isinstance(module, VocabParallelEmbedding):
                    t = module(torch.arange(getattr(module, "org_vocab_size", param.shape[0])))
                else:
                    t = param.detach()
                t = t.to(dtype).contiguous()
                parent, _, leaf = path.rpartition(".")
                if leaf in _FUSED:
                    sizes = list(module.output_sizes)
                    for part, piece in zip(_FUSED[leaf], torch.split(t, sizes, dim=0)):
                        out[f"{parent}.{part}.{attr}"] = piece.contiguous().view(torch.int16).clone()
                else:
                    out[f"{path}.{attr}"] = t.view(torch.int16).clone()
    return out
