"""The fused kernels (faircast_ds.casting.kernels) against the definition, faircast_ds.casting.rules.cast, bit for bit.

The CPU kernel is built once per session (module fixture, ~6 s with g++ on two cores). Where it
cannot be built, or under FAIRCAST_DS_KERNELS=eager (how CI simulates a machine without a
compiler), the kernel tests skip and the fallback tests still run. The Triton kernel is checked on
CUDA where there is one, and in Triton's CPU interpreter where Triton is installed.
"""
from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_casts import awkward_values, from_bits, specials

from faircast_ds.casting import kernels, modes
from faircast_ds.casting.kernels import cpu
from faircast_ds.casting.reference import cast_reference
from faircast_ds.casting.bits import bf16_bits, fp32_bits
from faircast_ds.casting.modes import MODES
from faircast_ds.casting.rules import cast, cast_into

ROOT = Path(__file__).resolve().parents[2]
STEPS_SEEDS_STARTS = [  # (seed, step, start): small, and past 2^32 in every word
    (7, 3, 0),
    (0, 1, 11),
    (2**40 + 3, 2**33 + 5, 2**32 - 700),  # the index crosses 2^32 inside the tensor
    (123, 2**32, 2**32),
    (2**63 - 1, 2**63 - 1, 2**45 + 17),
]


def awkward() -> torch.Tensor:
    return torch.cat([awkward_values(1500), specials(), awkward_values(40, seed=3)])


def run_cast(x, mode, *, seed, step, start, residual=None):
    return cast(x, mode, seed=seed, step=step, name="blocks.0.w", start=start, residual=residual)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    g, w = bf16_bits(got), bf16_bits(want)
    if not torch.equal(g, w):
        bad = (g != w).nonzero()[:5, 0].tolist()
        raise AssertionError(f"{what}: {int((g != w).sum())} elements differ, first at {bad}: "
                             f"got {[hex(v) for v in g[bad].tolist()]}, want {[hex(v) for v in w[bad].tolist()]}")


def expected_counts(old: torch.Tensor, new: torch.Tensor) -> tuple[int, int]:
    return int((bf16_bits(old) != bf16_bits(new)).sum()), int((~torch.isfinite(new.float())).sum())


@pytest.fixture(scope="module")
def fused(request) -> str:
    """The CPU kernel, built once; skips when the session asks for the eager path or cannot build."""
    if kernels.requested_backend() == "eager":
        pytest.skip("FAIRCAST_DS_KERNELS=eager: the fused CPU kernel is not used in this session")
    if not cpu.available():
        pytest.skip(f"fused CPU kernel unavailable: {cpu.unavailable_reason()}")
    return "native"


# the builds besides native that the tests compile on x86: (CPU flag that makes native differ from it,
# what its code is); a CPU without the flag already runs that code as its native build
NARROWER_BUILDS = {
    "x86-64-v3": ("avx512f", "AVX2: 8 lanes, no mask registers"),
    "x86-64-v2": ("avx2", "SSE4.2: 4 lanes, the portable vector code"),
}


