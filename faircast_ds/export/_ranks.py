"""The training job's rank, world size and rank-0 agreement, for code that also runs without
torch.distributed."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a collective; the object itself where there is one rank)."""
    if rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
