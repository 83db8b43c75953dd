"""Every difference between the DeepSpeed releases Fair Cast supports, in one place.

The supported range is ``deepspeed>=0.16.0,<0.20`` (:data:`SUPPORTED_RANGE`). Below 0.16.0 DeepSpeed
calls ``torch.load`` without ``weights_only`` and checkpoint loads break on current torch. Inside the
range, each difference is found by feature detection (is the attribute, the config field, the
method there?), never by comparing version strings: a release that back-ports or renames a feature
gets the code path its objects actually have. The one version comparison in the package is
:func:`release_problem`, the range check at initialize.

Differences, each read from the release sources (0.16.0 ... 0.19.8) and exercised by
``tests/deepspeed_tests/test_releases.py`` on the releases in :data:`TESTED`:

=========================================  ===================================================  ==========
what                                       where it differs                                     first in
=========================================  ===================================================  ==========
precision config                           ``float16_config`` / ``bfloat16_config`` models;     0.17.1
                                           before: ``fp16_enabled``, ``bfloat16_enabled``,
                                           ``fp16_master_weights_and_gradients`` on the config
bf16 low-precision master weights          ``bfloat16_config.bf16_master_weights_and_grads``    0.18.3
torch autocast, SuperOffload, ZenFlow      ``torch_autocast_enabled``,                          0.18.0
                                           ``offload_optimizer.super_offload``, ``zenflow``
ZeRO-3 partition group of a sub-group      ``sub_group_process_groups[i]``;                     0.19.3
                                           before: ``dp_process_group``
ZeRO-3 module-only universal load          ``load_module_checkpoint_state_from_checkpoint_dir_  0.19.3
                                           stage3`` (before: the universal load always goes
                                           through ``load_hp_...``)
ZeRO-3 universal load signature            ``load_hp_checkpoint_state_from_checkpoint_dir_      0.18.0
                                           stage3(dir)``; before ``(dir, param_shapes)``
ZeRO-1/2 CPU-offload refresh               fp32 -> pinned bf16 buffer                           0.17.0
                                           (``param_buffer_of_bit16_for_cpu_offload_groups``)
                                           -> device; before: one direct ``copy_`` to the device
                                           (the cast takes the copy's place: :func:`zero12_step_copy`)
BF16_Optimizer for ZeRO-1 + fp32 grad      0.18.0 - 0.18.4 name ``DDP_BFLOAT16`` like           0.18.5 at
accumulation                               ``BFLOAT16`` ("bf16") and build FP16_UnfusedOptimizer  the latest
=========================================  ===================================================  ==========

Unchanged over the range (and relied on): ZeRO-3's flat groups and
``_reassign_or_swap_out_partitioned_parameters``, ``_rigid_load_state_dict``, ZeRO-1/2's
``all_gather_dp_groups`` imported into the module namespace, the ``_hp_mapping`` fragment addresses,
BF16_Optimizer's ``update_lp_params``, ZeRO-1/2's ``_optimizer_step(i)`` followed in ``step()`` by the copy of
group ``i`` (:func:`zero12_step_copy`). :func:`require_internals` checks that an optimizer still has
every attribute an adapter reads, so a release that moved one is refused at initialize, naming it;
a moved cast site that leaves the attributes in place is caught by ``faircast_ds.deepspeed.guard``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Iterable

FLOOR = (0, 16, 0)
CEILING = (0, 20, 0)  # exclusive
SUPPORTED_RANGE = ">=0.16.0,<0.20"
# one release per era of the internals above; the last is the newest and setup.py's default
TESTED = ("0.16.9", "0.18.9", "0.19.8")


def release() -> str:
    """The importable DeepSpeed's version."""
    import deepspeed

    return str(deepspeed.__version__)


def release_location() -> str:
    import deepspeed

    return str(getattr(deepspeed, "__file__", "?"))


def _release_tuple(version: str) -> tuple[int, ...] | None:
    from packaging.version import InvalidVersion, Version

    try:
        return tuple(Version(version).release[:3])
    except InvalidVersion:
        return None


