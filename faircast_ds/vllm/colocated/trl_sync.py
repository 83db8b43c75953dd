"""TRL's colocated vLLM engine (``GRPOConfig(use_vllm=True, vllm_mode="colocate")``) loaded through the
engine's reload path and checked through its kernels after every sync: one call on a built trainer,
:func:`install_trl_sync`.

TRL 1.16 builds one in-process ``vllm.LLM`` per training rank (``distributed_executor_backend=
"external_launcher"``) and syncs it in ``VLLMGeneration.sync_weights``: for every parameter it gathers
(``_iter_named_params``: one ZeRO-3 gather at a time, PEFT merged, the names vLLM expects) it calls the
engine model's ``load_weights([(name, tensor)])``. Under ZeRO-3 those tensors are the served bf16 copy
Fair Cast wrote, so on GPUs that load carries Fair Cast's bits as they are. vLLM's CPU build cannot take
it: after loading, its linear layers repack their weight for oneDNN and replace the parameter with one
that has no ``weight_loader``, so the first matrix raises ``AttributeError: 'Parameter' object has no
attribute 'weight_loader'`` (``vllm/model_executor/layers/linear.py``).

:class:`TrlReloadSync` replaces that method on the trainer's ``VLLMGeneration`` (an instance attribute; TRL's
class is untouched). ``load="reload"`` (default) streams the same walk (TRL's own ``_iter_named_params``,
each tensor copied while it is gathered) into the worker's ``reload_weights(..., is_checkpoint_format=True)``,
which rebuilds each vLLM layer once all of its tensors arrived and processes it as a load from disk would
(on CPU: repacks it), then refreshes an LM head tied to the embedding (:func:`faircast_ds.vllm.engine_weights.
refresh_tied_heads`). ``load="trl"`` keeps TRL's own load (what runs on GPUs) and only adds the check.

The check (``verify``) walks the served parameters a second time, gathered again from the trainer, and
compares each with what the engine's kernels compute with, read back through them
(:func:`faircast_ds.vllm.engine_weights.read_back`: a linear layer applied to identity rows through its own
``quant_method``, an embedding looked up for every id, a tied head read through its own kernel), on
canonical bits (:mod:`faircast_ds.vllm.bits`). It also fails when an engine parameter is reached by no
served tensor. Every rank checks its own engine; a difference on any rank raises
:class:`~faircast_ds.vllm.engine_weights.EngineWeightsMismatch` on every rank, naming the rank and tensors.
"""
from __future__ import annotations

import time
from typing import Any, Iterator

import torch

from faircast_ds._util import dist
from faircast_ds.vllm.bits import digest
from faircast_ds.vllm.engine_weights import (
    TIED_EMBEDDING,
    TIED_HEAD,
    EngineWeightsMismatch,
    quiet_reload,
    read_back,
    refresh_tied_heads,
    resolve,
    ties_head,
)

LOADS = ("reload", "trl")