def narrower_builds_here() -> tuple[list[str], dict[str, str]]:
    """(the narrower builds this CPU can check, why each other one is not checked)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return [], {arch: f"not an x86 CPU ({platform.machine()}): only the native build exists"
                    for arch in NARROWER_BUILDS}
    flags = set(Path("/proc/cpuinfo").read_text().split())
    checkable = [arch for arch, (flag, _) in NARROWER_BUILDS.items() if flag in flags]
    why_not = {arch: f"this CPU has no {flag}: its native build already is the {what} code"
               for arch, (flag, what) in NARROWER_BUILDS.items() if arch not in checkable}
    return checkable, why_not


@pytest.fixture(scope="module", params=["native", *NARROWER_BUILDS])
def arch(request, fused) -> str:
    """One build of the CPU kernel (the test id names it). A build this CPU should check and that
    fails to compile fails the test with the compiler's reason; one this CPU cannot run skips,
    saying why."""
    build = request.param
    if build == "native":
        return fused
    checkable, why_not = narrower_builds_here()
    if build not in checkable:
        pytest.skip(why_not[build])
    try:
        cpu.load(build)
    except cpu.KernelUnavailable as exc:
        pytest.fail(f"the {build} build of the fused kernel ({NARROWER_BUILDS[build][1]}) failed: {exc}")
    return build


def test_a_narrower_build_is_checked_on_x86(fused):
    """On x86, native alone would leave the generic vector code that other CPUs run untested."""
    checkable, why_not = narrower_builds_here()
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"not an x86 CPU ({platform.machine()}): the kernel has one build here, native")
    assert checkable, f"only the native build can be checked here: {why_not}"
    for build in checkable:
        cpu.load(build)  # raises KernelUnavailable, with the reason, if it does not build


def fused_cast(out, x, mode, *, seed, step, start, residual=None, arch="native"):
    """The kernel itself (not the dispatcher), for a given build."""
    key = modes.noise_key(mode, seed=seed, step=step, name="blocks.0.w")
    return cpu.cast_into(out, x, mode, key=key, start=start, residual=residual, arch=arch)


@pytest.mark.parametrize("mode", MODES)
def test_fused_equals_cast_bitwise(arch, mode):
    x = awkward()
    for seed, step, start in STEPS_SEEDS_STARTS:
        r_want = torch.randn_like(x) * 1e-4 if mode == "error_feedback" else None
        r_got = r_want.clone() if r_want is not None else None
        old = cast(x * 1.001, "nearest", seed=0, step=0, name="w")  # a previous step's bits
        want = run_cast(x, mode, seed=seed, step=step, start=start, residual=r_want)
        out = old.clone()
        counts = fused_cast(out, x, mode, seed=seed, step=step, start=start, residual=r_got, arch=arch)
        what = f"{arch} {mode} seed={seed} step={step} start={start}"
        assert_bits_equal(out, want, what)
        assert counts == expected_counts(old, want), what
        if r_want is not None:
            assert torch.equal(fp32_bits(r_got), fp32_bits(r_want)), what


def test_error_feedback_residual_chain(arch):
    """Several steps of error feedback, the residual carried by each path, masters moving, some
    becoming non-finite and coming back, residuals large enough to push to the top of the range."""
    g = torch.Generator().manual_seed(5)
    base = awkward()
    e_want = torch.zeros_like(base)
    e_got = torch.zeros_like(base)
    out = torch.zeros(base.shape, dtype=torch.bfloat16)
    for t in range(6):
        x = base * (1 + 1e-3 * t) + torch.randn(base.shape, generator=g) * 1e-6
        if t == 3:
            e_want[:50] = 1e30
            e_got[:50] = 1e30
            e_want[50:60] = torch.finfo(torch.float32).tiny / 3  # subnormal residuals
            e_got[50:60] = torch.finfo(torch.float32).tiny / 3
        old = out.clone()
        want = run_cast(x, "error_feedback", seed=0, step=t, start=0, residual=e_want)
        counts = fused_cast(out, x, "error_feedback", seed=0, step=t, start=0, residual=e_got, arch=arch)
        assert_bits_equal(out, want, f"{arch} step {t}")
        assert torch.equal(fp32_bits(e_got), fp32_bits(e_want)), f"{arch} residual after step {t}"
        assert counts == expected_counts(old, want)


@pytest.mark.parametrize("mode", MODES)
def test_fused_equals_slow_reference(fused, mode):
    x = torch.cat([awkward_values(300, seed=9), specials()])
    e_ref = torch.randn_like(x) * 1e-4 if mode == "error_feedback" else None
    e_got = e_ref.clone() if e_ref is not None else None
    ref = cast_reference(x, mode, seed=3, step=2**33 + 1, name="blocks.0.w", start=2**32 - 5, residual=e_ref)
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    cast_into(out, x, mode, seed=3, step=2**33 + 1, name="blocks.0.w", start=2**32 - 5, residual=e_got)
    nan = torch.isnan(x)
    assert_bits_equal(out[~nan], ref[~nan], mode)
    assert torch.isnan(out[nan].float()).all()
    if mode != "nearest":  # nearest's NaN bits are torch's, which the reference leaves open
        assert_bits_equal(out[nan], ref[nan], f"{mode} NaN bits")
    if e_ref is not None:
        assert torch.equal(fp32_bits(e_got), fp32_bits(e_ref))


@pytest.mark.parametrize("mode", MODES)
def test_odd_lengths_and_misaligned_views(fused, mode):
    """Lengths around the vector width, views starting at odd elements of their buffers, each
    operand misaligned differently; what lies outside the views is never touched."""
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(4200, generator=g) * 0.05
    outs = torch.full((4200,), 7.0, dtype=torch.bfloat16)
    rs = torch.randn(4200, generator=g) * 1e-5
    for n in (0, 1, 2, 3, 7, 15, 16, 17, 31, 33, 63, 65, 127, 1000, 4097):
        for x_off, o_off, r_off in ((0, 0, 0), (1, 3, 5), (13, 2, 7)):
            x = xs.narrow(0, x_off, n)
            out_buf = outs.clone()
            res_buf = rs.clone()
            out = out_buf.narrow(0, o_off, n)
            res = res_buf.narrow(0, r_off, n) if mode == "error_feedback" else None
            r_want = rs.narrow(0, r_off, n).clone() if res is not None else None
            want = run_cast(x, mode, seed=1, step=9, start=x_off + 5, residual=r_want)
            counts = cast_into(out, x, mode, seed=1, step=9, name="blocks.0.w", start=x_off + 5, residual=res)
            what = f"{mode} n={n} offsets={x_off, o_off, r_off}"
            assert_bits_equal(out, want, what)
            assert counts == expected_counts(outs.narrow(0, o_off, n), want), what
            untouched = torch.ones(4200, dtype=torch.bool)
            untouched[o_off:o_off + n] = False
            assert torch.equal(bf16_bits(out_buf[untouched]), bf16_bits(outs[untouched])), what
            if res is not None:
                assert torch.equal(fp32_bits(res), fp32_bits(r_want)), what
                untouched = torch.ones(4200, dtype=torch.bool)
                untouched[r_off:r_off + n] = False
                assert torch.equal(res_buf[untouched], rs[untouched]), what


@pytest.mark.parametrize("mode", MODES)
def test_non_contiguous_operands(fused, mode):
    g = torch.Generator().manual_seed(2)
    xs = torch.randn(3001, generator=g) * 0.05
    x = xs[1::3]
    out_buf = torch.zeros(2 * x.numel() + 1, dtype=torch.bfloat16)
    out = out_buf[1::2]
    res_buf = torch.randn(2 * x.numel(), generator=g) * 1e-5
    res_before = res_buf.clone()
    res = res_buf[::2] if mode == "error_feedback" else None
    r_want = res.clone() if res is not None else None
    want = run_cast(x.contiguous(), mode, seed=4, step=4, start=2, residual=r_want)
    counts = cast_into(out, x, mode, seed=4, step=4, name="blocks.0.w", start=2, residual=res)
    assert_bits_equal(out, want, mode)
    assert counts == expected_counts(torch.zeros_like(out), want)
    assert torch.equal(bf16_bits(out_buf[0::2]), torch.zeros(x.numel() + 1, dtype=torch.int64))
    if res is not None:
        assert torch.equal(fp32_bits(res), fp32_bits(r_want))
        assert torch.equal(fp32_bits(res_buf[1::2]), fp32_bits(res_before[1::2]))


@pytest.mark.parametrize("mode", ("stochastic", "dither", "error_feedback"))
def test_large_shard_many_threads_and_index_word_crossing(fused, mode):
    """A shard big enough for several parallel chunks, whose indices cross 2^32 inside a chunk."""
    g = torch.Generator().manual_seed(3)
    n = 300_001
    x = torch.randn(n, generator=g) * 0.05
    x[::9973] = float("nan")
    x[5::10007] = float("inf")
    r_want = torch.randn(n, generator=g) * 1e-5 if mode == "error_feedback" else None
    r_got = r_want.clone() if r_want is not None else None
    start = 2**32 - 123_456
    want = run_cast(x, mode, seed=11, step=2**32 + 1, start=start, residual=r_want)
    out = torch.zeros(n, dtype=torch.bfloat16)
    counts = cast_into(out, x, mode, seed=11, step=2**32 + 1, name="blocks.0.w", start=start, residual=r_got)
    assert_bits_equal(out, want, mode)
    assert counts == expected_counts(torch.zeros(n, dtype=torch.bfloat16), want)
    assert counts[1] > 0
    if r_want is not None:
        assert torch.equal(fp32_bits(r_got), fp32_bits(r_want))


def test_counts_track_changes_between_steps(fused):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(4)) * 0.05
    out = torch.empty(10_000, dtype=torch.bfloat16)
    cast_into(out, x, "dither", seed=1, step=1, name="w")
    assert cast_into(out, x, "dither", seed=1, step=2, name="w") == (0, 0), "dither is fixed across steps"
    before = out.clone()
    changed, nonfinite = cast_into(out, x, "stochastic", seed=1, step=3, name="w")
    assert changed == int((bf16_bits(before) != bf16_bits(out)).sum()) and changed > 0
    assert nonfinite == 0
    x[7] = float("nan")
    x[8] = -float("inf")
    x[9] = 3.0e38  # near the top: stays finite, as round-to-nearest does
    assert cast_into(out, x, "stochastic", seed=1, step=3, name="w") == (3, 2)


@pytest.mark.parametrize("n", [1, 2, 4, 17, 64])
def test_signed_zero_ties_serve_the_zero_neighbour(fused, n):
    """Error feedback clamps RN(x + e) between x's neighbours. When RN(x + e) is a zero of the other
    sign than x's zero neighbour, every path serves the neighbour (sign included), whatever the
    length: torch's own clamp breaks that tie differently in its vector loop and its scalar tail
    (n = 1, 2, 4, 17 reach the tail), so the eager path and the reference pick it explicitly."""
    x = from_bits(([0x80000001, 0x00000001, 0x80000000, 0x00000000] * 16)[:n])  # neighbours (-0, -tiny)...
    e = from_bits(([0x00000001, 0x80000001, 0x00000001, 0x80000001] * 16)[:n])  # RN(x + e) is the other zero
    want_bits = ([0x8000, 0x0000, 0x8000, 0x0000] * 16)[:n]
    e_want, e_got, e_ref = e.clone(), e.clone(), e.clone()
    want = cast(x, "error_feedback", seed=0, step=0, name="w", residual=e_want)
    out = torch.empty(n, dtype=torch.bfloat16)
    cast_into(out, x, "error_feedback", seed=0, step=0, name="w", residual=e_got)
    ref = cast_reference(x, "error_feedback", seed=0, step=0, name="w", residual=e_ref)
    assert bf16_bits(want).tolist() == want_bits
    assert_bits_equal(out, want, "signed-zero ties, fused")
    assert_bits_equal(ref, want, "signed-zero ties, reference")
    assert torch.equal(fp32_bits(e_got), fp32_bits(e_want)) and torch.equal(fp32_bits(e_ref), fp32_bits(e_want))


def test_dispatch_and_arguments(fused, monkeypatch):
    x = torch.randn(100)
    with pytest.raises(TypeError, match="bf16 output"):
        cast_into(torch.empty(100), x, "stochastic", seed=0, step=0, name="w")
    with pytest.raises(TypeError, match="bf16 output"):
        cast_into(torch.empty(99, dtype=torch.bfloat16), x, "stochastic", seed=0, step=0, name="w")
    with pytest.raises(ValueError, match="unknown fair cast mode"):
        cast_into(torch.empty(100, dtype=torch.bfloat16), x, "round", seed=0, step=0, name="w")
    with pytest.raises(ValueError, match="non-negative"):
        cast_into(torch.empty(100, dtype=torch.bfloat16), x, "stochastic", seed=-1, step=0, name="w")
    with pytest.raises(ValueError, match="non-negative"):
        cast_into(torch.empty(100, dtype=torch.bfloat16), x, "stochastic", seed=0, step=0, name="w", start=-1)
    buf = torch.zeros(200)
    with pytest.raises(ValueError, match="share memory"):
        cast_into(buf[:100].view(torch.bfloat16)[:100], buf[10:110], "nearest", seed=0, step=0, name="w")
    with pytest.raises(ValueError, match="share memory"):
        cast_into(torch.empty(100, dtype=torch.bfloat16), buf[:100], "error_feedback", seed=0, step=0, name="w",
                  residual=buf[50:150])
    assert kernels.backend_for(torch.device("cpu")) == "cpp"
    monkeypatch.setenv(kernels.ENV_VAR, "cpp")
    assert kernels.backend_for(torch.device("cpu")) == "cpp"
    monkeypatch.setenv(kernels.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="FAIRCAST_DS_KERNELS='fast'"):
        cast_into(torch.empty(100, dtype=torch.bfloat16), x, "nearest", seed=0, step=0, name="w")
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    with pytest.raises(ValueError, match="cannot cast cpu tensors"):
        cast_into(torch.empty(100, dtype=torch.bfloat16), x, "nearest", seed=0, step=0, name="w")


# ---- the eager fallback: runs everywhere, compiler or not ----------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_eager_fallback_equals_cast(monkeypatch, mode):
    monkeypatch.setenv(kernels.ENV_VAR, "eager")
    assert kernels.backend_for(torch.device("cpu")) == "eager"
    x = awkward()
    r_want = torch.randn_like(x) * 1e-4 if mode == "error_feedback" else None
    r_got = r_want.clone() if r_want is not None else None
    old = cast(x * 1.01, "nearest", seed=0, step=0, name="w")
    want = run_cast(x, mode, seed=2, step=5, start=3, residual=r_want)
    out = old.clone()
    counts = cast_into(out, x, mode, seed=2, step=5, name="blocks.0.w", start=3, residual=r_got)
    assert_bits_equal(out, want, mode)
    assert counts == expected_counts(old, want)
    if r_want is not None:
        assert torch.equal(fp32_bits(r_got), fp32_bits(r_want))


def test_no_compiler_falls_back_with_one_warning(monkeypatch):
    """A machine without a C++ compiler: ``auto`` warns once and uses the eager path; forcing
    ``cpp`` is an error that says why."""
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(cpu, "_modules", {})
    monkeypatch.setattr(cpu, "_errors", {})
    monkeypatch.setattr(kernels, "_warned", set())
    x = torch.randn(1000) * 0.05
    out = torch.empty(1000, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        cast_into(out, x, "stochastic", seed=1, step=1, name="w")
    assert_bits_equal(out, cast(x, "stochastic", seed=1, step=1, name="w"), "fallback")
    cast_into(out, x, "dither", seed=1, step=1, name="w")  # no second warning (pytest would not fail on one,
    assert kernels._warned == {"cpp"}                          # but the set says it was not issued again)
    monkeypatch.setenv(kernels.ENV_VAR, "cpp")
    with pytest.raises(RuntimeError, match="FAIRCAST_DS_KERNELS=cpp but that kernel cannot run here"):
        cast_into(out, x, "stochastic", seed=1, step=1, name="w")


def test_the_cached_build_is_named_after_its_source(tmp_path, monkeypatch):
    """torch's loader rebuilds a cached extension by file times alone; a changed source that a copy
    or an install left older than the cached object must still get its own build, so the name
    carries the source's hash (and each arch its own name)."""
    before = cpu.build_name("native")
    changed = tmp_path / "fused_cast.cpp"
    changed.write_text(cpu.SOURCE.read_text() + "\n// one more line\n")
    os.utime(changed, (0, 0))  # older than any cached build
    monkeypatch.setattr(cpu, "SOURCE", changed)
    assert cpu.build_name("native") != before
    assert cpu.build_name("native") != cpu.build_name("x86-64-v3")


