"""Which DeepSpeed loads restore the fp32 masters bit for bit (faircast_ds.deepspeed.checkpoint
.restores_exact_masters): Fair Cast's state goes on top of those; the others rebuild the masters from the bf16
weights and restart the residual. The table is DeepSpeed 0.19's own load code, read case by case."""
from __future__ import annotations

import pytest

from faircast_ds.deepspeed.checkpoint import restores_exact_masters

# (load_optimizer_states, module_only, zero3, universal, load_from_fp32_weights) -> exact
CASES = [
    ((True, False, True, False, True), True),  # ZeRO-3: _rigid_load_state_dict restores the fp32 partitions
    ((True, False, True, False, False), True),  # ... whatever load_from_fp32_weights says
    ((True, False, False, False, True), True),  # ZeRO-1/2: copies single_partition_of_fp32_groups
    ((True, False, False, False, False), False),  # ZeRO-1/2 told otherwise: _restore_from_bit16_weights
    ((False, False, False, False, True), False),  # no optimizer states: the masters come from the module
    ((True, True, True, False, True), False),  # load_module_only
    ((True, False, False, True, False), True),  # universal ZeRO-1/2: the hp (fp32) fragments
    ((False, False, False, True, False), True),
    ((False, False, True, True, False), False),  # universal ZeRO-3 from the bit16 weights
    ((False, False, True, True, True), True),
]


@pytest.mark.parametrize("flags, exact", CASES)
def test_which_loads_restore_the_masters_exactly(flags, exact):
    load_optimizer_states, module_only, zero3, universal, from_fp32 = flags
    assert restores_exact_masters(load_optimizer_states=load_optimizer_states, module_only=module_only, zero3=zero3,
                                  universal=universal, from_fp32=from_fp32) is exact
