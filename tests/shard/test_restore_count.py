"""Error feedback's restore counts the served elements whose bits it changes (shard/state.py ``_copy_bits``):
ZeRO-1/2 skip the restore's all-gather when no rank changed any (the count's all-reduce is zero), so an
undercount would leave ranks serving other bits than the checkpoint's. Checked against numpy's own count of
differing 16-bit patterns, for both state formats' served bits (int16 patterns, int32 holding them)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from faircast_ds.shard.state import _copy_bits


@pytest.mark.parametrize("saved_dtype", [torch.int16, torch.int32])
@pytest.mark.parametrize("flips", [0, 1, 977, 4096])
def test_the_count_is_the_number_of_elements_whose_bits_change(saved_dtype, flips):
    g = torch.Generator().manual_seed(flips)
    n = 4096 + 37  # not a multiple of any vector width
    before = torch.randn(n, generator=g).to(torch.bfloat16)
    saved = before.view(torch.int16).clone()
    at = torch.randperm(n, generator=g)[:flips]
    saved[at] ^= torch.randint(1, 1 << 15, (flips,), generator=g, dtype=torch.int16)  # each a nonzero change
    stored = saved if saved_dtype == torch.int16 else saved.to(torch.int32) & 0xFFFF
    want = int(np.count_nonzero(before.view(torch.int16).numpy() != saved.numpy()))
    assert want == flips
    out = before.clone()
    assert _copy_bits(out, stored) == want
    assert torch.equal(out.view(torch.int16), saved)  # and the saved bits are what it serves now
    assert _copy_bits(out, stored) == 0  # copied again: nothing changes
