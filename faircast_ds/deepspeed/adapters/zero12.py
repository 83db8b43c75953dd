"""ZeRO-1 and ZeRO-2 (``deepspeed/runtime/zero/stage_1_and_2.py``, DeepSpeedZeroOptimizer).

The cast is inline in ``step()`` (``bit16_partitions[partition_id].data.copy_(fp32_partition)``,
through a pinned buffer with CPU offload), then the module-level ``all_gather_dp_groups`` builds the
bf16 model. No method wraps the cast, so we wrap the all-gather in the module's own namespace: just
before it runs, this rank's bf16 partition is rewritten by the caster from its fp32 partition.
``update_lp_params`` (universal checkpoint load) goes through the same all-gather. The flat
partitions cut across parameters; DeepSpeed's fragment mapping gives (parameter, index) per slice.

With CPU optimizer offload on an accelerator the fp32 partition is on the host and the served one on
the device: the caster casts on the host with the fused kernel, into DeepSpeed's own pinned bf16
buffer where the release has one (0.17.0+, ``compat.zero12_offload_staging``) or into its own, then
copies once to the device.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Iterator

import torch
from deepspeed import comm as dist

from faircast_ds.deepspeed import compat
from faircast_ds.deepspeed.adapters.base import ZeroAdapter
from faircast_ds.shard.adapter import narrowed, param_name
from faircast_ds.shard.caster import ShardSlice, with_padding
from faircast_ds.shard.routes import DEEPSPEED_RUNTIME, ROUTES


def slices_from_fragments(params: Iterable[Any], names: dict, total: int) -> list[ShardSlice]:
    """Slices of a flat fp32 partition that cuts across parameters, read from DeepSpeed's own
    fragment mapping (``param._hp_mapping``: where the local fragment sits in the parameter and in
    the partition); the gaps are alignment padding."""
    slices = []
    for param in params:
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:  # no element of this parameter lives in this rank's partition
            continue
        lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
        slices.append(ShardSlice(param_name(names, param), int(lp.start), int(lp.numel), int(hp.start)))
    return with_padding(slices, total)


class GatherSiteAdapter(ZeroAdapter):
    """Shared by optimizers that cast each local partition and then call ``all_gather_dp_groups``."""

    module: Any  # the DeepSpeed module whose global ``all_gather_dp_groups`` we wrap

    @property
    def cast_sites(self) -> str:
        """Where the cast is routed, for the guard's messages."""
        return f"{self.module.__name__}.all_gather_dp_groups, before it gathers"

    def __init__(self, optimizer: Any, caster: Any, names: dict) -> None:
        compat.require_internals(optimizer, module=self.module)
        super().__init__(optimizer, caster, names)
        self._in_step = False
        self._publishing = False
        n = len(self.masters())
        self._slices = [slices_from_fragments(self.lp_groups()[i], names, self.masters()[i].numel()) for i in range(n)]
        # step() overwrites our served partition by round-to-nearest before the all-gather, so the
        # last served bits are kept to count what a step changed.
        self._previous = [self.served(i).detach().clone() for i in range(n)]

    # what the subclass names
    def lp_groups(self) -> list[list[torch.Tensor]]:
        raise NotImplementedError

    def masters(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def partitions(self) -> list[list[torch.Tensor]]:
        raise NotImplementedError

    def groups_flat(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def served(self, i: int) -> torch.Tensor:
        rank = dist.get_rank(group=self.optimizer.real_dp_process_group[i])
        return self.partitions()[i][rank]

    def flat_groups(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, list[ShardSlice]]]:
        masters = self.masters()
        for i, slices in enumerate(self._slices):
            yield i, masters[i], self.served(i), slices

    def previous(self, key: int) -> torch.Tensor | None:
        return self._previous[key]

    def served_views(self, key: int) -> Iterator[tuple[ShardSlice, torch.Tensor]]:
        """What DeepSpeed all-gathers and serves from group ``key``: this rank's bf16 partition."""
        yield from narrowed(self.served(key), self._slices[key])

    def install(self) -> None:
        _wrap_gather(self.module)
        step = self.optimizer.step

        @functools.wraps(step)
        def step_then_cast(*args: Any, **kwargs: Any) -> Any:
            self._in_step = True
            try:
                return step(*args, **kwargs)
            finally:
                self._in_step = False

        self.optimizer.step = step_then_cast

    def before_gather(self) -> None:
        """Called by the wrapped all-gather: cast every local partition (a new step inside step())."""
        if self._publishing:
            return
        if self._in_step:
            self.caster.begin_step()
        self.cast_all()

    @torch.no_grad()
    def publish(self) -> None:
        """All-gather the served partitions as they are, then re-point the model's parameters."""
        opt = self.optimizer
        self._publishing = True
        try:
            self.module.all_gather_dp_groups(groups_flat=self.groups_flat(), partitioned_param_groups=self.partitions(),
                                             dp_process_group=opt.real_dp_process_group,
                                             start_alignment_factor=opt.nccl_start_alignment_factor,
                                             allgather_bucket_size=opt.allgather_bucket_size)
        finally:
            self._publishing = False
        if hasattr(opt, "_update_model_bit16_weights"):
            for i in range(len(self._slices)):
                opt._update_model_bit16_weights(i)


def _wrap_gather(module: Any) -> None:
    original: Callable[..., Any] = module.all_gather_dp_groups
    if getattr(original, "_faircast_wrapped", False):
        return

    @functools.wraps(original)
    def all_gather_dp_groups(*args: Any, **kwargs: Any) -> Any:
        groups = kwargs.get("partitioned_param_groups", args[1] if len(args) > 1 else None)
        # the live optimizer whose partitions these are (routes hold optimizers weakly; no stale id)
        route = ROUTES.find(lambda r: isinstance(r.adapter, GatherSiteAdapter) and r.kind == DEEPSPEED_RUNTIME
                            and r.adapter.partitions() is groups)
        if route is not None:
            route.adapter.before_gather()
        return original(*args, **kwargs)

    all_gather_dp_groups._faircast_wrapped = True  # type: ignore[attr-defined]
    module.all_gather_dp_groups = all_gather_dp_groups


class Zero12Adapter(GatherSiteAdapter):
    def __init__(self, optimizer: Any, caster: Any, names: dict) -> None:
        from deepspeed.runtime.zero import stage_1_and_2

        self.module = stage_1_and_2
        self.zero_stage = 2 if optimizer.partition_gradients else 1
        super().__init__(optimizer, caster, names)

    def lp_groups(self) -> list[list[torch.Tensor]]:
        return self.optimizer.bit16_groups

    def masters(self) -> list[torch.Tensor]:
        return self.optimizer.single_partition_of_fp32_groups

    def partitions(self) -> list[list[torch.Tensor]]:
        return self.optimizer.parallel_partitioned_bit16_groups

    def groups_flat(self) -> list[torch.Tensor]:
        return self.optimizer.bit16_groups_flat

    def staging(self, key: int) -> torch.Tensor | None:
        return compat.zero12_offload_staging(self.optimizer, key)
