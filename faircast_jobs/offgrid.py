"""The off-grid control (``--off-grid``): fp32 masters that start inside their bf16 cell, not on the grid.

By default the job's masters start exactly on the bf16 grid (the model is built in bf16), as in an RL
run from a bf16 checkpoint: round-to-nearest then serves the initial value until a master has drifted
half a spacing, which makes RN's lag a start-up transient. With ``--off-grid`` every master starts at a
seeded random point of the open round-to-nearest cell of its bf16 value ``v``: its fp32 bits are ``v``'s
plus an integer offset drawn uniformly from ``[-0x7FFF, 0x7FFF]`` (``-0`` and ``+0``: the offset's
magnitude, keeping the sign). A bf16 value's fp32 bits end in 16 zero bits and the cell's midpoints are
at offsets ``±0x8000``, so the master lies strictly between the midpoints (ties excluded) and rounds back
to ``v``: the served copy at step 0 is the same for every mode, and each master sits a uniform fraction
in (−½, ½) of the local spacing from ``v``. The offsets depend on the seed and on the parameter's name
only, so every mode of a seed starts from the same masters.
"""
from __future__ import annotations

import zlib
from typing import Iterable

import torch

HALF = 0x8000  # half a bf16 spacing in fp32 bits (bf16 keeps the top 16 of fp32's 32 bits)


def generator(seed: int, name: str) -> torch.Generator:
    """The offsets' generator for one parameter: keyed by the seed and the name (crc32), not the mode."""
    return torch.Generator().manual_seed((int(seed) * 2_654_435_761 + zlib.crc32(name.encode())) % 2**63)


def off_grid(values: torch.Tensor, seed: int, name: str) -> torch.Tensor:
    """fp32 masters inside the round-to-nearest cells of ``values`` (bf16, or fp32 holding bf16 values)."""
    exact = values.detach().float().contiguous()
    if not torch.equal(exact.to(torch.bfloat16).float(), exact):
        raise ValueError(f"{name}: off-grid masters start from bf16 values; this tensor has values off the bf16 grid")
    if not torch.isfinite(exact).all():
        raise ValueError(f"{name}: off-grid masters need finite values")
    bits = exact.view(torch.int32).clone()
    sign = bits & torch.tensor(-2**31, dtype=torch.int32)
    magnitude = bits & 0x7FFFFFFF
    offset = torch.randint(-(HALF - 1), HALF, exact.shape, generator=generator(seed, name), dtype=torch.int32)
    offset = torch.where(magnitude == 0, offset.abs(), offset)  # ±0: move away from zero, keep the sign
    shifted = (magnitude + offset) | sign
    out = shifted.view(torch.float32)
    if not torch.isfinite(out).all():  # the cell of the largest bf16 values reaches past fp32's range
        raise ValueError(f"{name}: an off-grid master would not be finite")
    return out


def off_grid_state(named: Iterable[tuple[str, torch.Tensor]], seed: int) -> dict[str, torch.Tensor]:
    """:func:`off_grid` of every named parameter."""
    return {name: off_grid(p, seed, name) for name, p in named}


def set_masters(engine: object, masters: dict[str, torch.Tensor]) -> None:
    """Write ``masters`` into a ZeRO engine's fp32 master partitions and read them back, bit for bit.

    ``deepspeed.utils.safe_set_full_fp32_param`` sets this rank's partition of each master; the served
    copy is untouched (it already holds round-to-nearest of the new masters, their bf16 values)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    params = dict(engine.module.named_parameters())
    missing = sorted(set(params) ^ set(masters))
    if missing:
        raise RuntimeError(f"off-grid masters and the engine's parameters differ: {missing[:5]}")
    for name, param in params.items():
        safe_set_full_fp32_param(param, masters[name])
    for name, param in params.items():
        back = safe_get_full_fp32_param(param)
        if back is None or not torch.equal(back.view(-1).view(torch.int32), masters[name].view(-1).view(torch.int32)):
            raise RuntimeError(f"{name}: the fp32 master read back differs from the off-grid value written")
