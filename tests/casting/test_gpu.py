"""Correctness on a CUDA device: the Triton kernel's bits, and Fair Cast on Megatron-Core's
DistributedOptimizer with the param buffer on the GPU. Skips without CUDA.

1. Bits (what benchmarks/gpu_check.py used to check before timing): on awkward inputs (normal weights
   at several scales, exact bf16 values, subnormals, near-overflow values, signed zeros, ±Inf, NaNs of
   every payload, residual chains with huge and subnormal residuals), several Triton blocks long with a
   partial last block, for every mode and several (seed, step, start) with words past 2^32, the Triton
   kernel equals ``cast`` run on the same GPU and ``cast`` run on the CPU (NaN lanes of ``nearest``
   excepted there: torch's own NaN differs between devices), including the residual and both counts;
   a slice is also checked against the slow, value-based reference.
2. Megatron-Core 0.16.1 (what benchmarks/megatron_gpu_check.py used to check before timing; skips without
   it): after every step the served bf16 shard in the param buffer, written on the GPU, equals
   ``faircast_ds.casting`` of its fp32 main shard computed on the CPU, and ``nearest`` serves exactly what
   Megatron's own copy serves. One rank (this process); the gathered-parameter check across ranks is
   device independent and runs on CPU ranks in tests/megatron_tests/test_megatron.py.

The timing of the same paths is in benchmarks/gpu_check.py and benchmarks/megatron_gpu_check.py.
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, free_port
from test_casts import from_bits

from faircast_ds.casting import kernels, modes
from faircast_ds.casting.reference import cast_reference
from faircast_ds.casting.bits import bf16_bits, fp32_bits
from faircast_ds.casting.modes import MODES
from faircast_ds.casting.rules import cast, cast_into

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NAME = "model.layers.0.mlp.up_proj.weight"
CASES = [(7, 3, 0), (0, 1, 11), (2**40 + 3, 2**33 + 5, 2**32 - 700), (123, 2**32, 2**32),
         (2**63 - 1, 2**63 - 1, 2**45)]  # (seed, step, start): small, and past 2^32 in every word


def awkward(n: int = 20_000, seed: int = 0) -> torch.Tensor:
    """26,298 values: six full Triton blocks of 4096 and a partial one."""
    g = torch.Generator().manual_seed(seed)
    payload_nans = [0x7F800001, 0xFF800001, 0x7F80FFFF, 0x7FFF0000, 0x7F810000, 0xFFFFFFFF, 0x7FC00000, 0xFFC00000]
    return torch.cat([
        torch.randn(n, generator=g) * 0.02,
        torch.randn(n // 4, generator=g) * 30.0,
        torch.randn(n // 8, generator=g).to(torch.bfloat16).float(),
        torch.rand(n // 8, generator=g) * 1e-38,  # subnormals and tiny normals
        from_bits([0x00000001, 0x0000FFFF, 0x00012345, 0x807FFFFF, 0x00800000, 0x80008000, 0x80000001]),
        from_bits([0x7F7F7FFF, 0x7F7F0001, 0xFF7F7FFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F7EFFFF, 0x7F7FC000]),
        torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0**-126, 3.0e38, float("inf"), float("-inf")]),
        from_bits(payload_nans),
    ])


def residual_chain(shape, seed: int) -> torch.Tensor:
    """An error-feedback residual with huge values (overflowing x + e) and subnormal ones."""
    e = torch.randn(shape, generator=torch.Generator().manual_seed(seed % 1000)) * 1e-4
    e[:64] = 1e30
    e[64:96] = 1e-40
    return e


def differ(got: torch.Tensor, want: torch.Tensor, lanes: torch.Tensor | None = None) -> str:
    """'' when equal (on ``lanes``), else how many and where, with the bits."""
    bad = got != want
    if lanes is not None:
        bad &= lanes
    if not bool(bad.any()):
        return ""
    idx = bad.nonzero()[:5, 0].tolist()
    return (f"{int(bad.sum())} differ, first at {idx}: got {[hex(v) for v in got[idx].tolist()]}, "
            f"want {[hex(v) for v in want[idx].tolist()]}")


def test_triton_is_the_cuda_path():
    ok = kernels.backend_for(torch.device("cuda"))
    assert ok == "triton", f"the fused CUDA cast is not used here (backend {ok!r}); is Triton installed?"


@pytest.mark.parametrize("mode", MODES)
def test_triton_bits_equal_cast_on_the_gpu_and_on_the_cpu(mode):
    x_cpu = awkward()
    x = x_cpu.cuda()
    nan = torch.isnan(x_cpu)
    lanes = ~nan if mode == "nearest" else torch.ones_like(nan)  # torch's own NaN bits differ by device
    for seed, step, start in CASES:
        what = f"{mode} seed={seed} step={step} start={start}"
        e_cpu = residual_chain(x_cpu.shape, seed) if mode == "error_feedback" else None
        e_gpu_eager = e_cpu.cuda() if e_cpu is not None else None
        e_fused = e_cpu.cuda() if e_cpu is not None else None
        kw = dict(seed=seed, step=step, name=NAME, start=start)
        old = torch.randn(x.shape, device="cuda").to(torch.bfloat16)
        want_gpu = cast(x, mode, residual=e_gpu_eager, **kw)
        want_cpu = cast(x_cpu, mode, residual=e_cpu, **kw)
        out = old.clone()
        counts = cast_into(out, x, mode, residual=e_fused, **kw)
        got = bf16_bits(out.cpu())
        assert not differ(got, bf16_bits(want_gpu.cpu())), f"{what} vs cast on the GPU: " + differ(got, bf16_bits(want_gpu.cpu()))
        assert not differ(got, bf16_bits(want_cpu), lanes), f"{what} vs cast on the CPU: " + differ(got, bf16_bits(want_cpu), lanes)
        want_counts = (int((bf16_bits(old.cpu()) != bf16_bits(want_gpu.cpu())).sum()),
                       int((~torch.isfinite(want_gpu.float())).sum().item()))
        assert counts == want_counts, what
        if e_cpu is not None:
            r = fp32_bits(e_fused.cpu())
            assert not differ(r, fp32_bits(e_gpu_eager.cpu())), f"{what} residual vs the GPU: " + differ(r, fp32_bits(e_gpu_eager.cpu()))
            assert not differ(r, fp32_bits(e_cpu)), f"{what} residual vs the CPU: " + differ(r, fp32_bits(e_cpu))


@pytest.mark.parametrize("mode", MODES)
def test_triton_bits_equal_the_slow_reference(mode):
    xs = awkward()[-600:]  # the specials, near-overflow values and subnormals
    e_ref = torch.randn(600, generator=torch.Generator().manual_seed(5)) * 1e-4 if mode == "error_feedback" else None
    e_got = e_ref.cuda() if e_ref is not None else None
    kw = dict(seed=5, step=2**33, name="w", start=2**32 - 9)
    ref = cast_reference(xs, mode, residual=e_ref, **kw)
    out = torch.empty(600, dtype=torch.bfloat16, device="cuda")
    cast_into(out, xs.cuda(), mode, residual=e_got, **kw)
    lanes = ~torch.isnan(xs) if mode == "nearest" else torch.ones(600, dtype=torch.bool)
    got = bf16_bits(out.cpu())
    assert not differ(got, bf16_bits(ref), lanes), differ(got, bf16_bits(ref), lanes)
    if e_ref is not None:
        assert not differ(fp32_bits(e_got.cpu()), fp32_bits(e_ref)), differ(fp32_bits(e_got.cpu()), fp32_bits(e_ref))


@pytest.mark.parametrize("mode", MODES)
def test_triton_without_the_change_count_writes_the_same_bits(mode):
    """``count_changed=False`` (the benchmark's no-count variant) skips reading the old bits only."""
    from faircast_ds.casting.kernels import triton_cast

    x = awkward().cuda()
    kw = dict(seed=1, step=2, name="bench.w")
    e1 = residual_chain(x.shape, 3).cuda() if mode == "error_feedback" else None
    e2 = e1.clone() if e1 is not None else None
    counted = torch.randn(x.shape, device="cuda").to(torch.bfloat16)
    uncounted = counted.clone()
    changed, nonfinite = cast_into(counted, x, mode, residual=e1, **kw)
    got = triton_cast.cast_into(uncounted, x, mode, key=modes.noise_key(mode, **kw), start=0, residual=e2,
                                count_changed=False)
    assert got == (-1, nonfinite) and changed > 0
    assert torch.equal(bf16_bits(uncounted.cpu()), bf16_bits(counted.cpu()))
    if e1 is not None:
        assert torch.equal(fp32_bits(e1.cpu()), fp32_bits(e2.cpu()))


# ---- Megatron-Core's DistributedOptimizer, param buffer on the GPU ---------------------------------

def megatron_version() -> str | None:
    try:
        import megatron.core.package_info as info
    except ImportError:
        return None
    return info.__version__


MEGATRON_SEED = 1234
MEGATRON_ARGS = SimpleNamespace(hidden=512, layers=3, steps=3, route="auto")


@pytest.fixture(scope="module")
def megatron_world():
    """One data-parallel rank (this process) with Megatron's parallel state; torn down after."""
    if megatron_version() != "0.16.1":
        pytest.skip("needs megatron-core 0.16.1")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import megatron_gpu_check as setup  # the benchmark's model, optimizer and step: one home for them
    from megatron.core import parallel_state

    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        yield setup, torch.device("cuda", torch.cuda.current_device())
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def megatron_served_bits(setup, device, mode: str | None) -> list[dict[str, torch.Tensor]]:
    """Train ``steps`` steps (mode None: Megatron's own copy); after each, check every shard against the
    CPU cast of its fp32 main shard and return every parameter's served bits."""
    from faircast_ds.megatron import attach

    args = MEGATRON_ARGS
    model, optimizer = setup.build(args, device)
    fc = attach(optimizer, {"mode": mode, "seed": MEGATRON_SEED}, route=args.route) if mode else None
    setup.set_masters(optimizer)
    residuals: dict = {}
    bits = []
    for n in range(1, args.steps + 1):
        setup.step(model, optimizer, args, device, n)
        torch.cuda.synchronize()
        bits.append(setup.served_full(model))
        if fc is None:
            continue
        checked = 0
        for shard, main, served in setup.shards(optimizer):
            assert served.device.type == main.device.type == device.type  # both on the GPU
            m = main.detach().float().cpu()
            res = residuals.setdefault(shard.key, torch.zeros(shard.numel)) if mode == "error_feedback" else None
            want = bf16_bits(cast(m, mode, seed=MEGATRON_SEED, step=n, name=shard.name, start=shard.start, residual=res))
            got = bf16_bits(served.detach().cpu())
            assert not differ(got, want), f"{mode} step {n} {shard.name}: " + differ(got, want)
            checked += shard.numel
        assert checked > 0
    return bits


@pytest.mark.parametrize("mode", MODES)
def test_megatron_served_shards_are_the_cpu_cast_of_the_fp32_main_shards(megatron_world, mode):
    setup, device = megatron_world
    bits = megatron_served_bits(setup, device, mode)
    if mode == "nearest":  # Fair Cast's nearest is Megatron's own copy, bit for bit
        own = megatron_served_bits(setup, device, None)
        for n, (a, b) in enumerate(zip(bits, own), start=1):
            assert a.keys() == b.keys()
            for name in a:
                assert torch.equal(a[name], b[name]), f"step {n}: {name}"
    elif mode == "stochastic":  # the check can tell the modes apart
        rn = megatron_served_bits(setup, device, "nearest")
        assert any(not torch.equal(bits[-1][k], rn[-1][k]) for k in bits[-1])