def release_problem(version: str | None = None) -> str | None:
    """Why ``version`` (default: the importable DeepSpeed) is outside the supported range, or None.

    Pre-releases and local builds count by their release number: ``0.20.0.dev0`` and ``0.20.0+abc``
    are 0.20.0, outside; ``0.19.8+abc`` is inside."""
    version = release() if version is None else version
    parsed = _release_tuple(version)
    if parsed is None:
        return (f"DeepSpeed {version!r} has no version number Fair Cast can read; faircast-ds supports "
                f"deepspeed{SUPPORTED_RANGE}")
    parsed = parsed + (0,) * (3 - len(parsed))
    if FLOOR <= parsed < CEILING:
        return None
    why = ("earlier releases call torch.load without weights_only, so checkpoint loads break on current torch"
           if parsed < FLOOR else "its fp32->bf16 cast sites have not been verified")
    return (f"DeepSpeed {version} is not supported: faircast-ds supports deepspeed{SUPPORTED_RANGE} ({why}); "
            f"tested: {', '.join(TESTED)}. Install a release in the range, e.g. "
            f"pip install 'deepspeed{SUPPORTED_RANGE}'")


# ---- the parsed config (DeepSpeedConfig) -------------------------------------------------------------

@dataclass(frozen=True)
class Precision:
    fp16: bool
    bf16: bool
    low_precision_masters: bool  # fp16/bf16 master weights and gradients: no fp32 master to cast from


def _fields(model: Any) -> dict:
    return getattr(type(model), "model_fields", {}) or {}


def precision(cfg: Any) -> Precision:
    """fp16 / bf16 / low-precision masters from a DeepSpeedConfig of any supported release."""
    if hasattr(cfg, "float16_config") and hasattr(cfg, "bfloat16_config"):  # pydantic models (0.17.1+)
        fp16, bf16 = cfg.float16_config, cfg.bfloat16_config
        low = bool(fp16.fp16_master_weights_and_grads)
        if "bf16_master_weights_and_grads" in _fields(bf16):  # 0.18.3+
            low = low or bool(bf16.bf16_master_weights_and_grads)
        return Precision(bool(fp16.enabled), bool(bf16.enabled), low)
    # flat attributes (before 0.17.1)
    return Precision(bool(cfg.fp16_enabled), bool(cfg.bfloat16_enabled),
                     bool(getattr(cfg, "fp16_master_weights_and_gradients", False)))


def torch_autocast_enabled(cfg: Any) -> bool:
    """torch autocast on the engine (0.18.0+; earlier releases have no such mode)."""
    return bool(getattr(cfg, "torch_autocast_enabled", False))


def super_offload_enabled(zero_cfg: Any) -> bool:
    """SuperOffload (0.18.0+)."""
    return bool(getattr(getattr(zero_cfg, "offload_optimizer", None), "super_offload", False))


def zenflow_enabled(zero_cfg: Any) -> bool:
    """ZenFlow (0.18.0+)."""
    return getattr(zero_cfg, "zenflow", None) is not None


def bf16_optimizer_config(cfg: Any) -> bool:
    """Whether the config asks for BF16_Optimizer: bf16, ZeRO stage 1, fp32 gradient accumulation, no
    CPU offload (DeepSpeed's own rule in ``_do_optimizer_sanity_check``)."""
    import torch
    from deepspeed.runtime.config import DtypeEnum

    accum = getattr(cfg, "grad_accum_dtype", None)
    if accum is None or not precision(cfg).bf16 or cfg.zero_config.stage != 1:
        return False
    if offload_device(getattr(cfg.zero_config, "offload_optimizer", None)) == "cpu":
        return False
    return DtypeEnum(accum).value == torch.float32


def offload_device(offload_cfg: Any) -> str:
    """The device of an ``offload_optimizer`` / ``offload_param`` section ("none" when absent): an enum
    or its plain value, by release."""
    device = getattr(offload_cfg, "device", None) if offload_cfg is not None else None
    return str(getattr(device, "value", device) or "none")


def bf16_optimizer_buildable() -> bool:
    """Whether the engine really builds BF16_Optimizer for such a config. In 0.18.0 - 0.18.4 the wrapper
    names ``BFLOAT16`` and ``DDP_BFLOAT16`` are the same string, so the engine takes the DDP branch and
    builds FP16_UnfusedOptimizer (no ZeRO, no fp32 master Fair Cast routes) instead."""
    from deepspeed.runtime import constants

    ddp = getattr(constants, "DDP_BFLOAT16", None)
    return ddp is None or ddp != constants.BFLOAT16


