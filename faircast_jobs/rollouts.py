"""Where the main job's rollouts come from: the trainer's own HF forward, or a real vLLM engine.

``--engine hf`` samples from the served copy through a plain HF model (tokens drawn by inverse CDF
from the task's shared uniforms). ``--engine vllm`` samples from a ``vllm serve`` process that rank 0
starts on loopback (:class:`faircast_ds.vllm.transfer.server.VllmServer`, its own process group,
killed at the end), which receives Fair Cast's served weights after every optimizer step through
vLLM's weight-transfer API and the ``faircast`` backend
(:class:`~faircast_ds.vllm.transfer.served_push.ServedPush`: vLLM's ``HTTPVLLMWeightSyncClient``, the
authenticated channel, dense then deltas; the engine reads the loaded layers back through its kernels
inside the finish call). vLLM's sampler draws with one seed per rollout, a
function of (seed, step, rank, index), so modes are still compared on common random numbers.
The loss stays on the trainer's served copy. Per step the vLLM source reports the check, the push
time and size, and the trainer-vs-engine log-prob gap on the step's own rollouts: the trainer as it
trains (HF eager) and aligned to the ``vllm-cpu`` profile (a no-grad forward of the served view).

One engine serves every run of a dtype (bf16 modes, or the fp32 reference); it starts from a
:func:`faircast_ds.export.save_hf` export of the first run's initial served weights, and each run
begins with a dense, verified push.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, Callable

import torch

from faircast_jobs.config import ROLLOUT_ENGINES as ENGINES

ALIGNED_PROFILE = "vllm-cpu"
KV_CACHE_GIB = 1 / 16  # 64 MiB: a step's rollouts need ~2 MB; the engine process then holds ~0.8 GiB, not ~1.7
_SEED_MOD = 2**63 - 1


class HFRollouts:
    """The trainer's own forward on the served copy (the job as it was)."""

    name = "hf"

    def __init__(self, sample: Callable[..., torch.Tensor], ds_engine: Any, view: Any) -> None:
        self.sample, self.ds_engine, self.view = sample, ds_engine, view

    def rollout(self, task: Any, seed: int, step: int, prompts: torch.Tensor,
                uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        policy = self.view.policy() if self.view is not None else None
        return self.sample(policy if policy is not None else self.ds_engine.module, prompts, uniforms), None

    def measure(self, trainer_logp: torch.Tensor, engine_logp: torch.Tensor | None,
                seqs: torch.Tensor, prompt_len: int, mask: torch.Tensor | None = None) -> dict[str, Any]:
        return {}

    def after_step(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class _Shared:
    """The process-wide vLLM engine (rank 0) and the dtype it serves."""

    engine: Any = None
    dtype: str | None = None
    push: Any = None


def rollout_seed(seed: int, step: int, rank: int, index: int) -> int:
    return ((((seed * 1_000_003 + step) * 1_009 + rank) * 1_000_033) + index) % _SEED_MOD


class VllmRollouts:
    """Rollouts and their log-probs from a vLLM engine on rank 0, pushed Fair Cast's served weights."""

    name = "vllm"

    def __init__(self, ds_engine: Any, view: Any, *, fp32: bool, seed: int, max_len: int, run_dir: str,
                 threads: int = 0, plane: str = "", gemm: str = "native", requests: int = 0,
                 gemm_cache: bool = False, spin_s: float | None = None) -> None:
        import torch.distributed as dist

        from faircast_ds.export import save_hf
        from faircast_ds.vllm.transfer import ServedPush, VllmServer

        self.dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.ds_engine, self.view, self.fp32 = ds_engine, view, fp32
        self.requests = requests  # in flight at once (0: every rollout of the step)
        dtype = "float32" if fp32 else "bfloat16"
        from faircast_ds.export.channel import SECRET_ENV

        if SECRET_ENV not in os.environ:  # one secret per job, on every rank and the server: the plane's
            from faircast_ds._util.dist import from_rank0  # handshake proves it (without one: same-user only)

            os.environ[SECRET_ENV] = from_rank0(os.urandom(16).hex())
        if _Shared.engine is not None and _Shared.dtype != dtype:
            _Shared.engine.close()
            _Shared.engine = None
        if _Shared.dtype != dtype:
            directory = os.path.join(run_dir, f"engine-export-{dtype}")
            save_hf(ds_engine, directory)  # a collective; rank 0 writes
            if self.rank == 0:
                # a `vllm serve` process on loopback with the faircast backend, killed with its group at the end
                _Shared.engine = VllmServer(directory, dtype=dtype, seed=seed, max_model_len=max_len,
                                            kv_cache_gib=KV_CACHE_GIB, threads=threads or os.cpu_count(), gemm=gemm,
                                            gemm_cache=gemm_cache and gemm == "fp32", spin_s=spin_s,
                                            log_path=os.path.join(run_dir, f"vllm-server-{dtype}.log"))
            _Shared.dtype = dtype
            dist.barrier()
        self.engine = _Shared.engine if self.rank == 0 else None
        if _Shared.push is not None:
            _Shared.push.close()  # the previous run's session: this run's first push is dense
        self.push = _Shared.push = ServedPush(ds_engine, self.engine, plane=plane or None)
        report = self.push.push(kind="dense")  # every run starts from its own initial weights
        if report.verified is not True:
            raise RuntimeError(f"the vLLM engine does not hold the served weights after the first push: {report}")
        self.engine_equal = True  # what the last loading push's check found
        self.measure_ms = math.nan

    def rollout(self, task: Any, seed: int, step: int, prompts: torch.Tensor,
                uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        per_rank, gen = prompts.shape[0], uniforms.shape[1]
        width = prompts.shape[1] + gen
        seqs = torch.empty(self.world * per_rank, width, dtype=torch.long)
        logps = torch.empty(self.world * per_rank, gen, dtype=torch.float32)
        if self.rank == 0:
            # every rank's prompts, drawn as that rank would (the draw is a function of seed, step, rank)
            every = [prompts] + [task.draw(per_rank, task.generator(seed, step, r))[0] for r in range(1, self.world)]
            all_prompts = torch.cat(every)
            seeds = [rollout_seed(seed, step, r, i) for r in range(self.world) for i in range(per_rank)]
            tokens, lp = self.engine.generate(all_prompts, gen, seeds, workers=self.requests or len(seeds))
            seqs.copy_(torch.cat([all_prompts, tokens], dim=1))
            logps.copy_(lp)
        self.dist.broadcast(seqs, src=0)
        self.dist.broadcast(logps, src=0)
        mine = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        return seqs[mine].clone(), logps[mine].clone()

    def measure(self, trainer_logp: torch.Tensor, engine_logp: torch.Tensor | None,
                seqs: torch.Tensor, prompt_len: int, mask: torch.Tensor | None = None) -> dict[str, Any]:
        """The gap between the trainer's log-probs of the step's rollouts and the engine's, over all ranks:
        the trainer's own (the loss's) and, for bf16, a trainer aligned to the vllm-cpu profile; and what an
        importance-sampling correction of that gap would see (:func:`is_figures`, over the loss's tokens)."""
        from faircast_ds.align import align_model
        from faircast_ds.align.meter import token_logprobs

        began = time.perf_counter()
        sums = [*_gap_sums(trainer_logp, engine_logp)]
        policy = self.view.policy() if self.view is not None and not self.fp32 else None
        if policy is not None:
            with torch.no_grad(), align_model(policy, ALIGNED_PROFILE):
                logits = policy(input_ids=seqs, use_cache=False).logits[:, prompt_len - 1:]
            lp = token_logprobs(logits, seqs[:, prompt_len - 1:])  # the completion tokens' log-probs
            sums += _gap_sums(lp, engine_logp)
        else:
            sums += [0.0, 0.0, 0.0, 0.0]
        totals = torch.tensor(sums, dtype=torch.float64)
        self.dist.all_reduce(totals)
        sq, k3, equal, n, sq_a, k3_a, equal_a, n_a = totals.tolist()
        correction = is_figures(trainer_logp, engine_logp, mask, self.dist)
        self.measure_ms = 1e3 * (time.perf_counter() - began)
        nan = math.nan
        return {
            "engine_mismatch_rms": math.sqrt(sq / n), "engine_mismatch_k3": k3 / n, "engine_equal_tokens": equal / n,
            "engine_mismatch_rms_aligned": math.sqrt(sq_a / n_a) if n_a else nan,
            "engine_mismatch_k3_aligned": k3_a / n_a if n_a else nan,
            "engine_equal_tokens_aligned": equal_a / n_a if n_a else nan, **correction,
        }

    def after_step(self) -> dict[str, Any]:
        """Push the new served weights (a collective) and report the check."""
        report = self.push.push()
        if report.params:
            self.engine_equal = bool(report.verified)
        # else the push changed nothing, so it loaded and checked nothing: the engine still holds the bits its
        # last loading push was checked against, and they are the served bits (the step changed none)
        return {"engine_weights_equal": self.engine_equal, "engine_sync_ms": 1e3 * report.seconds,
                "engine_sync_params": report.params, "engine_sync_bytes": report.bytes,
                "engine_load_ms": 1e3 * report.load_seconds, "engine_verify_ms": 1e3 * report.verify_seconds,
                "engine_measure_ms": self.measure_ms}

    def close(self) -> None:
        self.push = None
        self.ds_engine = self.view = None


# TRL's GRPOTrainer defaults for its vLLM importance-sampling correction (trl 1.16 GRPOConfig): the ratio of the
# trainer's to the engine's probability of each sampled sequence (exp of the summed per-token log-prob gap over
# the completion mask); a sequence whose ratio leaves [clip_min, clip_max] is masked out of the loss
IS_CLIP_MIN, IS_CLIP_MAX = 0.0, 3.0
PPO_BAND = (0.8, 1.2)  # PPO's clip range at epsilon 0.2: a token outside it before any update is "phantom clipped"


def is_figures(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor | None, dist: Any = None
               ) -> dict[str, float]:
    """Per step, over every rank's rollouts (``dist``: a torch.distributed module, None for this process
    alone): the token ratio exp(trainer - engine) min / mean / max over the masked tokens, the sequence ratio
    (TRL's ``sequence_*`` modes) min / mean / max, the share of sequences TRL's default ``sequence_mask``
    drops (ratio outside [IS_CLIP_MIN, IS_CLIP_MAX]), and the share of tokens whose ratio leaves PPO_BAND."""
    keep = torch.ones_like(trainer, dtype=torch.bool) if mask is None else mask.bool()
    r = torch.where(keep, trainer.double() - engine.double(), torch.zeros((), dtype=torch.float64))
    token = r.exp()[keep]
    seq = r.sum(dim=1).exp()
    sums = torch.tensor([float(token.sum()), float(token.numel()), float(seq.sum()), float(seq.numel()),
                         float(((seq < IS_CLIP_MIN) | (seq > IS_CLIP_MAX)).sum()),
                         float(((token < PPO_BAND[0]) | (token > PPO_BAND[1])).sum())], dtype=torch.float64)
    inf = torch.tensor(math.inf, dtype=torch.float64)
    # maxima of (-min, max) for tokens and sequences; an empty side (a rank with no masked token) is -inf
    peaks = torch.stack([-token.min() if token.numel() else -inf, token.max() if token.numel() else -inf,
                         -seq.min() if seq.numel() else -inf, seq.max() if seq.numel() else -inf])
    if dist is not None:
        dist.all_reduce(sums)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    t_sum, t_n, s_sum, s_n, masked, outside = sums.tolist()
    nan = math.nan
    return {"is_token_min": -float(peaks[0]) if t_n else nan, "is_token_mean": t_sum / t_n if t_n else nan,
            "is_token_max": float(peaks[1]) if t_n else nan, "is_seq_min": -float(peaks[2]) if s_n else nan,
            "is_seq_mean": s_sum / s_n if s_n else nan, "is_seq_max": float(peaks[3]) if s_n else nan,
            "is_seq_masked": masked / s_n if s_n else nan, "phantom_clip_tokens": outside / t_n if t_n else nan}


def _gap_sums(trainer: torch.Tensor, engine: torch.Tensor) -> list[float]:
    """Σr², Σ(exp(r) − 1 − r), #(r = 0), n for r = trainer − engine (per token)."""
    r = (trainer.detach().double() - engine.double()).reshape(-1)
    return [float(r.pow(2).sum()), float((torch.expm1(r) - r).sum()), float((r == 0).sum()), float(r.numel())]


def make(name: str, *, sample: Callable[..., torch.Tensor], ds_engine: Any, view: Any, fp32: bool, seed: int,
         max_len: int, run_dir: str, threads: int = 0, plane: str = "", gemm: str = "native",
         requests: int = 0, gemm_cache: bool = False, spin_s: float | None = None) -> HFRollouts | VllmRollouts:
    """``threads``, ``plane``, ``gemm``, ``requests``, ``gemm_cache`` and ``spin_s`` (--engine-threads,
    --push-plane, --engine-gemm, --engine-requests, --engine-gemm-cache, --engine-spin-s) are VllmRollouts'; the
    HF source has no engine."""
    if name == "hf":
        return HFRollouts(sample, ds_engine, view)
    if name == "vllm":
        return VllmRollouts(ds_engine, view, fp32=fp32, seed=seed, max_len=max_len, run_dir=run_dir, threads=threads,
                            plane=plane, gemm=gemm, requests=requests, gemm_cache=gemm_cache,
                            spin_s=spin_s)
    raise ValueError(f"unknown rollout engine {name!r}; choose from {', '.join(ENGINES)}")


def shutdown() -> None:
    """Stop the shared vLLM engine, if one was started."""
    if _Shared.push is not None:
        with contextlib.suppress(Exception):  # the server may be gone already
            _Shared.push.close()
    if _Shared.engine is not None:
        _Shared.engine.close()
    _Shared.engine, _Shared.dtype, _Shared.push = None, None, None