def test_kernel_mode_codes_are_the_ones_modes_defines():
    import re

    source = (Path(cpu.__file__).parent / "fused_cast.cpp").read_text()
    enum = re.search(r"enum Mode : int64_t \{([^}]*)\}", source).group(1)
    codes = {name: int(code) for name, code in re.findall(r"k(\w+) = (\d+)", enum)}
    camel = {m: "".join(part.title() for part in m.split("_")) for m in MODES}
    assert {camel[m]: modes.spec(m).code for m in modes.MODES} == codes


def test_bench_runs_a_tiny_case_and_formats():
    from faircast_bench import casts as bench

    report = bench.run((4096,), modes=("nearest", "stochastic"), repeats=1, eager_repeats=1, torchao=False)
    text = bench.format_report(report)
    assert "fused/RN" in text and "stochastic" in text and len(report.rows) == 2


# ---- Triton ------------------------------------------------------------------------------------

TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not (torch.cuda.is_available() and TRITON), reason="needs CUDA and Triton")
@pytest.mark.parametrize("mode", MODES)
def test_triton_equals_cast_on_cuda(mode):
    x = awkward().cuda()
    for seed, step, start in STEPS_SEEDS_STARTS:
        r_want = torch.randn_like(x) * 1e-4 if mode == "error_feedback" else None
        r_got = r_want.clone() if r_want is not None else None
        old = cast(x * 1.001, "nearest", seed=0, step=0, name="w")
        want = run_cast(x, mode, seed=seed, step=step, start=start, residual=r_want)
        out = old.clone()
        counts = cast_into(out, x, mode, seed=seed, step=step, name="blocks.0.w", start=start, residual=r_got)
        assert_bits_equal(out.cpu(), want.cpu(), f"{mode} {seed} {step} {start}")
        assert counts == expected_counts(old.cpu(), want.cpu())
        if r_want is not None:
            assert torch.equal(fp32_bits(r_got), fp32_bits(r_want))


