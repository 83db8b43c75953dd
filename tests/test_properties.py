"""Property-based tests (hypothesis): the casts' fast paths against the slow reference over arbitrary
inputs, and the config model over arbitrary JSON.

- every cast mode x every fast path (fused C++, eager torch; the Triton kernel in its CPU interpreter
  where Triton is installed) against ``faircast_ds.reference.cast_reference``, bit for bit, over
  arbitrary fp32 bit patterns (rounding ties and specials weighted in), error-feedback residuals,
  seeds, steps, names, slice offsets (``start``), lengths, cut points and strided views, with the
  returned counts and the untouched memory around each view checked too;
- ``FairCastConfig.from_section`` over arbitrary JSON values and over near-miss sections (valid keys,
  wrong-typed or out-of-range values, typos): a config or a ``FairCastConfigError`` naming
  ``fair_cast``, never another exception.

Each property has a fixed example budget (``EXAMPLES``), no deadline and no example database, so the
time in CI is bounded and the same every run.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from faircast_ds import kernels
from faircast_ds.casts import MODES, bf16_bits, cast_into, fp32_bits
from faircast_ds.config import FairCastConfig, FairCastConfigError
from faircast_ds.reference import cast_reference

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {"cast": 200, "pieces": 100, "triton": 60, "config_json": 400, "config_valid": 200,
            "config_near_miss": 400}
PROPERTY = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------- inputs

SPECIAL_BITS = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001,
                0x7F80FFFF, 0x7FFF0000, 0x7F810000, 0x7FFFFFFF, 0x00000001, 0x80000001, 0x0000FFFF, 0x00008000,
                0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F7EFFFF, 0xFF7F8000, 0x3F800000,
                0x3F808000, 0x3F818000, 0xBF808000, 0x3F7FFFFF]
LOW_HALVES = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF]  # exact, just above, ties, just below the next


def fp32_pattern() -> st.SearchStrategy[int]:
    """Any fp32 bit pattern; rounding ties, exact bf16 values and specials weighted in."""
    return st.one_of(st.integers(0, 2**32 - 1),
                     st.builds(lambda hi, lo: hi << 16 | lo, st.integers(0, 0xFFFF), st.sampled_from(LOW_HALVES)),
                     st.sampled_from(SPECIAL_BITS))


def residual_pattern() -> st.SearchStrategy[int]:
    """An error-feedback residual: any fp32 bit pattern but NaN (the cast never leaves a NaN residual; it
    resets non-finite ones to 0), small values weighted in."""
    small = st.floats(-2.0**-10, 2.0**-10, width=32).map(lambda v: int(np.float32(v).view(np.uint32)))
    return st.one_of(fp32_pattern(), small).filter(lambda b: (b & 0x7FFFFFFF) <= 0x7F800000)


# one element: (x bits, the bf16 bits the output held before, residual bits)
ELEMENT = st.tuples(fp32_pattern(), st.integers(0, 0xFFFF), residual_pattern())
SEED = st.integers(0, 2**63 - 1)
STEP = st.one_of(st.integers(0, 2**63 - 1), st.integers(0, 8))
START = st.one_of(st.integers(0, 2**62), st.integers(2**32 - 64, 2**32 + 64), st.integers(0, 100))
NAME = st.one_of(st.sampled_from(["w", "model.layers.0.mlp.up_proj.weight"]), st.text(max_size=24))


def f32(bits: list[int]) -> torch.Tensor:
    t = torch.tensor(bits, dtype=torch.int64)
    return (t - ((t & 0x80000000) << 1)).to(torch.int32).view(torch.float32)


def bf16(bits: list[int]) -> torch.Tensor:
    t = torch.tensor(bits, dtype=torch.int64)
    return (t - ((t & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16)


def reference(x: torch.Tensor, mode: str, residual: torch.Tensor | None, **kw: Any) -> torch.Tensor:
    with np.errstate(over="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fp32 sum of a huge residual overflows: intended
        return cast_reference(x, mode, residual=residual, **kw)


def assert_same_cast(mode: str, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit for bit, with one exception the definitions leave open: ``nearest``'s NaN bits are not
    specified (torch's own cast), only that the result is NaN."""
    g, w = bf16_bits(got), bf16_bits(want)
    if mode == "nearest":
        nan = torch.isnan(want.float())
        assert torch.equal(torch.isnan(got.float()), nan), what
        g, w = g[~nan], w[~nan]
    if not torch.equal(g, w):
        i = int((g != w).nonzero()[0, 0])
        raise AssertionError(f"{what}: {int((g != w).sum())} of {g.numel()} differ, first at {i}: "
                             f"got {int(g[i]):#06x}, want {int(w[i]):#06x}")


