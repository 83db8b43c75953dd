"""The GRPO job's settings: :class:`JobConfig`, the named regimes, the job's modes, and its command line.

Pure Python (no torch, no DeepSpeed), so the job (``grpo.py``), its report (``report.py``) and the tests
read one definition. Every setting is validated when a :class:`JobConfig` is built, whether from the
command line (:func:`parse`, which turns the error into a usage message) or from a run's ``run.json``
(:meth:`JobConfig.from_json`).
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Sequence

JOB_MODES: tuple[str, ...] = ("fp32", "nearest", "stochastic", "dither", "error_feedback")
REFERENCE = "fp32"  # served = master: ZeRO-3 without bf16 and without Fair Cast, no rounding at all
CONTROL = "nearest"  # round-to-nearest, DeepSpeed's own cast: what every other mode is paired against
ROLLOUT_ENGINES: tuple[str, ...] = ("hf", "vllm")  # where rollouts come from (jobs/rollouts.py)
ROLLOUT_VIA: tuple[str, ...] = ("view", "module")
# how the trainer's bf16 linear layers multiply: PyTorch's own bf16 kernels, or fp32 products of the bf16 values
# rounded once to bf16 (faircast_ds/models/gemm.py: on a CPU without AVX-512 the former is 10-20x slower)
GEMMS: tuple[str, ...] = ("native", "fp32")
ADAMWS: tuple[str, ...] = ("loop", "fused")  # --adamw: torch AdamW's per-tensor loop or its fused CPU kernel
GEMM_NOTES = {"native": "", "fp32": ", bf16 GEMMs summed in fp32 (--gemm fp32)"}  # what a headline adds for each
MAX_SEED = 2**31 - 1


@dataclass(frozen=True)
class JobConfig:
    """Settings of one invocation. ``rollouts`` counts rollouts per step over all ranks. The defaults are
    the paper regime (``REGIMES``). Seeds: ``seed_list`` when given, else ``first_seed ..
    first_seed + seeds - 1`` (:attr:`seed_ids`)."""

    steps: int = 500
    seeds: int = 1
    first_seed: int = 0
    seed_list: tuple[int, ...] = ()  # explicit seeds (``--seed-list 8-19`` or ``0,3,5``); overrides the two above
    lr: float = 1.5e-6  # AdamW learning rate (no weight decay)
    hidden: int = 128
    layers: int = 2
    vocab: int = 256
    init_std: float = 0.1  # std of the normal init of the weights, before the bf16 rounding
    rollouts: int = 256
    group: int = 8
    prompt_len: int = 2
    gen_len: int = 2
    prompt_vocab: int = 1  # prompt tokens drawn from [0, prompt_vocab); 0: the whole vocabulary (tasks.py)
    modes: tuple[str, ...] = JOB_MODES
    # the off-grid control: every fp32 master starts at a seeded random position strictly inside the
    # round-to-nearest cell of its bf16 initial value (jobs/offgrid.py), the same for every mode of a seed
    off_grid: bool = False
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
    # on rank 0, pushed the served weights after every step; faircast_jobs/rollouts.py). Flag: --engine
    rollout_engine: str = "hf"
    # comma-separated steps after which each engine saves a DeepSpeed checkpoint (ZeRO optimizer state with
    # AdamW's moments, for `faircast-ds predict`) to <out>/<name>/checkpoints/<mode>-seed<seed>/global_step<N>
    save_at: str = ""
    regime: str = "paper"
    out: str = "runs"
    name: str = ""
    # a published pretrained model by name (faircast_ds/models/pretrained.py; "" = the tiny Qwen3 built from the
    # flags above) and its task (jobs/addition.py); --model applies PRETRAINED_DEFAULTS first
    model: str = ""
    task: str = ""  # "" = the tiny model's low-token task; "addition" needs --model
    # addition: operands drawn from [1, operand_max] (one digit: one prompt length; 5 or more: a two-digit sum)
    operand_max: int = 9
    # KL(master || served) per token on a fixed batch of right answers every this many steps (0: off)
    kl_master_every: int = 0
    # a DeepSpeed checkpoint of the running engine every this many steps (and at its last step), kept in
    # <out>/<name>/checkpoints/<mode>-seed<seed>/ (the newest only): the same command resumes from it (0: off)
    save_every: int = 0
    # with --save-every: stop this session after training this many steps (0: run to the end); the same
    # command without it (or with it again) resumes where the session stopped
    session_steps: int = 0
    # "native" or "fp32" (GEMMS); --model sets fp32. Only the bf16 modes' trainer is affected (the fp32 reference
    # multiplies in fp32 either way; the vLLM engine uses its own kernels)
    gemm: str = "native"
    # DeepSpeed ZeRO stage of the trainer (1, 2 or 3). The cast's served bits do not depend on it (tests/
    # deepspeed_tests/test_stages.py), but the SmolLM2 job's trajectory does: at stage 2 its first step's loss
    # already differs from stage 3's (benchmarks/pretrained_step.py; docs/pretrained.md), so runs are compared
    # only at one stage
    zero_stage: int = 3
    # --engine vllm: the `vllm serve` process's CPU threads (0: every core of this host; the trainer's ranks
    # wait while it samples). Its tokens and log-probs are bit-for-bit the same at 1 and 2 threads
    # (benchmarks/pretrained_step.py checks the trajectory), so a job may resume with another value
    engine_threads: int = 0
    # --engine vllm: how many of a step's completion requests `vllm serve` has in flight at once (0: all of them,
    # so each decode step runs every rollout in one batch; the runs started before 2026-12-07 ran 8, two waves).
    # With --engine-gemm fp32 a row's products do not depend on the rows beside it, so the tokens and log-probs
    # are the same at any value (tests/models/test_pretrained.py: one request at a time against all at once) and a
    # job with the fp32 products may resume with another value (resume.FREE_WHEN)
    engine_requests: int = 0
    # --engine vllm: the plane the served weights reach `vllm serve` by ("": ServedPush's fastest that works,
    # shm on one host, with a secret the job draws; every push is verified, so a job may resume with another)
    push_plane: str = ""
    # --engine vllm: how the engine's bf16 matrix products are computed on CPU: "native" (vLLM's own dispatch;
    # on a CPU without bf16 arithmetic PyTorch's generic bf16 loop) or "fp32" (fp32 sums of the bf16 values,
    # rounded once: the arithmetic of --gemm fp32 and of a GPU's bf16 GEMM; faircast_ds/vllm/cpu_gemm.py).
    # The served weights are the same either way; the sampled tokens are not, so a job resumes only with its own
    engine_gemm: str = "native"
    # --engine vllm with --engine-gemm fp32: 1 keeps each weight's fp32 copy in the engine's worker from one forward
    # to the next (dropped at any other call, a weight update included; faircast_ds/vllm/cpu_gemm.py): the same
    # products, so the same tokens (benchmarks/pretrained_step.py checks the trajectory) and a job may resume with
    # either value; 0: every forward converts the weights again (the runs started before 2026-12-07). With
    # --engine-gemm native there are no fp32 products and nothing to keep: the value does nothing
    engine_gemm_cache: int = 0
    # --engine vllm: how long `vllm serve`'s message-queue readers spin before sleeping (faircast_ds/vllm/spin.py;
    # vLLM's own is 1 s, what the runs started before 2026-12-07 had). 0: its engine core sleeps while its
    # worker computes instead of spinning beside it on the same cores. Timing only: the same tokens
    # (benchmarks/pretrained_step.py checks the trajectory), so a job may resume with another value
    engine_spin_s: float = 0.0
    # the trainer's AdamW over each rank's fp32 master shard: "loop" (torch's per-tensor loop, its CPU default)
    # or "fused" (torch's fused CPU kernel: one pass over the shard). The same update up to the order of its
    # float operations, so the trajectories part within a few steps: a job resumes only with its own
    adamw: str = "loop"

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def save_steps(self) -> tuple[int, ...]:
        """The steps of ``--save-at``, in order (empty: no checkpoints)."""
        return tuple(sorted({int(x) for x in self.save_at.split(",") if x.strip()}))

    @property
    def seed_ids(self) -> tuple[int, ...]:
        """The seeds this job runs, in order."""
        return self.seed_list or tuple(range(self.first_seed, self.first_seed + self.seeds))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, config: dict[str, Any]) -> "JobConfig":
        """A config from a run's ``run.json``. Older runs: ``engine`` was ``rollout_engine``, and a run
        without ``regime`` predates the regimes (:data:`LEGACY`); keys this version does not know are left out."""
        config = dict(config)
        if "regime" not in config:  # before regimes: the large-step job, without evaluations, KL or prompt_vocab
            config = {**LEGACY, **config}
        if "engine" in config and "rollout_engine" not in config:
            config["rollout_engine"] = config.pop("engine")
        known = {f.name for f in fields(cls)}
        values = {k: (tuple(v) if k in ("modes", "seed_list") else v) for k, v in config.items() if k in known}
        return cls(**values)


def _problems(cfg: JobConfig) -> list[str]:
    """Every invalid setting of ``cfg``, each named with its flag."""
    out = []

    def positive_int(name: str, value: Any, low: int = 1) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            out.append(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")

    for name in ("steps", "seeds", "hidden", "layers", "vocab", "rollouts", "group", "prompt_len", "gen_len",
                 "horizon", "sample", "diag_every"):
        positive_int(name, getattr(cfg, name))
    for name in ("first_seed", "prompt_vocab", "eval_every", "kl_every", "persist_threshold"):
        positive_int(name, getattr(cfg, name), low=0)
    for name in ("lr", "init_std"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            out.append(f"--{name.replace('_', '-')} must be a finite number > 0, got {value!r}")
    if isinstance(cfg.tie, bool) or not isinstance(cfg.tie, (int, float)) or not math.isfinite(cfg.tie) or cfg.tie < 0:
        out.append(f"--tie must be a finite number >= 0, got {cfg.tie!r}")
    if isinstance(cfg.hidden, int) and cfg.hidden % 4:
        out.append(f"--hidden must be a multiple of 4 (4 attention heads), got {cfg.hidden!r}")
    if not isinstance(cfg.prompt_vocab, bool) and isinstance(cfg.prompt_vocab, int) and isinstance(cfg.vocab, int) \
            and cfg.prompt_vocab > cfg.vocab:
        out.append(f"--prompt-vocab must be at most --vocab ({cfg.vocab}), got {cfg.prompt_vocab}")
    if not cfg.modes:
        out.append(f"--modes needs at least one of {','.join(JOB_MODES)}")
    unknown = [m for m in cfg.modes if m not in JOB_MODES]
    if unknown:
        out.append(f"unknown mode(s) {', '.join(map(repr, unknown))} in --modes; choose from {','.join(JOB_MODES)}")
    repeated = sorted({m for m in cfg.modes if cfg.modes.count(m) > 1})
    if repeated:
        out.append(f"--modes names {', '.join(repeated)} more than once")
    bad_seeds = [s for s in cfg.seed_list if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_SEED]
    if bad_seeds:
        out.append(f"--seed-list seeds must be integers in [0, {MAX_SEED}], got {bad_seeds}")
    elif len(set(cfg.seed_list)) != len(cfg.seed_list):
        out.append(f"--seed-list names a seed more than once: {list(cfg.seed_list)}")
    save = [x.strip() for x in cfg.save_at.split(",")] if isinstance(cfg.save_at, str) and cfg.save_at.strip() else []
    if not isinstance(cfg.save_at, str) or any(not x.isdigit() or not 1 <= int(x) <= cfg.steps for x in save):
        out.append(f"--save-at must be comma-separated steps in [1, --steps ({cfg.steps})], got {cfg.save_at!r}")
    if not isinstance(cfg.off_grid, bool):
        out.append(f"off_grid must be true or false, got {cfg.off_grid!r}")
    if cfg.rollout_engine not in ROLLOUT_ENGINES:
        out.append(f"unknown --engine {cfg.rollout_engine!r}; choose from {', '.join(ROLLOUT_ENGINES)}")
    if cfg.gemm not in GEMMS:
        out.append(f"unknown --gemm {cfg.gemm!r}; choose from {', '.join(GEMMS)}")
    if cfg.engine_gemm not in GEMMS:
        out.append(f"unknown --engine-gemm {cfg.engine_gemm!r}; choose from {', '.join(GEMMS)}")
    if cfg.adamw not in ADAMWS:
        out.append(f"unknown --adamw {cfg.adamw!r}; choose from {', '.join(ADAMWS)}")
    if cfg.rollout_via not in ROLLOUT_VIA:
        out.append(f"unknown --rollout-via {cfg.rollout_via!r}; choose from {', '.join(ROLLOUT_VIA)}")
    if cfg.model and cfg.model not in PRETRAINED:
        out.append(f"unknown --model {cfg.model!r}; choose from {', '.join(PRETRAINED)} (or leave it out for the tiny model)")
    if cfg.task not in TASKS:
        out.append(f"unknown --task {cfg.task!r}; choose from {', '.join(t for t in TASKS if t)}")
    elif bool(cfg.model) != bool(cfg.task):
        out.append("--task addition goes with --model (the tiny model runs its own low-token task)" if cfg.task
                   else f"--model {cfg.model} needs --task (choose from {', '.join(t for t in TASKS if t)})")
    for name in ("operand_max",):
        positive_int(name, getattr(cfg, name))
    if isinstance(cfg.operand_max, int) and not isinstance(cfg.operand_max, bool):
        if cfg.operand_max > 9:
            out.append(f"--operand-max must be at most 9 (one-digit operands), got {cfg.operand_max}")
        elif 0 < cfg.operand_max < 5:
            # the fixed batch the served and master policies are compared on holds two-digit sums (5 + 5 at
            # least); without this check the job found out after building the model and the engine
            out.append(f"--operand-max must be at least 5 (the fixed batch needs a two-digit sum), got {cfg.operand_max}")
    for name in ("kl_master_every", "save_every", "session_steps", "engine_threads", "engine_requests"):
        positive_int(name, getattr(cfg, name), low=0)
    from faircast_ds.vllm import spin

    if not spin.valid(cfg.engine_spin_s):
        out.append(f"--engine-spin-s must be a number of seconds >= 0, got {cfg.engine_spin_s!r}")
    if isinstance(cfg.engine_gemm_cache, bool) or cfg.engine_gemm_cache not in (0, 1):
        out.append(f"--engine-gemm-cache must be 0 or 1, got {cfg.engine_gemm_cache!r}")
    if cfg.push_plane:
        from faircast_ds.vllm.transfer.planes import PLANES

        if cfg.push_plane not in PLANES:
            out.append(f"--push-plane must be one of {', '.join(PLANES)} (or leave it out: the fastest that "
                       f"works), got {cfg.push_plane!r}")
    if isinstance(cfg.zero_stage, bool) or cfg.zero_stage not in (1, 2, 3):
        out.append(f"--zero-stage must be 1, 2 or 3, got {cfg.zero_stage!r}")
    if cfg.session_steps and not cfg.save_every:
        out.append("--session-steps needs --save-every (a session that stops must leave a checkpoint)")
    if cfg.model and cfg.gen_len < 16:
        out.append(f"--gen-len must be at least 16 for --model, got {cfg.gen_len}")
    if cfg.regime not in REGIMES:
        out.append(f"unknown --regime {cfg.regime!r}; choose from {', '.join(sorted(REGIMES))}")
    return out


# Named settings (``--regime``); flags given on the command line override them.
REGIMES: dict[str, dict[str, Any]] = {
    # RN changes <= 1% of served weights per step and its served copy trails the master by tens of
    # steps: lr 1.5e-6 on init std 0.1; one fixed prompt so every rollout pushes the weights the same
    # way and the fp32 policy learns within the run
    "paper": {},
    # the earlier main job: lr 1e-4, random prompts; RN changes ~12% per step, the lag reads ~0
    "large-step": {"steps": 300, "lr": 1e-4, "hidden": 256, "rollouts": 64, "prompt_len": 4, "gen_len": 8,
                   "prompt_vocab": 0, "eval_every": 60},
}
# the published models --model accepts (faircast_ds/models/pretrained.py's MODELS; tests/jobs/test_job_pretrained.py
# keeps the two lists equal) and the tasks --task accepts ("" = the tiny model's low-token task)
PRETRAINED: tuple[str, ...] = ("smollm2-135m-instruct",)
TASKS: tuple[str, ...] = ("", "addition")
# what --model sets before the flags given: GRPO at a post-training rate, 4 prompts x 4 completions of 16
# tokens from `vllm serve` fed the served weights, the fp32 reference and the two casts, checkpoints to resume
PRETRAINED_DEFAULTS: dict[str, Any] = {
    "steps": 100, "lr": 1e-5, "modes": ("fp32", "nearest", "dither"), "rollouts": 16, "group": 4, "gen_len": 16,
    "rollout_engine": "vllm", "rollout_via": "module", "eval_every": 0, "kl_every": 0, "kl_master_every": 5,
    "save_every": 5, "persist_threshold": 100_000, "task": "addition", "gemm": "fp32", "engine_gemm": "fp32",
    "engine_gemm_cache": 1,
}
# what a run.json written before regimes existed ran with (the settings it does not list)
LEGACY: dict[str, Any] = {"regime": "large-step", "prompt_vocab": 0, "eval_every": 0, "kl_every": 0}
FULL_SEEDS = {"paper": 8, "large-step": 5}  # --full: the seeds of the committed run of each regime


def parse_seed_list(text: str) -> tuple[int, ...]:
    """``"8-19"``, ``"0,3,5"`` or ``"0-2,7"`` -> the seeds in the order given (ranges inclusive)."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"--seed-list {text!r}: empty item")
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"--seed-list {text!r}: {part!r} is not a seed or a range a-b of seeds >= 0") from None
        if last < first:
            raise ValueError(f"--seed-list {text!r}: range {part!r} runs backwards")
        seeds += range(first, last + 1)
    return tuple(seeds)


