"""Rank, world size, rank-0 logging and agreement across ranks, for code that also runs without
torch.distributed (one process). The one place these rules live; DeepSpeed's and Megatron's
process groups are torch.distributed groups, so nothing here imports either framework."""
from __future__ import annotations

import json
import logging
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

logger = logging.getLogger("faircast_ds")


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the default group; (0, 1) without torch.distributed."""
    if initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def log_rank0(message: str) -> None:
    """Log ``message`` and print it on rank 0 only: one line per job, visible in every launcher's output
    whatever logging the program set up."""
    if rank_world()[0] == 0:
        logger.info(message)
        print(message, flush=True)


def from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a collective; the object itself where there is one rank)."""
    if rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def first_failure(local: Callable[[], None], errors: type[BaseException] | tuple[type[BaseException], ...]
                  ) -> str | None:
    """Run ``local`` (no collective inside) on every rank; return the first failing rank's message,
    the same on every rank, or None. A collective: no rank goes on to communicate while another failed."""
    try:
        local()
        mine = None
    except errors as exc:
        mine = str(exc)
    rank, world = rank_world()
    if world == 1:
        return mine
    messages: list[str | None] = [None] * world
    dist.all_gather_object(messages, mine)
    for r, message in enumerate(messages):
        if message is not None:
            return f"rank {r}: {message}"
    return None


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum over ranks of a few float64 figures (the figures themselves with one rank)."""
    import torch

    t = torch.tensor(values, dtype=torch.float64)
    if initialized():
        device = collective_device()
        reduced = t.to(device)
        dist.all_reduce(reduced)
        t = reduced.cpu()
    return t.tolist()


def collective_device() -> Any:
    """Where the default group's tensors must live: CPU for gloo and MPI (and a mixed ``cpu:gloo,...``
    backend), else the accelerator's current device (NCCL, HCCL, XCCL take device tensors only)."""
    import torch

    backend = str(dist.get_backend())
    if backend in ("gloo", "mpi") or "cpu:" in backend:
        return torch.device("cpu")
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return accelerator.current_accelerator()
    return torch.device("cuda", torch.cuda.current_device())


POST_WAIT_S = 300.0  # the longest a rank waits for the others' posts (less when the store's timeout is shorter)
_posts: dict[tuple, int] = {}  # (name, ranks) -> posts made so far: the same sequence number on every rank


class RanksMissingError(RuntimeError):
    """Some ranks of the group never posted: they do not run the code that posts (not installed there)."""

    def __init__(self, missing: list[int], waited_s: float, name: str) -> None:
        self.missing, self.waited_s = missing, waited_s
        super().__init__(f"ranks {missing} posted no {name!r} within {waited_s:.0f}s")


class NoStoreError(RuntimeError):
    """The default process group has no key-value store to post to."""


def post_and_gather(name: str, value: Any, group: Any = None, *, wait_s: float | None = None,
                    allow_missing: bool = False) -> dict[int, Any]:
    """Every rank of ``group``'s JSON ``value`` (global rank -> value), exchanged through the process
    group's key-value store, not a collective: a rank that never posts (it lacks the code that does)
    leaves the others with :class:`RanksMissingError` after a bounded wait (``wait_s``, default
    POST_WAIT_S, never longer than the store's timeout), where a collective would leave them matched against
    its next, unrelated collective until the job's timeout. ``allow_missing``: leave such ranks out
    of the result instead. One post per call; every rank must make the same calls for ``name`` in the
    same order. ``{rank: value}`` alone with one rank or without torch.distributed."""
    if not initialized() or dist.get_world_size(group=group) == 1:
        return {rank_world()[0]: value}
    from torch.distributed import distributed_c10d

    if str(dist.get_backend()) == "mpi":  # MPI rendezvous has no key-value store (torch keeps a placeholder)
        raise NoStoreError(f"the MPI backend has no store to post {name!r} to")
    try:
        store = distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError) as exc:
        raise NoStoreError(f"the default process group has no store to post {name!r} to: {exc}") from exc
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
    n = _posts[(name, ranks)] = _posts.get((name, ranks), 0) + 1
    # no restart count in the key: torchrun's agents count restarts per node (only the failed node's
    # advances), and every rendezvous round gets a store of its own anyway
    prefix = f"faircast_ds/{name}/{'-'.join(map(str, ranks)) if len(ranks) <= 16 else hash(ranks)}/{n}"
    try:
        store.set(f"{prefix}/{dist.get_rank()}", json.dumps(value))
    except RuntimeError as exc:  # a placeholder store ("Not implemented")
        raise NoStoreError(f"the default process group's store cannot hold {name!r}: {exc}") from exc
    keys = {r: f"{prefix}/{r}" for r in ranks}
    timeout = store.timeout.total_seconds()
    wait_s = min(POST_WAIT_S if wait_s is None else wait_s, timeout if timeout > 0 else POST_WAIT_S)
    try:
        store.wait(list(keys.values()), timedelta(seconds=wait_s))
    except RuntimeError:  # DistStoreError: timed out
        missing = [r for r, k in keys.items() if not store.check([k])]
        if missing and not allow_missing:
            raise RanksMissingError(missing, wait_s, name) from None
        keys = {r: k for r, k in keys.items() if r not in missing}
    return {r: json.loads(store.get(k)) for r, k in keys.items()}