def expected_counts(old: torch.Tensor, new: torch.Tensor, mode: str) -> tuple[int, int]:
    return int((bf16_bits(old) != bf16_bits(new)).sum()), int((~torch.isfinite(new.float())).sum())


# ---------------------------------------------------------------- the fast paths

@contextmanager
def kernels_path(path: str):
    """Force ``FAIRCAST_DS_KERNELS`` (read at call time) for the calls inside."""
    before = os.environ.get(kernels.ENV_VAR)
    os.environ[kernels.ENV_VAR] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(kernels.ENV_VAR, None)
        else:
            os.environ[kernels.ENV_VAR] = before


def cpp_unavailable() -> str | None:
    if kernels.requested_backend() == "eager":
        return "FAIRCAST_DS_KERNELS=eager: this session runs without the fused CPU kernel"
    from faircast_ds.kernels import cpu

    return None if cpu.available() else f"fused CPU kernel unavailable: {cpu.unavailable_reason()}"


TRITON = importlib.util.find_spec("triton") is not None
DEVICE = {"cpp": "cpu", "eager": "cpu", "triton": "cuda"}  # where each path casts


@pytest.fixture(scope="module", params=["cpp", "eager", "triton"])
def path(request) -> str:
    """A fast path of ``cast_into``, forced by ``FAIRCAST_DS_KERNELS``: the fused C++ kernel and the eager
    torch path on CPU tensors, the Triton kernel on CUDA tensors (where there are both)."""
    if request.param == "cpp" and (why := cpp_unavailable()):
        pytest.skip(why)
    if request.param == "triton" and not (TRITON and torch.cuda.is_available()):
        pytest.skip("the Triton kernel on CUDA needs Triton and a CUDA device (its CPU interpreter: below)")
    return request.param


def check_cast(cast_fn: Callable[..., tuple[int, int]], mode: str, elements: list[tuple[int, int, int]], *,
               seed: int, step: int, start: int, name: str, device: str = "cpu") -> None:
    """``cast_fn(out, x, mode, seed=, step=, name=, start=, residual=)`` writes what the reference casts,
    returns the counts, and updates the residual as the reference does."""
    x = f32([e[0] for e in elements])
    old = bf16([e[1] for e in elements])
    ef = mode == "error_feedback"
    r_want = f32([e[2] for e in elements]) if ef else None
    r_got = r_want.clone().to(device) if ef else None
    want = reference(x, mode, r_want, seed=seed, step=step, name=name, start=start)
    out = old.clone().to(device)
    counts = cast_fn(out, x.to(device), mode, seed=seed, step=step, name=name, start=start, residual=r_got)
    out, r_got = out.cpu(), (r_got.cpu() if ef else None)
    what = f"{mode} seed={seed} step={step} start={start} name={name!r} n={len(elements)}"
    assert_same_cast(mode, out, want, what)
    assert tuple(counts) == expected_counts(old, out, mode), what
    if ef:
        assert torch.equal(fp32_bits(r_got), fp32_bits(r_want)), f"{what}: residual"


@pytest.mark.parametrize("mode", MODES)
def test_every_fast_path_equals_the_reference(path, mode):
    @settings(max_examples=EXAMPLES["cast"], **PROPERTY)
    @given(elements=st.lists(ELEMENT, max_size=48), seed=SEED, step=STEP, start=START, name=NAME)
    def prop(elements, seed, step, start, name):
        runs.append(len(elements))
        with kernels_path(path):
            check_cast(cast_into, mode, elements, seed=seed, step=step, start=start, name=name, device=DEVICE[path])

    runs: list[int] = []
    prop()
    assert len(runs) >= EXAMPLES["cast"]


