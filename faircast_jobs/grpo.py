"""GRPO on a tiny Qwen3 under the ``deepspeed`` runner: does the cast of the served weights change what RL learns?

Launch: ``deepspeed --num_gpus 2 --module faircast_jobs.grpo [--full] [--seeds N | --seed-list 8-19]
[--steps N] [--lr LR] [--init-std S] [--modes fp32,nearest,dither] [--off-grid] [--engine hf|vllm]``
(``bash launch/main.sh`` does this on CPU ranks; every option: ``jobs/config.py`` and docs/grpo.md).

For every seed and every mode (``fp32``, ``nearest``, ``stochastic``, ``dither``, ``error_feedback``) one
ZeRO-3 engine trains a tiny ``transformers`` Qwen3, built from a config, with AdamW on fp32 masters.
Each step samples rollouts from the *served* copy (the engine's module, bf16 as DeepSpeed holds it;
fp32 for the reference), scores them with the task's verifiable reward (``tasks.py``), and takes one
policy-gradient step with group-normalized (GRPO) advantages; the loss is computed on the served copy
too. ``fp32`` is the reference: ZeRO-3 without bf16 and without ``fair_cast``. Every mode sees the same
initial weights, prompts and sampling noise for a given seed.

Writes ``<out>/<name>/``: ``steps.csv`` (every step of every run), ``reward.png``, ``results.md`` (the
table), ``summary.txt`` and ``endpoints.md`` (what is printed at the end) and ``run.json`` (settings and
wall time). ``python3 -m faircast_jobs.report --rebuild <out>/<name>`` rewrites all but the CSV and
run.json from those two.
"""
from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from faircast_jobs.config import (
    FULL_SEEDS,
    JOB_MODES,
    REFERENCE,
    REGIMES,
    JobConfig,
    parse,
)
from faircast_jobs.tasks import LowTokenTask, group_advantages, sample_token

__all__ = ["FULL_SEEDS", "JOB_MODES", "REFERENCE", "REGIMES", "JobConfig", "parse", "run_one", "main"]

def build_model(cfg: JobConfig, seed: int, fp32: bool, ds_config: dict[str, Any] | None = None) -> torch.nn.Module:
    """The tiny Qwen3, initialized in bf16 so that the fp32 master starts on the bf16 grid (as when
    fine-tuning a bf16 checkpoint); the fp32 reference starts from the same values. With ``--model``: the
    pretrained model's cached bf16 checkpoint (fp32: the same values), built under ``deepspeed.zero.Init``
    when ``ds_config`` is given (ZeRO-3)."""
    if cfg.model:
        from faircast_bench.zero_init import ZeroInit
        from faircast_ds.models.pretrained import load_causal_lm

        model = load_causal_lm(cfg.model, dtype=torch.float32 if fp32 else torch.bfloat16,
                               partitioning=ZeroInit(ds_config) if ds_config is not None else None)
        return _with_gemm(model, cfg)
    from faircast_bench.builders import tiny_causal_lm

    model = tiny_causal_lm("qwen3", seed=seed, init_std=cfg.init_std, attn="eager", vocab_size=cfg.vocab,
                           hidden_size=cfg.hidden, intermediate_size=2 * cfg.hidden, num_hidden_layers=cfg.layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=cfg.hidden // 4,
                           max_position_embeddings=64, tie_word_embeddings=False)
    return model.float() if fp32 else _with_gemm(model, cfg)


def _with_gemm(model: torch.nn.Module, cfg: JobConfig) -> torch.nn.Module:
    """``--gemm fp32``: the bf16 linear layers multiply in fp32 and round once (faircast_ds/models/gemm.py)."""
    if cfg.gemm == "fp32":
        from faircast_ds.models.gemm import use_fp32_accumulation

        use_fp32_accumulation(model)
    return model


