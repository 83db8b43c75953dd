"""The mode registry (faircast_ds.casting.modes): adding a mode is one spec plus its kernel code. A fake mode,
round toward zero, registered with a pure-torch rule and no kernel code: the public cast serves it, checked
against its own oracle; cast_into serves it by the pure-torch path on the default backend; a forced fused
kernel refuses it by name; unknown names are refused at the public entry."""
from __future__ import annotations

import struct

import pytest
import torch

from faircast_ds import cast, cast_into
from faircast_ds.casting import modes
from faircast_ds.casting.modes import ModeSpec


def toward_zero_rule(x, noise, residual):
    # the product side: drop the low 16 bits of the pattern
    return (x.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


def toward_zero_oracle(value: float) -> int:
    """The bf16 pattern of the largest-magnitude bf16 value not above |value| in magnitude, by another road:
    start from Python's round-to-nearest of the float to bf16 precision and step toward zero while it
    overshoots (floats throughout, no bit tricks on the input)."""
    import math

    if value == 0 or math.isinf(value) or math.isnan(value):
        return struct.unpack("<I", struct.pack("<f", value))[0] >> 16
    m, e = math.frexp(abs(value))  # |value| = m * 2^e, m in [0.5, 1)
    e = max(e, -125)  # subnormals: the grid spacing stops shrinking at 2^-133
    spacing = 2.0 ** (e - 8)
    y = math.floor(abs(value) / spacing) * spacing  # exact: a multiple of the spacing below |value|
    y = math.copysign(y, value)
    return struct.unpack("<I", struct.pack("<f", y))[0] >> 16


@pytest.fixture
def toward_zero():
    spec = modes.register(ModeSpec("toward_zero", toward_zero_rule))
    try:
        yield spec
    finally:
        modes.unregister("toward_zero")


def values() -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    x = torch.cat([torch.randn(3000, generator=gen) * 10.0 ** torch.randint(-30, 30, (3000,), generator=gen),
                   torch.tensor([0.0, -0.0, 1.0, -1.0, 3.4e38, -3.4e38, 1e-40, -1e-40, 1.00390625, 1.0078125])])
    return x.float()


def test_a_registered_mode_is_served_by_the_public_cast_as_its_oracle_says(toward_zero):
    x = values()
    got = cast(x, "toward_zero", seed=1, step=1, name="w").view(torch.int16).to(torch.int64) & 0xFFFF
    want = torch.tensor([toward_zero_oracle(float(v)) for v in x], dtype=torch.int64)
    assert torch.equal(got, want)


def test_cast_into_serves_a_mode_without_kernel_code_by_its_pure_torch_rule(toward_zero, monkeypatch):
    monkeypatch.delenv("FAIRCAST_DS_KERNELS", raising=False)
    x = values()
    out = x.to(torch.bfloat16)  # round-to-nearest's bits: the mode must not leave them
    changed, nonfinite = cast_into(out, x, "toward_zero", seed=1, step=1, name="w")
    want = cast(x, "toward_zero", seed=1, step=1, name="w")
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert changed == int((x.to(torch.bfloat16).view(torch.int16) != want.view(torch.int16)).sum()) > 0
    assert nonfinite == 0


def test_a_forced_fused_kernel_refuses_a_mode_it_has_no_code_for_by_name(toward_zero, monkeypatch):
    monkeypatch.setenv("FAIRCAST_DS_KERNELS", "cpp")
    x = values()
    out = x.to(torch.bfloat16)
    before = out.clone()
    with pytest.raises(ValueError, match="fused cpp kernel has no code for fair cast mode 'toward_zero'"):
        cast_into(out, x, "toward_zero", seed=1, step=1, name="w")
    assert torch.equal(out.view(torch.int16), before.view(torch.int16))  # nothing written


def test_unknown_modes_are_refused_at_the_public_entry_with_the_accepted_names():
    with pytest.raises(ValueError, match="unknown fair cast mode 'ditehr'; accepted: nearest, stochastic, dither"):
        cast(torch.zeros(3), "ditehr", seed=0, step=0, name="w")
    with pytest.raises(ValueError, match="unknown fair cast mode"):
        cast_into(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3), "ditehr", seed=0, step=0, name="w")


def test_the_registry_refuses_a_second_spec_for_a_name_or_a_code_and_keeps_the_built_ins():
    with pytest.raises(ValueError, match="already registered"):
        modes.register(ModeSpec("dither", toward_zero_rule))
    with pytest.raises(ValueError, match="kernel code 2 is already taken"):
        modes.register(ModeSpec("other", toward_zero_rule, code=2))
    with pytest.raises(ValueError, match="built-in"):
        modes.unregister("nearest")
    assert modes.registered()[:4] == modes.MODES


def test_what_the_package_asks_of_each_built_in_mode():
    """The facts the checkpoint, Megatron, LoRA and inspection code read from the specs."""
    table = {m: (modes.spec(m).uses_noise, modes.spec(m).per_step, modes.spec(m).residual) for m in modes.MODES}
    assert table == {"nearest": (False, False, False), "stochastic": (True, True, False),
                     "dither": (True, False, False), "error_feedback": (False, False, True)}
    dither = modes.CastRule.of("dither", 7)
    assert dither.key("w", 1) == dither.key("w", 99) != modes.CastRule.of("stochastic", 7).key("w", 1)
    assert modes.CastRule.of("nearest", 7).key("w", 1) == 0