def parse_modes(text: str) -> tuple[str, ...]:
    """``"fp32,nearest,dither"`` -> the modes in the order given (names checked by :class:`JobConfig`)."""
    modes = tuple(m.strip() for m in text.split(","))
    if "" in modes:
        raise ValueError(f"--modes {text!r}: empty item; give a comma-separated subset of {','.join(JOB_MODES)}")
    return modes


DESCRIPTION = """GRPO on a tiny Qwen3 under the deepspeed runner, one ZeRO-3 engine per (cast mode, seed):
does the cast of the served weights change what RL learns? (docs/grpo.md)

  deepspeed --num_gpus 2 --module faircast_jobs.grpo [options]     (bash launch/main.sh [options])"""

_SPECIAL = {"modes", "seed_list", "off_grid", "regime", "rollout_engine"}


def parser() -> argparse.ArgumentParser:
    """The job's command line: ``--full``, and one flag per :class:`JobConfig` field."""
    p = argparse.ArgumentParser(prog="faircast_jobs.grpo", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help=f"the regime's committed number of seeds: {FULL_SEEDS}")
    p.add_argument("--modes", default=None, help=f"comma-separated subset of {','.join(JOB_MODES)} (default: all)")
    p.add_argument("--seed-list", default=None,
                   help="explicit seeds, e.g. 8-19 or 0,3,5 (ranges inclusive); not with --seeds/--first-seed/--full")
    p.add_argument("--off-grid", action="store_true", default=None,
                   help="start every fp32 master at a seeded random point inside its bf16 cell (same for every mode)")
    p.add_argument("--regime", default=None, choices=sorted(REGIMES), help=f"default {JobConfig.regime!r}")
    p.add_argument("--engine", "--rollout-engine", dest="rollout_engine", default=None, choices=ROLLOUT_ENGINES,
                   help=f"where rollouts come from; default {JobConfig.rollout_engine!r}")
    for f in fields(JobConfig):
        if f.name not in _SPECIAL:
            p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None,
                           help=f"default {f.default!r}")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p