def ds_config(mode: str, seed: int, cfg: JobConfig, per_rank: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": per_rank,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": cfg.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cfg.zero_stage == 3:
        config["zero_optimization"].update(stage3_param_persistence_threshold=cfg.persist_threshold,
                                           stage3_prefetch_bucket_size=0)
    if cfg.model:  # DeepSpeed's default reduce bucket (5e8 elements) would be a 1-2 GB buffer per rank
        config["zero_optimization"].update(reduce_bucket_size=20_000_000)
        if cfg.zero_stage == 3:
            config["zero_optimization"].update(stage3_prefetch_bucket_size=20_000_000)
        else:
            config["zero_optimization"].update(allgather_bucket_size=20_000_000)
    if mode != REFERENCE:
        config["bf16"] = {"enabled": True}
        config["fair_cast"] = {"enabled": True, "mode": mode, "seed": seed,
                               "diagnostics": {"every": cfg.diag_every, "horizon": cfg.horizon,
                                               "sample": cfg.sample, "log": False}}
    return config


@torch.no_grad()
def rollout(policy: torch.nn.Module, prompts: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample ``uniforms.shape[1]`` tokens after each prompt from the served policy, with a KV cache
    (every rank runs the same number of forwards, as ZeRO-3's gathers require)."""
    out = policy(input_ids=prompts, use_cache=True)
    seqs = prompts
    for t in range(uniforms.shape[1]):
        token = sample_token(out.logits[:, -1], uniforms[:, t])
        seqs = torch.cat([seqs, token], dim=1)
        if t + 1 < uniforms.shape[1]:
            out = policy(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
    return seqs


class ServedView:
    """The served weights exactly as DeepSpeed holds them, run through a plain HF model: no copy, no ZeRO hooks.

    Possible when every parameter is ZeRO-3 persistent: then each rank's ``param.data`` is the full served
    tensor, all-gathered from the cast shards after every step. ``policy()`` rebinds the plain model's
    parameters to those tensors (in case DeepSpeed swapped them) and returns it, or returns None while
    some are not gathered yet (before the first forward).
    """

    def __init__(self, engine: Any, plain: torch.nn.Module) -> None:
        theirs = dict(engine.module.named_parameters())
        self.model = plain.eval()
        self.pairs = [(p, theirs[name]) for name, p in plain.named_parameters()]

    @staticmethod
    def possible(engine: Any) -> bool:
        from faircast_ds.deepspeed.params import is_persistent

        return all(is_persistent(p) for p in engine.module.parameters())

    def policy(self) -> torch.nn.Module | None:
        if any(theirs.data.shape != mine.shape for mine, theirs in self.pairs):
            return None
        for mine, theirs in self.pairs:
            mine.data = theirs.data
        return self.model


class ReferenceChangeCounter:
    """For the fp32 reference, which has no Fair Cast caster to count for it: how many elements of this
    rank's ZeRO-3 partitions each step changed."""

    def __init__(self, engine: Any) -> None:
        from faircast_ds.deepspeed.params import full_numel

        self.params = [p for p in engine.module.parameters()]
        self.numel = sum(full_numel(p) for p in self.params) / torch.distributed.get_world_size()
        self.previous = self._bits()

    def _bits(self) -> torch.Tensor:
        from faircast_ds.deepspeed.params import is_partitioned, local_partition

        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

        def share(p: torch.nn.Parameter) -> torch.Tensor:  # ZeRO-1/2 keep every parameter whole: count a 1/world slice
            flat = p.data.view(-1)
            size = -(-flat.numel() // world)
            return flat[rank * size:(rank + 1) * size]

        return torch.cat([(local_partition(p) if is_partitioned(p) else share(p)).view(torch.int32)
                          for p in self.params]).clone()

    def count(self) -> tuple[float, float]:
        now = self._bits()
        changed = float((now != self.previous).sum())
        self.previous = now
        return changed, self.numel


class DeltaSyncBytes:
    """Payload bytes a delta weight sync (``faircast_ds.export.WeightSender``) would send for each step:
    per parameter that changed, the smaller of its COO (index + value) and bitmap encodings
    (``faircast_ds.export.delta``). Reads the full served tensors of a :class:`ServedView`."""

    def __init__(self, view: ServedView) -> None:
        self.view = view
        self.previous: list[torch.Tensor] | None = None

    def step(self) -> int | None:
        from faircast_ds.export import delta

        if self.view.policy() is None:
            return None
        now = [delta.bits_view(theirs.data).clone() for _, theirs in self.view.pairs]
        total = None
        if self.previous is not None:
            total = 0
            for before, after in zip(self.previous, now):
                nnz = int((before != after).sum())
                if nnz:
                    size = after.element_size()
                    total += delta.encoded_bytes(delta.choose(after.numel(), nnz, size), after.numel(), nnz, size)
        self.previous = now
        return total


class MasterView:
    """The fp32 master policy: every rank gathers the full fp32 master of each parameter
    (``deepspeed.utils.safe_get_full_fp32_param``, a collective) into a plain fp32 model."""

    def __init__(self, engine: Any, cfg: JobConfig, seed: int) -> None:
        self.model = build_model(cfg, seed, fp32=True).eval()
        self.targets = dict(self.model.named_parameters())
        self.params = list(engine.module.named_parameters())

    def policy(self) -> torch.nn.Module:
        from deepspeed.utils import safe_get_full_fp32_param

        with torch.no_grad():
            for name, param in self.params:
                self.targets[name].data.copy_(safe_get_full_fp32_param(param).view_as(self.targets[name]))
        return self.model


def evaluate(policy: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], task: LowTokenTask) -> float:
    """Mean reward of ``policy`` on a fixed batch of prompts and sampling uniforms (this rank's share)."""
    prompts, uniforms = batch
    return float(task.reward(rollout(policy, prompts, uniforms)[:, prompts.shape[1]:]).mean())


@torch.no_grad()
def step_kl(before: torch.Tensor, policy: torch.nn.Module, seqs: torch.Tensor, prompt_len: int) -> float:
    """Mean per-token KL(served before the step || served after it) on the step's rollouts: ``before``
    are the logits the loss was computed from, the new served copy's are computed here."""
    after = policy(input_ids=seqs, use_cache=False).logits[:, prompt_len - 1:-1].float()
    old, new = torch.log_softmax(before, dim=-1), torch.log_softmax(after, dim=-1)
    return float((old.exp() * (old - new)).sum(dim=-1).mean())


def served_copy(engine: Any, cfg: JobConfig, seed: int, rank: int) -> torch.nn.Module | None:
    """The served weights gathered into a plain HF model on rank 0 (a collective; None elsewhere)."""
    from faircast_ds.export import served_weights

    copy = build_model(cfg, seed, fp32=False) if rank == 0 else None
    targets = dict(copy.named_parameters()) if copy is not None else {}
    for name, served in served_weights(engine):
        if copy is not None:
            targets[name].data.copy_(served)
    return copy


def mismatch(model: torch.nn.Module, input_ids: torch.Tensor, engine: str = "sglang") -> dict[str, float]:
    """Trainer-vs-engine log-prob gap (RMS, k3 KL) on the final served weights, unaligned and aligned."""
    from faircast_ds.align import REGIONS, get_profile, measure_mismatch

    regions = tuple(r for r in REGIONS if get_profile(engine).differs_from_hf(r))
    plain = measure_mismatch(model, input_ids, engine=engine, attribute=False)
    aligned = measure_mismatch(model, input_ids, engine=engine, trainer_regions=regions, attribute=False)
    return {"mismatch_rms": plain.rms, "mismatch_k3": plain.k3_kl,
            "mismatch_rms_aligned": aligned.rms, "mismatch_k3_aligned": aligned.k3_kl}


@dataclass
class Run:
    """One (mode, seed) engine and what measures it."""

    mode: str
    seed: int
    cfg: JobConfig
    engine: Any
    optimizer: torch.optim.Optimizer
    fair_cast: Any  # None for the fp32 reference
    view: ServedView | None
    sync_meter: DeltaSyncBytes | None
    counter: ReferenceChangeCounter | None
    master_view: MasterView | None
    eval_batch: tuple[torch.Tensor, torch.Tensor]
    source: Any  # jobs/rollouts.py: where rollouts come from
    world: int
    per_rank: int

    @property
    def served_bytes(self) -> int:
        return 4 if self.fair_cast is None else 2

    def policy(self) -> torch.nn.Module:
        """The served policy as it is now (the plain view when possible, else the engine's module)."""
        policy = self.view.policy() if self.view is not None else None
        return policy if policy is not None else self.engine.module


@dataclass
class Trained:
    """What one training step produced on this rank: rollouts, rewards, the loss's logits, timings."""

    seqs: torch.Tensor
    rewards: torch.Tensor
    logits: torch.Tensor
    loss: float
    engine_columns: dict[str, Any]
    seconds: dict[str, float]  # rollout, train (fwd+bwd+opt), fwd_bwd, opt
    stepped_at: float  # perf_counter() after the optimizer step (what follows is measurement: "extra")


def make_optimizer(params, cfg: JobConfig) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    """AdamW at ``--lr`` with no weight decay; ``--adamw fused``: torch's fused CPU kernel, else its loop."""
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, **({"fused": True} if cfg.adamw == "fused" else {}))


def start_run(mode: str, seed: int, cfg: JobConfig, task: LowTokenTask) -> Run:
    """Build the model (off the grid with ``--off-grid``), its ZeRO-3 engine and the run's meters."""
    import deepspeed
    import deepspeed.comm as dist

    from faircast_ds import get_fair_cast
    from faircast_jobs import offgrid, rollouts

    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank = cfg.rollouts // world
    reference = mode == REFERENCE
    config = ds_config(mode, seed, cfg, per_rank)
    model = build_model(cfg, seed, fp32=reference, ds_config=config if cfg.model and cfg.zero_stage == 3 else None)
    masters = offgrid.off_grid_state(model.named_parameters(), seed) if cfg.off_grid else None
    if masters is not None and reference:  # fp32 serves its master: the module holds the off-grid values
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(masters[name])
    opt = make_optimizer(model.parameters(), cfg)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    if masters is not None:
        offgrid.set_masters(engine, masters)  # bf16 modes: the served copy stays RN(master) = the bf16 init
    fair_cast = get_fair_cast(engine)
    if (fair_cast is None) != reference:
        raise RuntimeError(f"mode {mode}: expected Fair Cast {'off' if reference else 'on'}")
    view = None
    if cfg.rollout_via == "view" and ServedView.possible(engine):
        view = ServedView(engine, build_model(cfg, seed, fp32=reference))
    # checkpoint consistency: the fp32 master policy against the served one, on one fixed batch (training
    # steps start at 1, so step 0's draw is never trained on); the fp32 reference serves its master
    master_view = MasterView(engine, cfg, seed) if fair_cast is not None and (cfg.eval_every or cfg.kl_master_every) \
        else None
    source = rollouts.make(cfg.rollout_engine, sample=rollout, ds_engine=engine, view=view, fp32=reference,
                          seed=seed, max_len=cfg.prompt_len + cfg.gen_len + 8, run_dir=os.path.join(cfg.out, cfg.name),
                          threads=cfg.engine_threads, plane=cfg.push_plane, gemm=cfg.engine_gemm,
                          requests=cfg.engine_requests, gemm_cache=bool(cfg.engine_gemm_cache),
                          spin_s=cfg.engine_spin_s)
    return Run(mode=mode, seed=seed, cfg=cfg, engine=engine, optimizer=opt, fair_cast=fair_cast, view=view,
               sync_meter=DeltaSyncBytes(view) if view is not None and fair_cast is not None else None,
               counter=ReferenceChangeCounter(engine) if fair_cast is None else None, master_view=master_view,
               eval_batch=task.draw(per_rank, task.generator(seed, 0, rank)), source=source, world=world,
               per_rank=per_rank)


def train_step(run: Run, task: LowTokenTask, step: int) -> Trained:
    """Rollouts from the served copy, their rewards, one GRPO policy-gradient step on the served copy."""
    import deepspeed.comm as dist

    cfg = run.cfg
    prompts, uniforms = task.draw(run.per_rank, task.generator(run.seed, step, dist.get_rank()))
    t0 = time.perf_counter()
    seqs, engine_logp = run.source.rollout(task, run.seed, step, prompts, uniforms)
    if run.sync_meter is not None and run.sync_meter.previous is None:
        run.sync_meter.step()  # the baseline: the weights these rollouts were sampled from
    completions = seqs[:, cfg.prompt_len:]
    rewards = task.score(seqs) if hasattr(task, "score") else task.reward(completions)
    advantages = group_advantages(rewards, task.group)
    t1 = time.perf_counter()
    logits = run.engine(input_ids=seqs, use_cache=False).logits[:, cfg.prompt_len - 1:-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
    mask = None
    if hasattr(task, "mask"):  # the completion's own turn only (jobs/addition.py)
        mask = task.mask(completions)
        loss = -(advantages * (logp * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1)).mean()
    else:
        loss = -(advantages * logp.mean(dim=1)).mean()
    engine_columns = run.source.measure(logp.detach(), engine_logp, seqs, cfg.prompt_len, mask=mask)  # pre-step weights
    run.engine.backward(loss)
    t2 = time.perf_counter()
    run.engine.step()
    t3 = time.perf_counter()
    engine_columns.update(run.source.after_step())  # the engine gets the new served weights
    return Trained(seqs=seqs, rewards=rewards, logits=logits.detach(), loss=float(loss.detach()),
                   engine_columns=engine_columns,
                   seconds={"rollout": t1 - t0, "train": t3 - t1, "fwd_bwd": t2 - t1, "opt": t3 - t2}, stepped_at=t3)


def policy_figures(run: Run, task: LowTokenTask, step: int, trained: Trained) -> dict[str, float]:
    """This rank's KL per step and, at evaluation points, the served and master policies' rewards."""
    cfg = run.cfg
    policy = run.policy()
    kl = step_kl(trained.logits, policy, trained.seqs, cfg.prompt_len) \
        if cfg.kl_every and step % cfg.kl_every == 0 else math.nan
    served_eval = master_eval = math.nan
    kl_master = math.nan
    if cfg.kl_master_every and (step % cfg.kl_master_every == 0 or step == cfg.steps):
        from faircast_jobs.policy_kl import master_served_kl

        kl_master = 0.0 if run.master_view is None else master_served_kl(run, task)  # fp32: served = master
    if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
        with torch.no_grad():
            served_eval = evaluate(policy, run.eval_batch, task)
            master_eval = evaluate(run.master_view.policy(), run.eval_batch, task) if run.master_view is not None \
                else served_eval
    return {"kl_step": kl, "served_eval": served_eval, "master_eval": master_eval, "kl_master": kl_master}


DIAGNOSTICS = ("gap_spacings", "lag_steps", "lag_drift_steps", "bias_spacings")


def weight_figures(run: Run) -> dict[str, float]:
    """This rank's changed elements, element count and cast time, and the diagnostics of this step."""
    if run.fair_cast is None:
        changed, numel = run.counter.count()
        return {"changed": changed, "numel": numel, "cast_s": math.nan, **{k: math.nan for k in DIAGNOSTICS}}
    cast = run.fair_cast.caster.last  # this step's counts and cast time, from the caster itself
    figures = run.fair_cast.diagnostics.last
    fresh = bool(figures) and int(figures["step"]) == cast.step
    return {"changed": cast.changed, "numel": cast.numel, "cast_s": cast.seconds,
            **{k: (figures[k] if fresh else math.nan) for k in DIAGNOSTICS}}


def all_ranks(local: dict[str, float]) -> dict[str, float]:
    """Sum of each value over the ranks (one all-reduce; every rank passes the same keys in the same order)."""
    import deepspeed.comm as dist

    totals = torch.tensor(list(local.values()), dtype=torch.float64)
    dist.all_reduce(totals)
    return dict(zip(local, totals.tolist()))


def sync_bytes(run: Run, changed: float, numel: float, delta_bytes: int | None) -> dict[str, int]:
    """What a weight sync would send now: a delta per the export's encodings (every rank holds the full
    persistent tensors, so rank 0's count is the count), else 6 bytes per changed element (COO); the fp32
    reference has no delta sync, only a dense one."""
    dense = int(numel) * run.served_bytes
    if run.fair_cast is None:
        delta = dense
    else:
        delta = delta_bytes if delta_bytes is not None else int(changed) * (4 + run.served_bytes)
    return {"sync_bytes": delta, "sync_bytes_dense": dense}


def step_row(run: Run, step: int, trained: Trained, policy: dict[str, float], weights: dict[str, float],
             delta_bytes: int | None, extra_s: float) -> dict[str, Any]:
    """One row of steps.csv: this step's figures summed (counts) or averaged (times, policy figures) over
    the ranks. The diagnostics are rank 0's (each rank computes them for the whole model)."""
    world = run.world
    total = all_ranks({"reward_sum": float(trained.rewards.sum()), "reward_n": trained.rewards.numel(),
                       "changed": weights["changed"], "numel": weights["numel"], "cast_s": weights["cast_s"],
                       **{k + "_s": v for k, v in trained.seconds.items()}, "extra_s": extra_s, **policy})
    ms = {f"{k}_ms": 1e3 * total[f"{k}_s"] / world for k in ("cast", "rollout", "train", "fwd_bwd", "opt", "extra")}
    return {
        "mode": run.mode, "seed": run.seed, "step": step, "reward": total["reward_sum"] / total["reward_n"],
        "loss": trained.loss, "changed": int(total["changed"]), "numel": int(total["numel"]),
        "changed_fraction": total["changed"] / total["numel"], **{k: weights[k] for k in DIAGNOSTICS},
        **{k: total[k] / world for k in policy},
        **sync_bytes(run, total["changed"], total["numel"], delta_bytes), **ms, **trained.engine_columns,
    }


def finish_run(run: Run, last_seqs: torch.Tensor) -> dict[str, Any]:
    """The end-of-run figures (the SGLang mismatch of the final served weights, rank 0) and teardown."""
    import deepspeed.comm as dist

    final: dict[str, Any] = {"mode": run.mode, "seed": run.seed}
    if run.fair_cast is not None and not run.cfg.model:  # the SGLang profile models the tiny Qwen3
        copy = served_copy(run.engine, run.cfg, run.seed, dist.get_rank())
        if copy is not None:
            final.update(mismatch(copy, last_seqs))
    run.source.close()
    run.engine.destroy()
    if run.cfg.model:  # the next engine must fit beside what this one leaves behind (jobs/release.py)
        from faircast_jobs.release import release

        release(run.engine)
    return final


class _Session:
    trained = 0  # steps trained by this process (--session-steps)


def run_one(mode: str, seed: int, cfg: JobConfig, task: LowTokenTask, progress: Any,
            previous: Sequence[dict] = (), on_step: Callable[[list[dict]], None] | None = None,
            ) -> tuple[list[dict], dict]:
    """Train one engine; return its per-step rows and its end-of-run figures (rank 0's are complete).
    With ``--save-every``: resume from this run's newest checkpoint (``previous``: the rows the CSV holds
    for it) and save one every that many steps (jobs/resume.py); ``on_step`` gets the rows after each step."""
    import deepspeed.comm as dist

    from faircast_jobs import resume

    run = start_run(mode, seed, cfg, task)
    run_dir = os.path.join(cfg.out, cfg.name)
    saves = resume.checkpoint_dir(run_dir, mode, seed)
    rows: list[dict] = []
    first = 1
    at = resume.latest_step(saves) if cfg.save_every else 0
    if at:
        run.engine.load_checkpoint(saves, tag=f"global_step{at}")
        run.source.after_step()  # the engine gets the loaded weights (a verified push)
        if run.counter is not None:
            run.counter.previous = run.counter._bits()
        rows = [r for r in previous if int(r["step"]) <= at]
        if [int(r["step"]) for r in rows] != list(range(1, at + 1)):
            raise RuntimeError(f"{mode} seed {seed}: the CSV lacks rows of steps 1..{at} that its checkpoint passed")
        first = at + 1
        if progress is not None:
            progress.update(at)
    trained = None
    last = cfg.steps
    if cfg.session_steps:
        last = min(cfg.steps, first - 1 + max(0, cfg.session_steps - _Session.trained))
    for step in range(first, last + 1):
        _Session.trained += 1
        trained = train_step(run, task, step)
        policy = policy_figures(run, task, step, trained)
        weights = weight_figures(run)
        delta_bytes = run.sync_meter.step() if run.sync_meter is not None else None
        rows.append(step_row(run, step, trained, policy, weights, delta_bytes,
                             time.perf_counter() - trained.stepped_at))
        if on_step is not None:
            on_step(rows)
        if step in cfg.save_steps:  # after the step's row: its timings leave the save out
            run.engine.save_checkpoint(os.path.join(cfg.out, cfg.name, "checkpoints", f"{mode}-seed{seed}"),
                                       tag=f"global_step{step}")
        if cfg.save_every:
            began = time.perf_counter()
            if step % cfg.save_every == 0 or step in (cfg.steps, last):
                resume.save(run.engine, saves, step, dist.get_rank())
            # the step's share of the run's wall time that its row's other timings leave out
            rows[-1]["save_ms"] = 1e3 * (time.perf_counter() - began)
            if on_step is not None:
                on_step(rows)
        if progress is not None:
            progress.set_postfix_str(f"{mode} seed {seed} reward {rows[-1]['reward']:.3f} "
                                     f"changed {100 * rows[-1]['changed_fraction']:.2f}%", refresh=False)
            progress.update(1)
    if last < cfg.steps:  # the session's steps are spent: stop here, resume later
        run.source.close()
        run.engine.destroy()
        del run, trained
        gc.collect()
        return rows, {"mode": mode, "seed": seed, "unfinished": True}
    final = finish_run(run, trained.seqs) if trained is not None else {"mode": mode, "seed": seed}
    if cfg.save_every:
        dist.barrier()
        if dist.get_rank() == 0:
            resume.mark_done(run_dir, mode, seed, final)
        dist.barrier()
    del run, trained
    gc.collect()
    return rows, final


def make_task(cfg: JobConfig) -> Any:
    """The tiny model's low-token task, or the pretrained model's task (``--task``) with its tokenizer."""
    if not cfg.model:
        return LowTokenTask(vocab=cfg.vocab, prompt_len=cfg.prompt_len, gen_len=cfg.gen_len, group=cfg.group,
                            prompt_vocab=cfg.prompt_vocab)
    from faircast_jobs.addition import AdditionTask
    from faircast_ds.models.pretrained import load_tokenizer

    return AdditionTask(load_tokenizer(cfg.model), gen_len=cfg.gen_len, group=cfg.group, high=cfg.operand_max)


def quiet() -> None:
    """Keep the screen for the progress bar: DeepSpeed's INFO lines and torch's deprecation notes for
    the collectives DeepSpeed calls go."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)
    import deepspeed
    import deepspeed.comm as dist

    quiet()

    from faircast_jobs import plots, provenance, report

    started = time.time()
    deepspeed.init_distributed(dist_backend="gloo" if os.environ.get("DS_ACCELERATOR") == "cpu" else None)
    world, rank = dist.get_world_size(), dist.get_rank()
    if cfg.rollouts % (world * cfg.group):
        raise SystemExit(f"--rollouts {cfg.rollouts} must be a multiple of world size x group ({world} x {cfg.group})")
    # the run directory is named on rank 0 only (clocks may tick between ranks)
    name = [cfg.name]
    dist.broadcast_object_list(name, src=0)
    cfg = replace(cfg, name=name[0])
    run_dir = os.path.join(cfg.out, cfg.name)
    if cfg.model:  # dequantized and cached once, by rank 0 (the others then find it)
        from faircast_ds.models.pretrained import checkpoint

        if rank == 0:
            checkpoint(cfg.model)
        dist.barrier()
    task = make_task(cfg)
    if cfg.model:
        cfg = replace(cfg, prompt_len=task.prompt_len)  # the chat template's length of the task's prompts
    csv_path = os.path.join(run_dir, "steps.csv")
    earlier: list[dict] = []
    if cfg.save_every:
        from faircast_jobs import resume
        from faircast_jobs.steps_csv import read_csv

        if rank == 0:
            os.makedirs(run_dir, exist_ok=True)
            resume.check_settings(run_dir, cfg.to_json())
            resume.check_cpu(run_dir, torch.backends.cpu.get_cpu_capability(), provenance.cpu_vendor())
        dist.barrier()
        if os.path.exists(csv_path):
            earlier = resume.tidy(read_csv(csv_path))
    progress = None
    if rank == 0:
        from tqdm import tqdm

        os.makedirs(run_dir, exist_ok=True)
        sessions = provenance.add_session(run_dir, len(earlier))  # the code this process runs, read at its start
        print(f"[grpo] {len(cfg.modes)} modes x {len(cfg.seed_ids)} seeds x {cfg.steps} steps, world size {world} "
              f"-> {run_dir}", flush=True)
        progress = tqdm(total=len(cfg.modes) * len(cfg.seed_ids) * cfg.steps, unit="step", file=sys.stdout,
                        dynamic_ncols=True, mininterval=2.0)
    rows: list[dict] = []
    finals: list[dict] = []
    for seed in cfg.seed_ids:
        for mode in cfg.modes:
            mine = [r for r in earlier if r["mode"] == mode and int(r["seed"]) == seed]
            if cfg.save_every and resume.is_done(run_dir, mode, seed):  # finished in an earlier session
                rows += mine
                finals.append(resume.read_done(run_dir, mode, seed))
                if progress is not None:
                    progress.update(cfg.steps)
                continue
            done_rows = list(rows)

            def write(run_rows: list[dict], done_rows: list[dict] = done_rows) -> None:
                if rank == 0 and cfg.save_every:  # every step: a long run keeps what it did
                    later = [r for r in earlier if (r["mode"], int(r["seed"])) not in
                             {(x["mode"], int(x["seed"])) for x in done_rows + run_rows}]
                    report.write_csv(csv_path, done_rows + run_rows + later)

            if cfg.session_steps and _Session.trained >= cfg.session_steps:
                rows += mine
                finals.append({"mode": mode, "seed": seed, "unfinished": True})
                continue  # this session's steps are spent
            run_rows, final = run_one(mode, seed, cfg, task, progress, previous=mine, on_step=write)
            rows += run_rows
            finals.append(final)
            if rank == 0:  # written as runs finish, so an interrupted job keeps what it did
                if cfg.save_every:
                    write(run_rows)
                else:
                    report.write_csv(csv_path, rows)
    from faircast_jobs import rollouts

    rollouts.shutdown()  # the vLLM engine, if one served the rollouts
    if any(f.get("unfinished") for f in finals):
        if rank == 0:
            progress.close()
            print(f"\n[grpo] session stopped after {_Session.trained} steps (--session-steps); {csv_path} holds "
                  "every step so far. Resume with the same command.", flush=True)
        dist.barrier()
        torch.distributed.destroy_process_group()
        return
    if rank == 0:
        progress.close()
        wall = time.time() - started
        summaries = report.summarize(rows, finals, cfg.modes, tie=cfg.tie)
        plots.plot_run(rows, os.path.join(run_dir, "reward.png"), title=report.headline(cfg, world))
        table = report.markdown(summaries, cfg, world, wall) + report.engine_table(rows, cfg.modes)
        if cfg.model:
            table += report.pretrained_table(rows, cfg.modes)
        with open(os.path.join(run_dir, "results.md"), "w") as f:
            f.write(table)
        with open(os.path.join(run_dir, "run.json"), "w") as f:
            json.dump({"config": cfg.to_json(), "world_size": world, "wall_s": wall, "finals": finals,
                       "provenance": sessions[-1], "sessions": sessions}, f, indent=1)
        text = report.summary_text(summaries, cfg, world, wall, run_dir, rows)
        with open(os.path.join(run_dir, "summary.txt"), "w") as f:
            f.write(text + "\n")
        # the pre-registered endpoints (AUC, steps to 0.30): the delay that a final-window tie can hide
        from faircast_jobs import endpoints

        table = endpoints.markdown(rows)
        with open(os.path.join(run_dir, "endpoints.md"), "w") as f:
            f.write(table)
        print("\n" + text + "\n\n" + table, flush=True)
    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
