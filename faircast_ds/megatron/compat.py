"""The differences between Megatron-Core releases, in one place: the supported range and the internals
the adapter reads, found by feature detection.

Supported: ``megatron-core>=0.12.0,<0.20`` (:data:`SUPPORTED_RANGE`). The one version comparison of the
Megatron route is :func:`release_problem` (``packaging.version``); inside the range every difference is
detected on the objects themselves (is the config field there, the method, the attribute?), so a
release that back-ports or renames a feature gets the code path its objects actually have.

Read from the release sources (0.12.0, 0.12.3, 0.13.1, 0.14.0, 0.15.3, 0.16.1 and 0.19.2):

===========================================  =============================================  ==========
what                                         where it differs                               first in
===========================================  =============================================  ==========
Megatron's own FSDP (its own main->model      ``DistributedDataParallelConfig.               0.14.0
copy, not routed)                            use_megatron_fsdp``; before: ``use_custom_fsdp``
fp8 parameters of the optimizer config       ``OptimizerConfig.fp8_recipe``,                0.13.0
                                             ``reuse_grad_buf_for_mxfp8_param_ag``
NVFP4 parameters (quantized, not cast)       ``DistributedDataParallelConfig.               0.17 - 0.19
                                             fp4_param_gather``
===========================================  =============================================  ==========

Unchanged over the range, and checked by :func:`missing_internals` on every attach: the refresh site
``DistributedOptimizer._copy_main_params_to_model_params`` (its bf16 path is ``copy_`` of each main
shard into ``buffers[i].buckets[j].param_data`` at ``gbuf_world_in_bucket``), ``step_with_ready_grads``
and the shard bookkeeping :mod:`faircast_ds.megatron.shards` reads. Megatron-Core 0.17.0 and later
declare ``Requires-Python >=3.12`` and ship cp312 wheels only, so on Python 3.11 pip offers 0.16.1 as
the newest; their sources (0.19.2 read) keep the same refresh site and bookkeeping, with NVFP4 added
beside fp8 (refused here) and ``LayerWiseDistributedOptimizer`` (refused: not a DistributedOptimizer).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

SUPPORTED_RANGE = ">=0.12.0,<0.20"
# what CI runs (tests/megatron_tests/test_megatron_releases.py): the oldest and the newest release that install on Python 3.11
TESTED = ("0.12.0", "0.16.1")

# what MegatronAdapter and faircast_ds.megatron.shards read of a DistributedOptimizer
OPTIMIZER_METHODS = ("_copy_main_params_to_model_params", "step_with_ready_grads")
OPTIMIZER_ATTRIBUTES = ("model_float16_groups", "shard_fp32_from_float16_groups", "model_fp32_groups",
                        "shard_fp32_groups", "model_param_gbuf_map", "gbuf_ranges", "buffers", "model_chunks",
                        "config", "ddp_config")
FSDP_FIELDS = ("use_megatron_fsdp", "use_custom_fsdp")  # the newer name first


def release() -> str:
    """The importable megatron-core's release."""
    from megatron.core.package_info import __version__

    return str(__version__)


def release_location() -> str:
    """Where the importable megatron-core lives (names a side install in an error message)."""
    import megatron.core

    return str(getattr(megatron.core, "__file__", "?"))


def release_problem(version: str | None = None) -> str | None:
    """Why ``version`` (default: the importable megatron-core) is outside the supported range, or None.

    Pre-releases and local builds count by their release number: ``0.20.0rc0`` is 0.20.0, outside;
    ``0.16.0rc0.dev1`` and ``0.16.1+abc`` are inside."""
    from packaging.version import InvalidVersion, Version

    version = release() if version is None else version
    try:
        parsed = Version(version)
    except InvalidVersion:
        return (f"megatron-core {version!r} has no version number Fair Cast can read; faircast-ds supports "
                f"megatron-core{SUPPORTED_RANGE}")
    number = Version(parsed.base_version)
    if Version("0.12.0") <= number < Version("0.20"):
        return None
    why = ("its DistributedOptimizer's refresh site and shard bookkeeping were not read for it"
           if number < Version("0.12.0") else "its main->model copy has not been verified")
    return (f"megatron-core {version} is not supported: faircast-ds supports megatron-core{SUPPORTED_RANGE} ({why}); "
            f"tested: {', '.join(TESTED)}")


def _fields(config: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set(vars(config))


def fsdp_fields(ddp_config: Any) -> list[str]:
    """The config fields that turn on Megatron's own FSDP in this release (0.14+ keeps the old name as an
    alias beside the new one; 0.12 and 0.13 have only the old)."""
    fields = _fields(ddp_config)
    return [name for name in FSDP_FIELDS if name in fields]


def uses_megatron_fsdp(ddp_config: Any) -> bool:
    """Whether Megatron's FSDP (which copies main weights into its own buffer) is on, by either name."""
    return any(bool(getattr(ddp_config, name)) for name in fsdp_fields(ddp_config))


def quantized_param_settings(config: Any, ddp_config: Any) -> list[str]:
    """The settings, among those this release has, that make the served copy quantized rather than cast."""
    found = []
    for owner, name in ((config, "fp8_recipe"), (config, "reuse_grad_buf_for_mxfp8_param_ag"),
                        (ddp_config, "fp8_param_gather"), (ddp_config, "fp4_param_gather")):
        value = getattr(owner, name, None) if name in _fields(owner) else None
        if value not in (None, False):
            found.append(f"{name}={value!r}")
    return found


def missing_internals(optimizer: Any) -> Iterator[str]:
    """Each DistributedOptimizer method or attribute the adapter needs and ``optimizer`` lacks."""
    for name in OPTIMIZER_METHODS:
        if not callable(getattr(type(optimizer), name, None)):
            yield f"DistributedOptimizer.{name} (the refresh site the cast replaces) is missing in this release"
    if getattr(optimizer, "is_stub_optimizer", False):  # no parameters on this rank: no shards to read
        return
    for name in OPTIMIZER_ATTRIBUTES:
        if not hasattr(optimizer, name):
            yield f"DistributedOptimizer has no attribute {name!r} (read to find the shards) in this release"
