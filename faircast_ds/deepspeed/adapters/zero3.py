"""ZeRO-3 (``deepspeed/runtime/zero/stage3.py``, DeepSpeedZeroOptimizer_Stage3).

Each parameter is partitioned on its own: rank r holds elements [r*n, (r+1)*n) of it (n =
``partition_numel()``), padding only on the last rank. A sub-group's flat shard is those slices
back to back. Refresh sites routed through the caster:
- ``_reassign_or_swap_out_partitioned_parameters`` after every sub-group's optimizer step (persistent
  parameters are then all-gathered by ``_post_step`` from these same cast shards);
- ``_rigid_load_state_dict`` (regular checkpoint load);
- ``load_hp_checkpoint_state_from_checkpoint_dir_stage3`` (universal checkpoint; its signature
  differs before 0.18.0, the wrapper passes every argument through);
- ``load_module_checkpoint_state_from_checkpoint_dir_stage3`` (universal, module only; 0.19.3+).
Which of them a release has, and its partition group, come from ``faircast_ds.deepspeed.compat``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import torch
from deepspeed import comm as dist

from faircast_ds.deepspeed import compat
from faircast_ds.deepspeed.adapters.base import ZeroAdapter
from faircast_ds.shard.adapter import UnsupportedSetupError, param_name
from faircast_ds.shard.caster import ShardSlice, with_padding


class Zero3Adapter(ZeroAdapter):
    zero_stage = 3
    cast_sites = ("stage3 _reassign_or_swap_out_partitioned_parameters, _rigid_load_state_dict, "
                  "load_hp/load_module_checkpoint_state_from_checkpoint_dir_stage3")

    def __init__(self, optimizer: Any, caster: Any, names: dict) -> None:
        compat.require_internals(optimizer)
        super().__init__(optimizer, caster, names)
        self._slices = [self._group_slices(i) for i in range(len(optimizer.fp16_groups))]
        self._at = [self._params_by_offset(i) for i in range(len(optimizer.fp16_groups))]

    def _params_by_offset(self, i: int) -> dict[int, Any]:
        """Sub-group ``i``'s parameters by the offset of their partition in the flat shard."""
        at, offset = {}, 0
        for param in self.optimizer.fp16_groups[i]:
            at[offset] = param
            offset += param.partition_numel()
        return at

    def _group_slices(self, i: int) -> list[ShardSlice]:
        opt = self.optimizer
        rank = dist.get_rank(group=compat.zero3_partition_group(opt, i))
        slices, offset = [], 0
        for param in opt.fp16_groups[i]:
            n = param.partition_numel()
            start = rank * n
            numel = max(0, min(n, param.ds_numel - start))
            if numel:
                slices.append(ShardSlice(param_name(self.names, param), start, numel, offset))
            offset += n
        return with_padding(slices, offset)

    def flat_groups(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, list[ShardSlice]]]:
        opt = self.optimizer
        for i, slices in enumerate(self._slices):
            yield i, opt.fp32_partitioned_groups_flat[i], opt.fp16_partitioned_groups_flat[i], slices

    def install(self) -> None:
        opt = self.optimizer
        if any(flat is None for flat in opt.fp16_partitioned_groups_flat):
            raise UnsupportedSetupError("fair_cast: ZeRO-3 parameters swapped to NVMe are not supported")
        opt._reassign_or_swap_out_partitioned_parameters = self._refresh_sub_group
        for site in compat.zero3_load_sites(opt):
            setattr(opt, site, self._recast_after(getattr(opt, site)))

    def _refresh_sub_group(self, sub_group_id: int) -> None:
        """Replaces DeepSpeed's ``fp16_flat.copy_(fp32_flat)`` after each sub-group's optimizer step."""
        opt = self.optimizer
        if sub_group_id == 0:
            self.caster.begin_step()
        self.caster.cast_flat(sub_group_id, opt.fp32_partitioned_groups_flat[sub_group_id],
                              opt.fp16_partitioned_groups_flat[sub_group_id], self._slices[sub_group_id])
        opt._unflatten_partitioned_parameters(sub_group_id)

    def _recast_after(self, load: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(load)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = load(*args, **kwargs)  # restores fp32 and refreshes bf16 by round-to-nearest ...
            if self.load_cast_deferred:  # ... which Fair Cast's restore after the load replaces, or
                return result
            self.cast_all()  # ... which we replace here with the configured cast;
            for i in range(len(self._slices)):  # DeepSpeed re-gathers persistent parameters after the load
                self.optimizer._unflatten_partitioned_parameters(i)
            return result

        return wrapped

    @torch.no_grad()
    def publish(self) -> None:
        opt = self.optimizer
        for i in range(len(self._slices)):
            opt._unflatten_partitioned_parameters(i)
        if opt.persistent_parameters:  # kept gathered: release (the shard stays), then gather the new shards
            opt.persistent_parameters[0].partition(opt.persistent_parameters)
            opt.persistent_parameters[0].all_gather(opt.persistent_parameters)

    def served_views(self, key: int) -> Iterator[tuple[ShardSlice, torch.Tensor]]:
        """What DeepSpeed gathers and serves from sub-group ``key``: each parameter's ``ds_tensor``
        (its elements of this rank's partition), beside the slice of the flat shard it came from."""
        at = self._at[key]
        for s in self._slices[key]:
            if not s.is_padding:
                yield s, at[s.offset].ds_tensor.detach().view(-1).narrow(0, 0, s.numel)