def install_trl_sync(trainer: Any, *, load: str = "reload", verify: bool | int = True) -> TrlReloadSync:
    """Make ``trainer``'s colocated vLLM engine (TRL's ``GRPOTrainer``, or any trainer holding a TRL
    ``VLLMGeneration`` as ``vllm_generation`` in colocate mode) load the served bits through its reload
    path (``load="reload"``) or TRL's own ``load_weights`` (``load="trl"``), and read them back through its
    kernels after every sync (``verify=True``), every ``verify``-th sync (an int), or never (False).
    Call it on every rank, after the trainer is built and before ``train()``; returns the installed sync."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None:
        raise ValueError("install_trl_sync needs a trainer built with use_vllm=True (it has no vllm_generation)")
    return TrlReloadSync(generation, load=load, verify=verify).install()


class TrlReloadSync:
    """What ``VLLMGeneration.sync_weights`` does once :meth:`install` ran (see the module's docstring).
    ``history`` keeps one record per sync (seconds, tensors, whether it was checked)."""

    def __init__(self, generation: Any, *, load: str = "reload", verify: bool | int = True) -> None:
        if getattr(generation, "mode", None) != "colocate":
            raise ValueError(f"install_trl_sync is for vllm_mode='colocate', not {getattr(generation, 'mode', None)!r} "
                             "(server mode loads in the vLLM server's process)")
        if load not in LOADS:
            raise ValueError(f"load must be one of {', '.join(map(repr, LOADS))}, not {load!r}")
        if isinstance(verify, bool):
            every = 1 if verify else 0
        elif isinstance(verify, int) and verify >= 0:
            every = verify
        else:
            raise ValueError(f"verify must be True, False or a whole number of syncs >= 0, not {verify!r}")
        if getattr(generation, "enable_sleep_mode", False):
            raise ValueError("vllm_enable_sleep_mode=True is not supported by install_trl_sync (its wake-up and "
                             "re-push of discarded weights are not checked here); leave it off")
        self.generation = generation
        self.load, self.every = load, every
        self.syncs = 0
        self.history: list[dict[str, Any]] = []
        self.trl_sync = None

    # -- the engine, in this process --------------------------------------------------------------
    @property
    def worker(self) -> Any:
        """The engine's (single, in-process) worker: what TRL itself loads through."""
        return self.generation.llm.llm_engine.model_executor.driver_worker

    def engine_model(self) -> torch.nn.Module:
        runner = self.worker.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def engine_dtype(self) -> torch.dtype:
        return self.generation.llm.llm_engine.model_config.dtype

    # -- installing ---------------------------------------------------------------------------------
    def install(self) -> TrlReloadSync:
        current = self.generation.sync_weights
        if isinstance(getattr(current, "__self__", None), TrlReloadSync):
            raise ValueError("install_trl_sync was already called on this trainer")
        self.trl_sync = current  # TRL's own method, bound: what load="trl" runs (kept, callable as it was)
        self.generation.sync_weights = self.sync
        when = {0: "never", 1: "after every sync"}.get(self.every, f"after every {self.every}th sync")
        dist.log_rank0(f"[fair_cast] TRL's colocated vLLM sync: load={self.load}, engine kernels read back {when}")
        return self

    # -- one sync -----------------------------------------------------------------------------------
    def sync(self) -> None:
        """Load the served weights into this rank's engine, then (when due) check them through its kernels.
        A collective (the gathers of ZeRO-3): every rank calls it, as TRL does."""
        began = time.perf_counter()
        if self.load == "trl":
            self.trl_sync()
            tensors = None
        else:
            tensors = self._reload()
        loaded = time.perf_counter()
        self.syncs += 1
        record: dict[str, Any] = {"sync": self.syncs, "load": self.load, "tensors": tensors,
                                  "load_seconds": loaded - began, "verified": False}
        if self.every and (self.syncs - 1) % self.every == 0:
            self.check()
            record.update(verified=True, verify_seconds=time.perf_counter() - loaded)
        self.history.append(record)

    def _walk(self) -> Iterator[tuple[str, torch.Tensor]]:
        """TRL's walk of the served parameters (gathers one at a time under ZeRO-3; PEFT merged), as TRL names them."""
        return self.generation._iter_named_params()

    def _reload(self) -> int:
        walk = self._walk()
        names: list[str] = []

        def copies() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in walk:
                names.append(name)
                yield name, tensor.detach().clone()  # valid after the walk releases the gathered parameter

        def load() -> None:
            try:
                with quiet_reload(), torch.inference_mode():
                    self.worker.reload_weights(weights_iterator=copies(), is_checkpoint_format=True)
                    refresh_tied_heads(self.engine_model(), names)
            finally:
                for _ in walk:  # a load that stopped early: still take part in every remaining gather
                    pass

        failure = dist.first_failure(load, Exception)
        if failure is not None:
            raise EngineWeightsMismatch(f"the engine's reload of the served weights failed on {failure}", [])
        self.generation.llm.reset_prefix_cache()  # cached KV blocks were computed with the previous weights
        return len(names)

    # -- the check ----------------------------------------------------------------------------------
    def check(self) -> dict[str, int]:
        """Compare every served tensor (gathered again) with what this rank's engine computes with; raise
        :class:`EngineWeightsMismatch` on every rank when any rank differs. A collective."""
        model, dtype = self.engine_model(), self.engine_dtype()
        problems: list[str] = []
        reached: set[int] = set()
        embedding = None
        checked = 0
        with torch.inference_mode():
            for name, tensor in self._walk():  # every rank walks it whole: the gathers are collectives
                checked += 1
                if tensor.dtype != dtype:
                    problems.append(f"{name}: served as {tensor.dtype}, the engine computes in {dtype} (it rounds "
                                    "to nearest when it loads: is bf16 on in the DeepSpeed config?)")
                    continue
                want = digest(tensor)
                if name == TIED_EMBEDDING:
                    embedding = (want, tuple(tensor.shape))
                problem = self._compare(model, name, tuple(tensor.shape), dtype, want, reached)
                if problem:
                    problems.append(problem)
            if ties_head(model):
                if embedding is None:
                    problems.append(f"{TIED_HEAD}: the engine ties its head to {TIED_EMBEDDING}, which was not served")
                else:
                    checked += 1
                    problem = self._compare(model, TIED_HEAD, embedding[1], dtype, embedding[0], reached)
                    if problem:
                        problems.append(problem)
        unreached = [n for n, p in model.named_parameters() if id(p) not in reached]
        if unreached:
            problems.append(f"{len(unreached)} engine parameter(s) no served tensor reaches: {unreached[:5]}")
        mine = None
        if problems:
            mine = (f"the engine computes with other bits than the served ones ({len(problems)} problem(s) in "
                    f"{checked} tensors; canonical bits: -0.0 and subnormals count as +0): " + "; ".join(problems[:5]))
        failure = dist.first_failure(lambda: _raise(mine), RuntimeError)
        if failure is not None:
            raise EngineWeightsMismatch(f"after TRL's sync (sync {self.syncs}), {failure}",
                                        [p.split(":", 1)[0] for p in problems])
        return {"checked": checked}

    @staticmethod
    def _compare(model: torch.nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, want: str,
                 reached: set[int]) -> str | None:
        try:
            module, attr, _ = resolve(model, name)
            param = getattr(module, attr, None)
            if isinstance(param, torch.Tensor):
                reached.add(id(param))
            got = digest(read_back(model, name, shape, dtype))
        except (KeyError, ValueError) as exc:
            return f"{name}: {exc}"
        return None if got == want else f"{name}: engine {got[:16]}…, served {want[:16]}…"


def _raise(message: str | None) -> None:
    if message is not None:
        raise RuntimeError(message)