@pytest.mark.parametrize("mode", MODES)
def test_pieces_at_any_offsets_and_strides_equal_the_whole(path, mode):
    """Cast a parameter in pieces cut anywhere, each at its own ``start``, through strided views of
    larger buffers: the bits are those of the whole cast, and no byte outside the views moves."""

    @settings(max_examples=EXAMPLES["pieces"], **PROPERTY)
    @given(elements=st.lists(ELEMENT, min_size=1, max_size=64), cuts=st.lists(st.integers(0, 64), max_size=4),
           strides=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)), lead=st.integers(0, 3),
           seed=SEED, step=STEP, start=START)
    def prop(elements, cuts, strides, lead, seed, step, start):
        n, ef = len(elements), mode == "error_feedback"
        sx, so, sr = strides
        device = DEVICE[path]
        xbuf = f32([0x7FC0DEAD] * (lead + n * sx)).to(device)
        obuf = bf16([0x1234] * (lead + n * so)).to(device)
        rbuf = f32([0x3A000000] * (lead + n * sr)).to(device)
        x, out, res = xbuf[lead::sx][:n], obuf[lead::so][:n], rbuf[lead::sr][:n]
        x.copy_(f32([e[0] for e in elements]))
        out.copy_(bf16([e[1] for e in elements]))
        res.copy_(f32([e[2] for e in elements]))
        o_before, r_before = obuf.clone().cpu(), rbuf.clone().cpu()  # copies, also where device is the CPU
        r_want = res.clone().cpu() if ef else None
        want = reference(x.cpu(), mode, r_want, seed=seed, step=step, name="w", start=start)
        points = sorted({0, n, *(c % (n + 1) for c in cuts)})
        with kernels_path(path):
            for a, b in zip(points, points[1:]):
                cast_into(out[a:b], x[a:b], mode, seed=seed, step=step, name="w", start=start + a,
                          residual=res[a:b] if ef else None)
        what = f"{mode} cuts={points} strides={strides} lead={lead} start={start}"
        out, obuf, res, rbuf = out.cpu(), obuf.cpu(), res.cpu(), rbuf.cpu()
        assert_same_cast(mode, out, want, what)
        inside_o = torch.zeros(obuf.numel(), dtype=torch.bool)
        inside_o[lead::so][:n] = True
        assert torch.equal(bf16_bits(obuf)[~inside_o], bf16_bits(o_before)[~inside_o]), f"{what}: wrote outside"
        if ef:
            assert torch.equal(fp32_bits(res), fp32_bits(r_want)), f"{what}: residual"
        inside_r = torch.zeros(rbuf.numel(), dtype=torch.bool)
        inside_r[lead::sr][:n] = ef
        assert torch.equal(fp32_bits(rbuf)[~inside_r], fp32_bits(r_before)[~inside_r]), f"{what}: residual moved"

    prop()


TRITON_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import torch
from hypothesis import given, settings, strategies as st
from faircast_ds import modes
from faircast_ds.casts import MODES
from faircast_ds.kernels import triton_cast  # imports Triton, in its interpreter (TRITON_INTERPRET=1)
from test_properties import ELEMENT, EXAMPLES, NAME, PROPERTY, SEED, START, STEP, check_cast


def triton_into(out, x, mode, *, seed, step, name, start, residual):
    key = modes.noise_key(mode, seed=seed, step=step, name=name)
    return triton_cast.cast_into(out, x, mode, key=key, start=start, residual=residual)


for mode in MODES:
    @settings(max_examples=EXAMPLES["triton"], **PROPERTY)
    @given(elements=st.lists(ELEMENT, min_size=1, max_size=32), seed=SEED, step=STEP, start=START, name=NAME)
    def prop(elements, seed, step, start, name):
        check_cast(triton_into, mode, elements, seed=seed, step=step, start=start, name=name)

    prop()
    print("ok", mode, flush=True)
