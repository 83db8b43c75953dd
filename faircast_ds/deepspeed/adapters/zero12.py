"""ZeRO-1 and ZeRO-2 (``deepspeed/runtime/zero/stage_1_and_2.py``, DeepSpeedZeroOptimizer).

The cast takes the place of DeepSpeed's own copy. In ``step()`` DeepSpeed runs ``_optimizer_step(i)``
and then copies group ``i``'s fp32 partition into this rank's bf16 partition
(``bit16_partitions[partition_id].data.copy_(fp32_partition)``; through a pinned host buffer with CPU
offload on 0.17.0+), and after every group the module-level ``all_gather_dp_groups`` builds the bf16
model. We wrap ``_optimizer_step`` on the optimizer: once the fp32 partition of group ``i`` is stepped,
the caster writes the cast into the tensor that copy writes (the served partition, or DeepSpeed's
pinned buffer), counting the changes against the bits it overwrites, and for that one copy DeepSpeed's
list holds a stand-in that makes it a copy of a tensor onto itself (``compat.zero12_step_copy``), so
the partition is written once, by the cast. The wrapped all-gather puts DeepSpeed's own tensors back
before it gathers. ``update_lp_params`` (ZeRO-1/2's universal checkpoint load; BF16_Optimizer's step)
is routed the same way (``compat.lp_params_copy``). The flat partitions cut across parameters;
DeepSpeed's fragment mapping gives (parameter, index) per slice.

With CPU optimizer offload on an accelerator the fp32 partition is on the host and the served one on
the device: the caster casts on the host with the fused kernel into DeepSpeed's own pinned bf16 buffer
(0.17.0+, ``compat.zero12_offload_staging``), which DeepSpeed's second copy takes to the device; before
0.17.0 into a pinned buffer of its own, then one copy to the device. The pinned buffer holds the bits
last served (DeepSpeed's copy put them on the device); after anything else wrote the served partition
(a load, a restore) it is refreshed from it once, before the next cast counts against it.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Iterator

import torch
from deepspeed import comm as dist

from faircast_ds._util.dist import collective_device
from faircast_ds.deepspeed import compat
from faircast_ds.deepspeed.adapters.base import ZeroAdapter
from faircast_ds.shard.adapter import narrowed, param_name
from faircast_ds.shard.caster import NonFiniteWeightError, ShardSlice, with_padding
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
    """Shared by optimizers that copy each local fp32 partition into their bf16 partition and then call
    ``all_gather_dp_groups``: the cast takes the place of the copy (see the module docstring)."""

    module: Any  # the DeepSpeed module whose global ``all_gather_dp_groups`` we wrap

    @property
    def cast_sites(self) -> str:
        """Where the cast is routed, for the guard's messages."""
        return (f"{type(self.optimizer).__name__}'s copy of each fp32 partition into its bf16 partition "
                f"({self.copy_sites}), then {self.module.__name__}.all_gather_dp_groups")

    copy_sites = "update_lp_params"

    def __init__(self, optimizer: Any, caster: Any, names: dict) -> None:
        compat.require_internals(optimizer, module=self.module)
        super().__init__(optimizer, caster, names)
        self._in_step = False
        self._step_begun = False  # the caster's step was begun by this optimizer step's first cast
        self._publishing = False
        self._copied = False  # the cast took the place of DeepSpeed's copies: the next all-gather just gathers
        self._deferred: Exception | None = None  # a non-finite weight, raised once every group is cast
        self._stand_ins: list[tuple[list, int, Any]] = []  # (DeepSpeed's list, index, its own entry)
        self._staging_current: set[int] = set()  # groups whose pinned buffer holds the bits last served
        self.skipped_gathers = 0  # loads whose all-gather changed nothing and was skipped (recast_and_publish)
        n = len(self.masters())
        self._slices = [slices_from_fragments(self.lp_groups()[i], names, self.masters()[i].numel()) for i in range(n)]

    # what the subclass names
    def lp_groups(self) -> list[list[torch.Tensor]]:
        raise NotImplementedError

    def masters(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def partitions(self) -> list[list[torch.Tensor]]:
        raise NotImplementedError

    def groups_flat(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def rank_in(self, i: int) -> int:
        return dist.get_rank(group=self.optimizer.real_dp_process_group[i])

    def served(self, i: int) -> torch.Tensor:
        return self.partitions()[i][self.rank_in(i)]

    def flat_groups(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, list[ShardSlice]]]:
        masters = self.masters()
        for i, slices in enumerate(self._slices):
            yield i, masters[i], self.served(i), slices

    def served_views(self, key: int) -> Iterator[tuple[ShardSlice, torch.Tensor]]:
        """What DeepSpeed all-gathers and serves from group ``key``: this rank's bf16 partition."""
        yield from narrowed(self.served(key), self._slices[key])

    # ---- the cast in the place of DeepSpeed's copy ---------------------------------------------------------
    @torch.no_grad()
    def cast_into_copy_target(self, key: int, master: torch.Tensor, target: torch.Tensor) -> None:
        """Cast group ``key`` into ``target``, the tensor DeepSpeed's copy of this group writes: the served
        partition (changes counted against the bits it served), or the pinned buffer DeepSpeed copies to
        it (which holds those bits; refreshed from the served partition first when something else wrote
        that since). Also the hook route's entry (``faircast_ds.deepspeed.hook``)."""
        served = self.served(key)
        if target.data_ptr() == served.data_ptr():
            self.caster.cast_flat(key, master, served, self._slices[key], staging=self.staging(key))
            return
        if key not in self._staging_current:
            target.copy_(served)  # the bits served, for the change count (after a load or restore only)
        self._staging_current.add(key)  # DeepSpeed's next copy takes the buffer to the served partition
        self.caster.cast_flat(key, master, target, self._slices[key], staging=target)

    def _cast_at(self, site: compat.CopySite, key: int, master: torch.Tensor) -> None:
        """Cast into the copy's target, then stand in for its source or destination in DeepSpeed's list
        (until the all-gather). A non-finite weight is raised once every group is cast."""
        try:
            self.cast_into_copy_target(key, master, site.target)
        except NonFiniteWeightError as error:  # the shard is cast throughout; DeepSpeed's step goes on
            self._deferred = self._deferred or error
        self._stand_ins.append((site.holder, site.index, site.holder[site.index]))
        site.holder[site.index] = site.stand_in
        self._copied = True

    def _begin_step(self) -> None:
        if self._in_step and not self._step_begun:
            self.caster.begin_step()
            self._step_begun = True

    def restore(self) -> None:
        """DeepSpeed's own tensors back in its lists (the stand-ins only last for its copy)."""
        while self._stand_ins:
            holder, index, own = self._stand_ins.pop()
            holder[index] = own

    def _raise_deferred(self) -> None:
        error, self._deferred = self._deferred, None
        if error is not None:
            raise error

    @torch.no_grad()
    def cast_lp_params(self) -> None:
        """``update_lp_params``: every group cast into its served partition, each copy made a no-op."""
        self._begin_step()
        masters, partitioned = self.masters(), self.partitions()
        for i in range(len(self._slices)):
            self._cast_at(compat.lp_params_copy(partitioned, masters, self.rank_in(i), i), i, masters[i])

    def cast_all(self) -> None:
        super().cast_all()
        self._staging_current.clear()  # written outside DeepSpeed's copy: the pinned buffers may be stale

    # ---- wrapping -------------------------------------------------------------------------------------------
    def _wrap_after(self, name: str, after: Callable[..., None]) -> None:
        """The optimizer's method ``name``, then ``after`` with the same arguments."""
        own = getattr(self.optimizer, name)

        @functools.wraps(own)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = own(*args, **kwargs)
            after(*args, **kwargs)
            return result

        setattr(self.optimizer, name, wrapped)

    def install(self) -> None:
        _wrap_gather(self.module)
        step = self.optimizer.step

        @functools.wraps(step)
        def step_then_cast(*args: Any, **kwargs: Any) -> Any:
            self._in_step, self._step_begun = True, False
            try:
                result = step(*args, **kwargs)
            finally:
                self._in_step = False
                self.restore()
                self._copied = False
            self._raise_deferred()  # a step that ended without its all-gather (none in the tested releases)
            return result

        self.optimizer.step = step_then_cast
        update = self.optimizer.update_lp_params

        @functools.wraps(update)
        def update_lp_params_through_cast(*args: Any, **kwargs: Any) -> Any:
            self.cast_lp_params()
            try:
                result = update(*args, **kwargs)
            finally:
                self.restore()  # also when DeepSpeed's own method raised before its all-gather
                if not self._in_step:
                    self._copied = False
            if not self._in_step:
                self._raise_deferred()  # an update without its all-gather (none in the tested releases)
            return result

        self.optimizer.update_lp_params = update_lp_params_through_cast

    def before_gather(self) -> None:
        """Called by the wrapped all-gather: DeepSpeed's lists back, and the casts its copies gave way to
        are the ones gathered; a gather that followed no copy (none in the tested releases) gets every
        local partition cast first. Inside ``step()`` nothing is cast here: a release that no longer
        copies where Fair Cast casts is stopped by the guard (a step without a cast, or served bits that
        are not the record of the cast)."""
        self.restore()
        if self._publishing:
            return
        if self._copied:
            self._copied = False
            self._raise_deferred()
            return
        if not self._in_step:
            self.cast_all()

    @torch.no_grad()
    def recast_and_publish(self, after_load: bool = False) -> None:
        """Cast every partition, then all-gather. After a load (``after_load``), unless no rank's cast
        changed an element: DeepSpeed's load has then already put the checkpoint's model weights, the
        bits served at save time, into every rank's full copy (each rank reads the same module file),
        so each partition's owner and every other rank hold the same bits, and the gather of the whole
        model is replaced by one all-reduce of the change count (``skipped_gathers`` counts it). Not
        elsewhere: after a failed step a rank's partition may differ from the others' copies of it."""
        if not after_load:
            super().recast_and_publish()
            return
        before = self.caster.last.changed
        self.cast_all()
        self._publish_unless_unchanged(self.caster.last.changed - before)

    def publish_restored(self, changed: int | None) -> None:
        """After error feedback's restore wrote the saved served bits: as after a load's recast, the
        all-gather is skipped when the restore changed no element on any rank (DeepSpeed's load of the
        module file already put those bits in every rank's full copy)."""
        if changed is None:
            self.publish()
            return
        self._publish_unless_unchanged(changed)

    def _publish_unless_unchanged(self, changed: int) -> None:
        count = torch.tensor([int(changed)], dtype=torch.int64, device=collective_device())
        if dist.is_initialized():
            dist.all_reduce(count)
        if int(count.item()) == 0:
            self.skipped_gathers += 1
            return
        self.publish()

    @torch.no_grad()
    def publish(self) -> None:
        """All-gather the served partitions as they are, then re-point the model's parameters."""
        opt = self.optimizer
        self._publishing = True
        self._staging_current.clear()  # publish follows a write of the served partitions (a restore, a cast)
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

    copy_sites = "step(): after _optimizer_step(i); update_lp_params"

    def install(self) -> None:
        super().install()
        self._wrap_after("_optimizer_step", self.cast_at_step_copy)

    @torch.no_grad()
    def cast_at_step_copy(self, group_no: int, *args: Any, **kwargs: Any) -> None:
        """Group ``group_no``'s fp32 partition is stepped; DeepSpeed copies it next: cast in its place."""
        if not self._in_step:
            return
        self._begin_step()
        self._cast_at(compat.zero12_step_copy(self.optimizer, group_no), group_no, self.masters()[group_no])

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