# ---- the optimizers' internals ----------------------------------------------------------------------

# what each adapter reads from its optimizer, in every supported release
REQUIRED = {
    "DeepSpeedZeroOptimizer_Stage3": ("fp16_groups", "fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat",
                                      "_reassign_or_swap_out_partitioned_parameters",
                                      "_unflatten_partitioned_parameters", "_rigid_load_state_dict",
                                      "load_hp_checkpoint_state_from_checkpoint_dir_stage3",
                                      "persistent_parameters"),
    "DeepSpeedZeroOptimizer": ("bit16_groups", "bit16_groups_flat", "single_partition_of_fp32_groups",
                               "parallel_partitioned_bit16_groups", "real_dp_process_group",
                               "nccl_start_alignment_factor", "allgather_bucket_size", "partition_gradients",
                               "cpu_offload", "_update_model_bit16_weights", "update_lp_params", "_optimizer_step"),
    "BF16_Optimizer": ("bf16_groups", "bf16_groups_flat", "fp32_groups_flat_partition", "bf16_partitioned_groups",
                       "real_dp_process_group", "nccl_start_alignment_factor", "allgather_bucket_size",
                       "update_lp_params"),
}


def require_internals(optimizer: Any, names: Iterable[str] | None = None, module: Any = None) -> None:
    """Refuse (UnsupportedSetupError) an optimizer that lacks an attribute its adapter reads, and a
    ZeRO-1/2 / BF16 module without ``all_gather_dp_groups`` in its namespace."""
    from faircast_ds.shard.adapter import UnsupportedSetupError

    cls = type(optimizer).__name__
    names = REQUIRED.get(cls, ()) if names is None else names
    missing = [n for n in names if not hasattr(optimizer, n)]
    if module is not None and not callable(getattr(module, "all_gather_dp_groups", None)):
        missing.append(f"{module.__name__}.all_gather_dp_groups")
    if missing:
        raise UnsupportedSetupError(
            f"fair_cast: DeepSpeed {release()} ({release_location()}): {cls} has no {', '.join(missing)}, which "
            f"Fair Cast reads to find its cast sites; this release's internals moved. Tested releases: "
            f"{', '.join(TESTED)}")


def zero3_partition_group(optimizer: Any, sub_group: int) -> Any:
    """The process group that partitions ZeRO-3 sub-group ``sub_group`` (per sub-group from 0.19.3,
    the data-parallel group before)."""
    groups = getattr(optimizer, "sub_group_process_groups", None)
    if groups is not None:
        return groups[sub_group]
    return optimizer.dp_process_group


# ZeRO-3 checkpoint loads that refresh bf16 from fp32 outside the step site; the last one from 0.19.3
ZERO3_LOAD_SITES = ("_rigid_load_state_dict", "load_hp_checkpoint_state_from_checkpoint_dir_stage3",
                    "load_module_checkpoint_state_from_checkpoint_dir_stage3")


def zero3_load_sites(optimizer: Any) -> tuple[str, ...]:
    """The ZeRO-3 load sites this release has (every one must be routed through the cast)."""
    return tuple(site for site in ZERO3_LOAD_SITES if callable(getattr(optimizer, site, None)))


def zero3_universal_load_takes_param_shapes(optimizer: Any) -> bool:
    """Whether ``load_hp_checkpoint_state_from_checkpoint_dir_stage3`` takes ``param_shapes`` (before
    0.18.0). Fair Cast's wrapper passes every argument through, so both signatures work; this says
    which one the release has."""
    fn = getattr(optimizer, "load_hp_checkpoint_state_from_checkpoint_dir_stage3")
    return "param_shapes" in inspect.signature(fn).parameters


def zero12_offload_staging(optimizer: Any, group: int) -> Any:
    """DeepSpeed's pinned host bf16 buffer through which ZeRO-1/2 with CPU optimizer offload copies
    group ``group``'s refreshed partition to the device (0.17.0+), or None (no offload, or a release
    that copies directly). Fair Cast casts into it with the fused CPU kernel before the one copy to
    the device (``ShardCaster.cast_flat(staging=...)``)."""
    if not getattr(optimizer, "cpu_offload", False):
        return None
    buffers = getattr(optimizer, "param_buffer_of_bit16_for_cpu_offload_groups", None)
    if not buffers or group >= len(buffers):
        return None
    return buffers[group]