@pytest.mark.skipif(not TRITON, reason="Triton is not installed (launch/setup.d/40-triton.sh installs it)")
def test_triton_kernel_in_the_cpu_interpreter(tmp_path):
    """The Triton kernel's own code on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1), in
    a subprocess since the interpreter is chosen when Triton is imported: three full blocks and a
    partial last one (and a single partial block), every mode, with and without counting the
    changes, against the slow reference (which shares no code with the kernel), residuals included."""
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT / 'tests' / 'casting')!r})
        from faircast_ds.casting import modes
        from faircast_ds.casting.bits import bf16_bits, fp32_bits
        from faircast_ds.casting.modes import MODES
        from faircast_ds.casting.rules import cast
        from faircast_ds.casting.kernels import triton_cast
        from faircast_ds.casting.reference import cast_reference
        from test_casts import awkward_values, specials
        block = triton_cast.BLOCK
        pool = torch.cat([specials(), awkward_values(1200)])
        checked = []
        for n in (3 * block + 517, block // 2 + 3):
            x = pool.repeat(n // pool.numel() + 1)[:n]
            for mode in MODES:
                for seed, step, start in ((7, 3, 0), (2**40 + 3, 2**33 + 5, 2**32 - 2 * block - 100)):
                    for count_changed in (True, False):
                        e_ref = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-4 \\
                            if mode == "error_feedback" else None
                        e_got = e_ref.clone() if e_ref is not None else None
                        ref = cast_reference(x, mode, seed=seed, step=step, name="w", start=start, residual=e_ref)
                        old = cast(x * 1.001, "nearest", seed=0, step=0, name="w")  # a previous step's bits
                        out = old.clone()
                        key = modes.noise_key(mode, seed=seed, step=step, name="w")
                        counts = triton_cast.cast_into(out, x, mode, key=key, start=start, residual=e_got,
                                                       count_changed=count_changed)
                        what = f"n={{n}} {{mode}} seed={{seed}} step={{step}} start={{start}} count_changed={{count_changed}}"
                        got, want = bf16_bits(out), bf16_bits(ref)
                        nan = torch.isnan(ref.float())
                        if mode == "nearest":  # nearest's NaN bits are torch's, which the reference leaves open
                            assert torch.isnan(out.float()[nan]).all(), what
                            got, want = got[~nan], want[~nan]
                        bad = (got != want).nonzero()[:5, 0].tolist()
                        assert not bad, f"{{what}}: {{int((got != want).sum())}} differ, first at {{bad}}"
                        changed = int((bf16_bits(old) != bf16_bits(out)).sum()) if count_changed else -1
                        assert counts == (changed, int((~torch.isfinite(out.float())).sum())), what
                        assert not count_changed or changed > 0, what
                        assert e_ref is None or torch.equal(fp32_bits(e_got), fp32_bits(e_ref)), what
                        checked.append(what)
        print(f"ok: {{len(checked)}} interpreter runs, sizes {{3 * block + 517}} and {{block // 2 + 3}} (block {{block}})")
    """))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0 and "ok: 32 interpreter runs" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