def parse(argv: Sequence[str] | None) -> JobConfig:
    """The job's settings from its command line: the regime's, then ``--full``, then the flags given.
    A bad value exits with a usage message naming the flag."""
    p = parser()
    args = p.parse_args(argv)
    regime = args.regime or JobConfig.regime
    given = {f.name: getattr(args, f.name) for f in fields(JobConfig) if getattr(args, f.name, None) is not None}
    try:
        if "modes" in given:
            given["modes"] = parse_modes(given["modes"])
        if "seed_list" in given:
            clash = [flag for flag, on in (("--seeds", "seeds" in given), ("--first-seed", "first_seed" in given),
                                           ("--full", args.full)) if on]
            if clash:
                raise ValueError(f"--seed-list names the seeds itself; drop {' and '.join(clash)}")
            given["seed_list"] = parse_seed_list(given["seed_list"])
        cfg = replace(JobConfig(regime=regime), **REGIMES[regime])
        if given.get("model"):
            cfg = replace(cfg, **PRETRAINED_DEFAULTS, model=given["model"])
        if args.full:
            cfg = replace(cfg, seeds=FULL_SEEDS[regime])
        cfg = replace(cfg, **given)
    except ValueError as e:
        p.error(str(e))
    if not cfg.name:
        prefix = f"{cfg.model}-{cfg.task}" if cfg.model else regime
        cfg = replace(cfg, name=f"{prefix}-" + ("full-" if args.full else "") + time.strftime("%Y%m%d-%H%M%S"))
    return cfg