@dataclass(frozen=True)
class CopySite:
    """DeepSpeed's own round-to-nearest copy of one ZeRO-1/2 (or BF16_Optimizer) group inside ``step()`` or
    ``update_lp_params()``, as Fair Cast takes its place: the cast writes ``target`` (the tensor that copy
    writes from the fp32 partition: this rank's served bf16 partition, or with CPU offload on 0.17.0+
    DeepSpeed's pinned staging buffer, which DeepSpeed then copies to the served partition itself), and for
    that one copy ``holder[index]`` holds ``stand_in`` instead, which makes DeepSpeed's copy a copy of a
    tensor onto itself (torch returns at once: nothing is read or written)."""

    target: Any
    holder: list
    index: int
    stand_in: Any


def zero12_step_copy(optimizer: Any, group: int) -> CopySite:
    """The copy of group ``group`` that ``DeepSpeedZeroOptimizer.step()`` makes right after
    ``_optimizer_step(group)``, in every release of the range:

    - no offload: ``bit16_partitions[partition_id].data.copy_(fp32_partition.data)``; the destination's
      list (``parallel_partitioned_bit16_groups[group]``) holds the fp32 partition itself for the copy;
    - CPU offload, 0.17.0+: ``buffer.copy_(fp32_partition)`` then ``bit16_partitions[partition_id].copy_(buffer)``;
      the source (``single_partition_of_fp32_groups[group]``) is the buffer itself for the copy, and
      DeepSpeed's second copy carries the cast to the served partition;
    - CPU offload, before: ``bit16_partitions[partition_id].copy_(fp32_partition.to(device))``; the source
      is the served partition itself (``.to`` of a tensor already there is that tensor).

    The fp32 partition's own reads before the copy (``.grad = None`` without offload) are untouched: each
    stand-in sits in the list that is read only by the copy."""
    from deepspeed import comm as dist

    rank = dist.get_rank(group=optimizer.real_dp_process_group[group])
    served = optimizer.parallel_partitioned_bit16_groups[group][rank]
    master = optimizer.single_partition_of_fp32_groups[group]
    if not optimizer.cpu_offload:
        partitions = list(optimizer.parallel_partitioned_bit16_groups[group])
        partitions[rank] = master
        return CopySite(served, optimizer.parallel_partitioned_bit16_groups, group, partitions)
    staging = zero12_offload_staging(optimizer, group)
    target = staging if staging is not None else served
    return CopySite(target, optimizer.single_partition_of_fp32_groups, group, target)


def lp_params_copy(partitioned: list, masters: list, rank: int, group: int) -> CopySite:
    """The copy of group ``group`` in ``update_lp_params()`` (ZeRO-1/2's universal checkpoint load and
    BF16_Optimizer's step and loads): ``partitioned[group][rank].data.copy_(masters[group].data)``, then
    the all-gather; the destination's list holds the fp32 partition itself for the copy."""
    partitions = list(partitioned[group])
    target = partitions[rank]
    partitions[rank] = masters[group]
    return CopySite(target, partitioned, group, partitions)


def facts(optimizer: Any = None, cfg: Any = None) -> dict[str, Any]:
    """What this module detects for the importable release (for reports and tests)."""
    out: dict[str, Any] = {"version": release(), "file": release_location(), "range_problem": release_problem()}
    if cfg is not None:
        p = precision(cfg)
        out.update(precision_models=hasattr(cfg, "bfloat16_config"),
                   bf16_master_field="bf16_master_weights_and_grads" in _fields(getattr(cfg, "bfloat16_config", None)),
                   autocast_field=hasattr(cfg, "torch_autocast_enabled"), bf16=p.bf16, fp16=p.fp16)
    if optimizer is not None:
        name = type(optimizer).__name__
        out["optimizer"] = name
        if name == "DeepSpeedZeroOptimizer_Stage3":
            out.update(sub_group_process_groups=hasattr(optimizer, "sub_group_process_groups"),
                       load_sites=list(zero3_load_sites(optimizer)),
                       universal_load_takes_param_shapes=zero3_universal_load_takes_param_shapes(optimizer))
        elif name == "DeepSpeedZeroOptimizer":
            out.update(offload_staging=zero12_offload_staging(optimizer, 0) is not None,
                       cpu_offload=bool(optimizer.cpu_offload))
    return out
