"""What a ZeRO-3 parameter carries (``ds_*`` attributes), read in one place.

Under ZeRO-3 each ``nn.Parameter`` is replaced in place by a partitioned one: ``param.data`` is empty
unless gathered, ``ds_tensor`` is this rank's partition, ``ds_shape`` / ``ds_numel`` the full size,
``ds_persist`` marks small parameters that stay gathered after every step.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def is_partitioned(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` is a ZeRO-3 partitioned parameter."""
    return hasattr(param, "ds_id")


def full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    """The parameter's full shape, gathered or not (local: no collective)."""
    return tuple(int(d) for d in (param.ds_shape if is_partitioned(param) else param.shape))


def full_numel(param: torch.nn.Parameter) -> int:
    return int(param.ds_numel) if is_partitioned(param) else param.numel()


def is_persistent(param: torch.nn.Parameter) -> bool:
    """Whether ZeRO-3 keeps ``param`` gathered after every step (every rank holds it in full)."""
    return bool(getattr(param, "ds_persist", False))


def local_partition(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's partition of a ZeRO-3 parameter (the served bits it holds), flat."""
    return param.ds_tensor.detach().view(-1)


@contextlib.contextmanager
def gathered(param: torch.nn.Parameter) -> Iterator[torch.Tensor]:
    """``param.data`` in full for the duration (a collective under ZeRO-3; a no-op otherwise)."""
    if is_partitioned(param):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            yield param.data
    else:
        yield param.data
