"""Rank, world size, rank-0 logging and agreement across ranks, for code that also runs without
torch.distributed (one process). The one place these rules live; DeepSpeed's and Megatron's
process groups are torch.distributed groups, so nothing here imports either framework."""
from __future__ import annotations

import logging
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
        dist.all_reduce(t)
    return t.tolist()
