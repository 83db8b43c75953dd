"""KL between the fp32 master policy and the served (bf16, cast) policy on a fixed batch.

The batch is the task's own (``task.fixed_batch()``: for the addition task, whole chat turns with the right
answer), split across the ranks; every rank runs the same number of forwards (ZeRO-3 gathers). The figure
is the mean per answer token of KL(master || served) over the whole vocabulary: how far the policy the
engine samples from has drifted from the policy the optimizer holds. The fp32 reference serves its master
(0 by definition).
"""
from __future__ import annotations

from typing import Any

import torch


def kl_per_token(master_logits: torch.Tensor, served_logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(master) || softmax(served)) at every position ([..., vocab] -> [...]), in float64."""
    lm = torch.log_softmax(master_logits.double(), dim=-1)
    ls = torch.log_softmax(served_logits.double(), dim=-1)
    return (lm.exp() * (lm - ls)).sum(dim=-1)


@torch.no_grad()
def master_served_kl(run: Any, task: Any) -> float:
    """This rank's mean per-token KL(master || served) on its share of the task's fixed batch."""
    import torch.distributed as dist

    seqs, start = task.fixed_batch()
    rank, world = dist.get_rank(), dist.get_world_size()
    if seqs.shape[0] % world:
        raise ValueError(f"the fixed batch's {seqs.shape[0]} rows do not split over {world} ranks")
    rows = seqs[rank::world]
    master = run.master_view.policy()  # a collective: every rank gathers the fp32 masters
    served = run.policy()
    m = master(input_ids=rows, use_cache=False).logits[:, start - 1:-1]
    s = served(input_ids=rows, use_cache=False).logits[:, start - 1:-1]
    return float(kl_per_token(m, s).mean())
