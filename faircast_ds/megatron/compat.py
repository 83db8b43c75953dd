"""The differences between Megatron-Core releases, in one place: which release is accepted, and the
internals the adapter reads, found by feature detection.

Accepted: megatron-core 0.16.1 (:data:`VERIFIED`), the release installed and tested here; the range is
not widened yet (other releases are refused with a message naming this list). Beyond the release,
:func:`missing_internals` checks that the DistributedOptimizer still has every method and attribute
the adapter reads or replaces, so that a release that moved one is named by what moved, not
cast wrongly.
"""
from __future__ import annotations

from typing import Any, Iterator

VERIFIED = ("0.16.1",)  # the one release comparison of the Megatron route (widen it with a tested release)

# what MegatronAdapter and faircast_ds.megatron.shards read of a DistributedOptimizer
OPTIMIZER_METHODS = ("_copy_main_params_to_model_params", "step_with_ready_grads")
OPTIMIZER_ATTRIBUTES = ("model_float16_groups", "shard_fp32_from_float16_groups", "model_fp32_groups",
                        "shard_fp32_groups", "model_param_gbuf_map", "gbuf_ranges", "buffers", "model_chunks",
                        "config", "ddp_config")


def release() -> str:
    """The importable megatron-core's release."""
    from megatron.core.package_info import __version__

    return str(__version__)


def release_problem() -> str | None:
    """Why the importable megatron-core is refused, or None when it is an accepted release."""
    version = release()
    if version not in VERIFIED:
        return (f"megatron-core {version} is not verified (verified: {', '.join(VERIFIED)}); its main->model "
                "copy may have moved")
    return None


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
