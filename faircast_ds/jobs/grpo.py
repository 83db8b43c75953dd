"""GRPO on a tiny Qwen3 under the ``deepspeed`` runner: does the cast of the served weights change what RL learns?

Launch: ``deepspeed --num_gpus 2 --module faircast_ds.jobs.grpo [--full] [--seeds N] [--steps N]``
(``bash launch/main.sh`` does this on CPU ranks).

For every seed and every mode (``fp32``, ``nearest``, ``stochastic``, ``dither``, ``error_feedback``) one
ZeRO-3 engine trains a tiny ``transformers`` Qwen3, built from a config, with AdamW on fp32 masters.
Each step samples rollouts from the *served* copy (the engine's module, bf16 as DeepSpeed holds it;
fp32 for the reference), scores them with the task's verifiable reward (``tasks.py``), and takes one
policy-gradient step with group-normalized (GRPO) advantages; the loss is computed on the served copy
too. ``fp32`` is the reference: ZeRO-3 without bf16 and without ``fair_cast``. Every mode sees the same
initial weights, prompts and sampling noise for a given seed.

Writes ``<out>/<name>/``: ``steps.csv`` (every step of every run), ``reward.png``, ``results.md`` (the
table), ``summary.txt`` (what is printed at the end) and ``run.json`` (settings and wall time).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch

from faircast_ds.jobs.tasks import LowTokenTask, group_advantages, sample_token

MODES = ("fp32", "nearest", "stochastic", "dither", "error_feedback")
REFERENCE = "fp32"  # served = master: no rounding at all


@dataclass(frozen=True)
class JobConfig:
    """Settings of one invocation. ``rollouts`` counts rollouts per step over all ranks. The defaults are
    the paper regime (``REGIMES``)."""

    steps: int = 500
    seeds: int = 1
    first_seed: int = 0  # seeds first_seed .. first_seed + seeds - 1 (to split a run across launches)
    lr: float = 1.5e-6
    hidden: int = 128
    layers: int = 2
    vocab: int = 256
    init_std: float = 0.1
    rollouts: int = 256
    group: int = 8
    prompt_len: int = 2
    gen_len: int = 2
    prompt_vocab: int = 1  # prompt tokens drawn from [0, prompt_vocab); 0: the whole vocabulary (tasks.py)
    modes: tuple[str, ...] = MODES
    tie: float = 0.01  # |reward difference| below this is a tie in the per-seed comparison with nearest
    diag_every: int = 1
    horizon: int = 128
    sample: int = 16384  # diagnostics: sampled elements for the lags (at most the model's size)
    # checkpoint consistency: every ``eval_every`` steps and at the end, the reward of the fp32 master
    # policy and of the served policy on one fixed evaluation batch (0: off)
    eval_every: int = 100
    kl_every: int = 1  # KL(served before step || served after step) on the step's rollouts (0: off)
    # ZeRO-3 keeps parameters up to this size gathered after each step (DeepSpeed's default is 1e5); 1e6
    # keeps this tiny model's (<= 65k elements each) so that rollouts do not all-gather per forward
    persist_threshold: int = 1_000_000
    # "view": sample from the persistent served tensors through a plain model (same bits, no ZeRO-3 hooks);
    # "module": through the engine's module (ZeRO-3 hooks gather what is not persistent)
    rollout_via: str = "view"
    # where rollouts come from: "hf" (the trainer's forward on the served copy) or "vllm" (a vLLM engine
    # on rank 0, pushed the served weights after every step; faircast_ds/jobs/engines.py)
    engine: str = "hf"
    regime: str = "paper"
    out: str = "runs"
    name: str = ""


# Named settings (``--regime``); flags given on the command line override them.
REGIMES: dict[str, dict[str, Any]] = {
    # RN changes <= 1% of served weights per step and its served copy trails the master by tens of
    # steps (as reported for Qwen3-1.7B: 0.4-0.5%, 50-150 steps): lr 1.5e-6 on init std 0.1; one fixed
    # prompt so every rollout pushes the weights the same way and the fp32 policy learns within the run
    "paper": {},
    # the earlier main job: lr 1e-4, random prompts; RN changes ~12% per step, the lag reads ~0
    "large-step": {"steps": 300, "lr": 1e-4, "hidden": 256, "rollouts": 64, "prompt_len": 4, "gen_len": 8,
                   "prompt_vocab": 0, "eval_every": 60},
}
FULL_SEEDS = {"paper": 8, "large-step": 5}  # --full: the seeds of the committed run of each regime


def build_model(cfg: JobConfig, seed: int, fp32: bool) -> torch.nn.Module:
    """The tiny Qwen3, initialized in bf16 so that the fp32 master starts on the bf16 grid (as when
    fine-tuning a bf16 checkpoint); the fp32 reference starts from the same values."""
    from faircast_ds.models import tiny_causal_lm

    model = tiny_causal_lm("qwen3", seed=seed, init_std=cfg.init_std, attn="eager", vocab_size=cfg.vocab,
                           hidden_size=cfg.hidden, intermediate_size=2 * cfg.hidden, num_hidden_layers=cfg.layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=cfg.hidden // 4,
                           max_position_embeddings=64, tie_word_embeddings=False)
    return model.float() if fp32 else model


def ds_config(mode: str, seed: int, cfg: JobConfig, per_rank: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": per_rank,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": cfg.persist_threshold,
                              "stage3_prefetch_bucket_size": 0},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
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
        from faircast_ds.deepspeed.params import local_partition

        return torch.cat([local_partition(p).view(torch.int32) for p in self.params]).clone()

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


def run_one(mode: str, seed: int, cfg: JobConfig, task: LowTokenTask, progress: Any) -> tuple[list[dict], dict]:
    """Train one engine; return its per-step rows and its end-of-run figures (rank 0's are complete)."""
    import deepspeed
    import deepspeed.comm as dist

    from faircast_ds import get_fair_cast

    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank = cfg.rollouts // world
    model = build_model(cfg, seed, fp32=(mode == REFERENCE))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(mode, seed, cfg, per_rank))
    fair_cast = get_fair_cast(engine)
    if (fair_cast is None) != (mode == REFERENCE):
        raise RuntimeError(f"mode {mode}: expected Fair Cast {'off' if mode == REFERENCE else 'on'}")
    view = None
    if cfg.rollout_via == "view" and ServedView.possible(engine):
        view = ServedView(engine, build_model(cfg, seed, fp32=(mode == REFERENCE)))
    sync_meter = DeltaSyncBytes(view) if view is not None and fair_cast is not None else None
    counter = ReferenceChangeCounter(engine) if fair_cast is None else None
    served_bytes = 4 if fair_cast is None else 2
    # checkpoint consistency: the fp32 master policy against the served one, on one fixed batch (training
    # steps start at 1, so step 0's draw is never trained on); the fp32 reference serves its master
    master_view = MasterView(engine, cfg, seed) if fair_cast is not None and cfg.eval_every else None
    eval_batch = task.draw(per_rank, task.generator(seed, 0, rank))
    from faircast_ds.jobs import engines

    source = engines.make(cfg.engine, sample=rollout, ds_engine=engine, view=view, fp32=(mode == REFERENCE),
                          seed=seed, max_len=cfg.prompt_len + cfg.gen_len + 8, run_dir=os.path.join(cfg.out, cfg.name))
    rows: list[dict] = []
    seqs = torch.zeros(0, dtype=torch.long)
    for step in range(1, cfg.steps + 1):
        prompts, uniforms = task.draw(per_rank, task.generator(seed, step, rank))
        t0 = time.perf_counter()
        seqs, engine_logp = source.rollout(task, seed, step, prompts, uniforms)
        if sync_meter is not None and sync_meter.previous is None:
            sync_meter.step()  # the baseline: the weights these rollouts were sampled from
        completions = seqs[:, cfg.prompt_len:]
        rewards = task.reward(completions)
        advantages = group_advantages(rewards, task.group)
        t1 = time.perf_counter()
        logits = engine(input_ids=seqs, use_cache=False).logits[:, cfg.prompt_len - 1:-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        loss = -(advantages * logp.mean(dim=1)).mean()
        engine_columns = source.measure(logp.detach(), engine_logp, seqs, cfg.prompt_len)  # pre-step weights
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        engine_columns.update(source.after_step())  # the engine gets the new served weights
        policy = view.policy() if view is not None else None
        policy = policy if policy is not None else engine.module
        kl = step_kl(logits.detach(), policy, seqs, cfg.prompt_len) if cfg.kl_every and step % cfg.kl_every == 0 \
            else math.nan
        served_eval = master_eval = math.nan
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            with torch.no_grad():
                served_eval = evaluate(policy, eval_batch, task)
                master_eval = evaluate(master_view.policy(), eval_batch, task) if master_view is not None \
                    else served_eval
        if fair_cast is not None:
            cast = fair_cast.caster.last  # this step's counts and cast time, from the caster itself
            changed, numel, cast_s = cast.changed, cast.numel, cast.seconds
            figures = fair_cast.diagnostics.last
            fresh = bool(figures) and int(figures["step"]) == cast.step
            keys = ("gap_spacings", "lag_steps", "lag_drift_steps", "bias_spacings")
            gap, lag, lag_drift, bias = (figures[k] for k in keys) if fresh else (math.nan,) * 4
        else:
            changed, numel = counter.count()
            gap, lag, lag_drift, bias, cast_s = (math.nan,) * 5
        # what a weight sync would send now: a delta per the export's encodings (every rank holds the full
        # persistent tensors, so rank 0's count is the count), else 6 bytes per changed element (COO)
        delta_bytes = sync_meter.step() if sync_meter is not None else None
        t4 = time.perf_counter()
        totals = torch.tensor([float(rewards.sum()), rewards.numel(), changed, numel, cast_s,
                               t1 - t0, t3 - t1, t2 - t1, t3 - t2, t4 - t3, kl, served_eval, master_eval],
                              dtype=torch.float64)
        dist.all_reduce(totals)
        r_sum, r_n, changed, numel, cast_s, rollout_s, train_s, fwd_bwd_s, opt_s, extra_s = totals.tolist()[:10]
        kl, served_eval, master_eval = (v / world for v in totals.tolist()[10:])
        rows.append({
            "mode": mode, "seed": seed, "step": step, "reward": r_sum / r_n, "loss": float(loss.detach()),
            "changed": int(changed), "numel": int(numel), "changed_fraction": changed / numel,
            "gap_spacings": gap, "lag_steps": lag, "lag_drift_steps": lag_drift, "bias_spacings": bias,
            "kl_step": kl, "served_eval": served_eval, "master_eval": master_eval,
            "sync_bytes": (int(numel) * served_bytes if fair_cast is None  # no delta sync of fp32 weights
                           else delta_bytes if delta_bytes is not None else int(changed) * (4 + served_bytes)),
            "sync_bytes_dense": int(numel) * served_bytes,
            "cast_ms": 1e3 * cast_s / world, "rollout_ms": 1e3 * rollout_s / world,
            "train_ms": 1e3 * train_s / world, "fwd_bwd_ms": 1e3 * fwd_bwd_s / world,
            "opt_ms": 1e3 * opt_s / world, "extra_ms": 1e3 * extra_s / world, **engine_columns,
        })
        if progress is not None:
            progress.set_postfix_str(f"{mode} seed {seed} reward {rows[-1]['reward']:.3f} "
                                     f"changed {100 * rows[-1]['changed_fraction']:.2f}%", refresh=False)
            progress.update(1)
    final: dict[str, Any] = {"mode": mode, "seed": seed}
    if fair_cast is not None:
        copy = served_copy(engine, cfg, seed, rank)
        if copy is not None:
            final.update(mismatch(copy, seqs))
    source.close()
    engine.destroy()
    del engine, opt, model
    gc.collect()
    return rows, final


def parse(argv: list[str] | None) -> JobConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true",
                        help=f"the regime's committed number of seeds: {FULL_SEEDS}")
    for f in fields(JobConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "modes":
            parser.add_argument(flag, default=None, help=f"comma-separated subset of {','.join(MODES)}")
        elif f.name == "regime":
            parser.add_argument(flag, default=None, choices=sorted(REGIMES), help=f"default {f.default!r}")
        else:
            parser.add_argument(flag, type=type(f.default), default=None, help=f"default {f.default!r}")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    regime = args.regime or JobConfig.regime
    cfg = replace(JobConfig(), regime=regime, **REGIMES[regime])
    if args.full:
        cfg = replace(cfg, seeds=FULL_SEEDS[regime])
    given = {f.name: getattr(args, f.name) for f in fields(JobConfig) if getattr(args, f.name) is not None}
    if "modes" in given:
        given["modes"] = tuple(m.strip() for m in given["modes"].split(",") if m.strip())
        unknown = [m for m in given["modes"] if m not in MODES]
        if unknown:
            parser.error(f"unknown mode(s) {unknown}; choose from {','.join(MODES)}")
    cfg = replace(cfg, **given)
    from faircast_ds.jobs.engines import ENGINES

    if cfg.engine not in ENGINES:
        parser.error(f"unknown --engine {cfg.engine!r}; choose from {', '.join(ENGINES)}")
    if not cfg.name:
        cfg = replace(cfg, name=f"{regime}-" + ("full-" if args.full else "") + time.strftime("%Y%m%d-%H%M%S"))
    return cfg


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

    from faircast_ds.jobs import plots, report

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
    task = LowTokenTask(vocab=cfg.vocab, prompt_len=cfg.prompt_len, gen_len=cfg.gen_len, group=cfg.group,
                        prompt_vocab=cfg.prompt_vocab)
    progress = None
    if rank == 0:
        from tqdm import tqdm

        os.makedirs(run_dir, exist_ok=True)
        print(f"[grpo] {len(cfg.modes)} modes x {cfg.seeds} seeds x {cfg.steps} steps, world size {world} "
              f"-> {run_dir}", flush=True)
        progress = tqdm(total=len(cfg.modes) * cfg.seeds * cfg.steps, unit="step", file=sys.stdout,
                        dynamic_ncols=True, mininterval=2.0)
    rows: list[dict] = []
    finals: list[dict] = []
    csv_path = os.path.join(run_dir, "steps.csv")
    for seed in range(cfg.first_seed, cfg.first_seed + cfg.seeds):
        for mode in cfg.modes:
            run_rows, final = run_one(mode, seed, cfg, task, progress)
            rows += run_rows
            finals.append(final)
            if rank == 0:  # written as runs finish, so an interrupted job keeps what it did
                report.write_csv(csv_path, rows)
    from faircast_ds.jobs import engines

    engines.shutdown()  # the vLLM engine, if one served the rollouts
    if rank == 0:
        progress.close()
        wall = time.time() - started
        summaries = report.summarize(rows, finals, cfg.modes, tie=cfg.tie)
        plots.plot_run(rows, os.path.join(run_dir, "reward.png"), title=report.headline(cfg, world))
        table = report.markdown(summaries, cfg, world, wall) + report.engine_table(rows, cfg.modes)
        with open(os.path.join(run_dir, "results.md"), "w") as f:
            f.write(table)
        with open(os.path.join(run_dir, "run.json"), "w") as f:
            json.dump({"config": asdict(cfg), "world_size": world, "wall_s": wall, "finals": finals}, f, indent=1)
        text = report.summary_text(summaries, cfg, world, wall, run_dir)
        with open(os.path.join(run_dir, "summary.txt"), "w") as f:
            f.write(text + "\n")
        print("\n" + text, flush=True)
    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