"""


@pytest.mark.skipif(not TRITON, reason="Triton is not installed")
def test_the_triton_kernel_equals_the_reference_in_its_interpreter(tmp_path):
    """The Triton kernel's arithmetic on CPU tensors (TRITON_INTERPRET=1, chosen when Triton is imported:
    hence a subprocess), every mode, the same properties."""
    script = tmp_path / "triton_properties.py"
    script.write_text(textwrap.dedent(TRITON_SCRIPT.format(tests=str(ROOT / "tests"))))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok ")] == list(MODES)


# ---------------------------------------------------------------- the config model

JSON_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2**70, 2**70), st.floats(),
                        st.text(max_size=16))
JSON = st.recursive(JSON_SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                    max_leaves=16)


def _engines_and_regions() -> tuple[list[str], list[str]]:
    import typing

    from faircast_ds.align.profiles import REGIONS, EngineName

    return list(typing.get_args(EngineName)), list(REGIONS)


ENGINES, REGIONS = _engines_and_regions()


def _refused(section: Any) -> bool:
    try:
        FairCastConfig.from_section(section)
        return False
    except FairCastConfigError:
        return True


def key_values(key: str, valid: st.SearchStrategy[Any], misses: list[Any], *,
               wrong: st.SearchStrategy[Any] = JSON_SCALAR) -> tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]:
    """(valid values of ``key``, values refused for it: near misses, wrong types, anything else)."""
    refused = st.one_of(st.sampled_from(misses), wrong, JSON).filter(lambda v: _refused({key: v}))
    return valid, refused


DIAGNOSTICS_VALID = st.fixed_dictionaries({}, optional={
    "every": st.sampled_from([0, 1, 10, 2**40]), "sample": st.sampled_from([1, 16384]),
    "horizon": st.sampled_from([2, 256, 4096]), "log": st.booleans()})
DIAGNOSTICS_MISSES = st.fixed_dictionaries({}, optional={
    "every": st.sampled_from([-1, 2**63 + 5, 1.0, True, "10", None]), "sample": st.sampled_from([0, -5, 2.5, False]),
    "horizon": st.sampled_from([1, 4097, 256.0]), "log": st.sampled_from([0, 1, "yes", None]), "evry": JSON_SCALAR})
ALIGN_VALID = st.one_of(st.none(), st.fixed_dictionaries(
    {"engine": st.sampled_from(ENGINES)}, optional={"regions": st.lists(st.sampled_from(REGIONS), unique=True)}))
ALIGN_MISSES = st.fixed_dictionaries({}, optional={
    "engine": st.sampled_from(ENGINES + ["vllm", "SGLang", "", 3]),
    "regions": st.lists(st.sampled_from(REGIONS + ["rope ", "attention", 3, None]), max_size=4),
    "engin": JSON_SCALAR})
KEYS = {
    "enabled": key_values("enabled", st.booleans(), [0, 1, "true", None]),
    "mode": key_values("mode", st.sampled_from(MODES), ["sr", "Stochastic", "nearest ", ""]),
    "seed": key_values("seed", st.one_of(st.integers(0, 2**63 - 1), st.sampled_from([0, 2**63 - 1])),
                       [2**63, -1, 1.0, 1.5, True, "7", None]),
    "on_nonfinite": key_values("on_nonfinite", st.sampled_from(["error", "propagate"]), ["ignore", "Error", "reset"]),
    "on_missing_state": key_values("on_missing_state", st.sampled_from(["error", "reset"]), ["ignore", "propagate"]),
    "diagnostics": key_values("diagnostics", DIAGNOSTICS_VALID, [None, [], 10, "off"], wrong=DIAGNOSTICS_MISSES),
    "align_rounding": key_values("align_rounding", ALIGN_VALID, [[], "sglang", {}], wrong=ALIGN_MISSES),
}
KEYS = {key: KEYS.get(key, (st.nothing(), JSON)) for key in FairCastConfig.model_fields}  # keys added later too
TYPOS = ["moed", "Mode", "seeds", "on_non_finite", "diagnostic", "align", "enable", ""]
VALID_SECTION = st.fixed_dictionaries({}, optional={key: valid for key, (valid, _) in KEYS.items()})


@st.composite
def one_miss(draw) -> tuple[dict, str]:
    """A valid section with one key made wrong (a refused value, or an unknown key): (section, that key)."""
    section = dict(draw(VALID_SECTION))
    if draw(st.booleans()):
        key = draw(st.sampled_from(TYPOS))
        section[key] = draw(JSON_SCALAR)
    else:
        key = draw(st.sampled_from(sorted(KEYS)))
        section[key] = draw(KEYS[key][1])
    return section, key


def check_section(section: Any) -> FairCastConfig | FairCastConfigError:
    """A config, or a FairCastConfigError naming the section; never any other exception."""
    try:
        config = FairCastConfig.from_section(section)
    except FairCastConfigError as exc:
        assert type(exc) is FairCastConfigError
        assert "fair_cast" in str(exc)
        event("refused")  # --hypothesis-show-statistics shows the share of each
        return exc
    event("valid")
    assert isinstance(config, FairCastConfig)
    assert FairCastConfig.from_section(config.model_dump()) == config  # what validates, re-validates as itself
    return config


@settings(max_examples=EXAMPLES["config_json"], **PROPERTY)
@given(value=JSON)
def test_any_json_value_gives_a_config_or_a_config_error(value):
    check_section(value)


@settings(max_examples=EXAMPLES["config_valid"], **PROPERTY)
@given(section=VALID_SECTION)
def test_valid_sections_validate(section):
    config = check_section(section)
    assert isinstance(config, FairCastConfig), config
    for key, value in section.items():
        got = getattr(config, key)
        assert (got.model_dump() if hasattr(got, "model_dump") else got) == value or key in ("diagnostics",
                                                                                            "align_rounding")


@settings(max_examples=EXAMPLES["config_near_miss"], **PROPERTY)
@given(case=one_miss())
def test_a_near_miss_is_refused_naming_its_key(case):
    section, key = case
    error = check_section(section)
    assert isinstance(error, FairCastConfigError), f"{section} validated"
    assert f"fair_cast.{key}" in str(error), str(error)
