"""Which bf16 NaN torch's own fp32 -> bf16 conversion produces on a device."""
from __future__ import annotations

import functools

import torch


def torch_nan16(device: torch.device) -> int:
    """The bf16 bits torch gives a NaN when converting fp32 -> bf16 on ``device``.

    ``nearest`` (and error feedback when master + residual is NaN) returns torch's NaN, whose bits
    the specification leaves open: 0xFFFF from the x86 vector kernels, 0x7FFF from CUDA's
    conversion. The fused kernels copy the probed value so that they equal ``cast`` bit for bit.
    """
    return _probe(device.type, device.index)


@functools.cache
def _probe(device_type: str, index: int | None) -> int:
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    nan = torch.full((64,), -1, dtype=torch.int32, device=device).view(torch.float32)  # full payload
    bits = nan.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return int(bits[0])
