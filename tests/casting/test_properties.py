"""Property-based tests (hypothesis): the casts' fast paths against the slow reference over arbitrary
inputs, and the config model over arbitrary JSON.

- every cast mode x every fast path (fused C++, eager torch; the Triton kernel in its CPU interpreter
  where Triton is installed) against ``faircast_ds.casting.reference.cast_reference``, bit for bit, over
  arbitrary fp32 bit patterns (rounding ties and specials weighted in), error-feedback residuals,
  seeds, steps, names, slice offsets (``start``), lengths, cut points and strided views, with the
  returned counts and the untouched memory around each view checked too;
- ``FairCastConfig.from_section`` over arbitrary JSON values (a config or a ``FairCastConfigError``
  naming ``fair_cast``, never another exception), over sections inside every key's documented range
  (``CONTRACT``, checked against the models' Fields: they validate to the values given and the
  documented defaults) and over near-miss sections drawn from the same table (one step past a bound, a
  close but wrong type, a slipped choice, a repeated region, a missing required key, a typo: refused,
  naming that key's path); each documented edge is also enumerated once, deterministically.

Each property has a fixed example budget (``EXAMPLES``), no deadline and no example database, so the
time in CI is bounded and the same every run.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from faircast_ds.casting import kernels
from faircast_ds.casting.reference import cast_reference
from faircast_ds.casting.bits import bf16_bits, fp32_bits
from faircast_ds.casting.modes import MODES
from faircast_ds.casting.rules import cast_into
from faircast_ds.config.section import FairCastConfig, FairCastConfigError

ROOT = Path(__file__).resolve().parents[2]
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
    from faircast_ds.casting.kernels import cpu

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
from faircast_ds.casting import modes
from faircast_ds.casting.modes import MODES
from faircast_ds.casting.kernels import triton_cast  # imports Triton, in its interpreter (TRITON_INTERPRET=1)
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
    script.write_text(textwrap.dedent(TRITON_SCRIPT.format(tests=str(ROOT / "tests" / "casting"))))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok ")] == list(MODES)


# ---------------------------------------------------------------- the config model
# Every key's documented contract: docs/config.md's "type, accepted values" and "default" columns, which
# are rendered from the models' Field annotations, constraints and defaults in faircast_ds/config/section.py
# and faircast_ds/align/config.py. test_the_documented_contract_is_the_schemas reads those Fields and
# fails when they state anything else; the valid values below are drawn inside these ranges and the
# refused ones just outside them (or of another JSON type), both from this table alone: nothing here
# asks the validator which values it refuses.

JSON_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2**70, 2**70), st.floats(),
                        st.text(max_size=16))
JSON = st.recursive(JSON_SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                    max_leaves=16)


@dataclass(frozen=True)
class Key:
    """One key's documented contract."""

    kind: str  # "bool", "int", "choice" (one of ``choices``), "object" (a sub-section), "regions"
    default: Any = None  # the documented default (an object's: its keys' defaults)
    choices: tuple[str, ...] = ()  # "choice" and "regions": the accepted strings
    lo: int | None = None  # "int": the smallest accepted value
    hi: int | None = None  # "int": the largest accepted value (None: no bound)
    nullable: bool = False  # JSON null is accepted (and is the default)
    required: bool = False  # no default: a section without the key is refused


ENGINES = ("hf", "vllm-cuda", "vllm-inductor", "sglang", "vllm-cpu")
REGIONS = ("rope", "swiglu", "rmsnorm", "attention")
CONTRACT: dict[str, Key] = {
    "enabled": Key("bool", True),
    "mode": Key("choice", "dither", choices=("nearest", "stochastic", "dither", "error_feedback")),
    "seed": Key("int", 0, lo=0, hi=2**63 - 1),  # int in [0, 2^63)
    "on_nonfinite": Key("choice", "error", choices=("error", "propagate")),
    "on_missing_state": Key("choice", "error", choices=("error", "reset")),
    "diagnostics": Key("object"),
    "diagnostics.every": Key("int", 10, lo=0),
    "diagnostics.sample": Key("int", 16384, lo=1),
    "diagnostics.horizon": Key("int", 256, lo=2, hi=4096),  # int in [2, 4096]
    "diagnostics.log": Key("bool", True),
    "align_rounding": Key("object", nullable=True),
    "align_rounding.engine": Key("choice", choices=ENGINES, required=True),
    "align_rounding.regions": Key("regions", list(REGIONS), choices=REGIONS),  # each at most once
}


def children(path: str) -> list[str]:
    """The documented keys directly under ``path`` ("" for the section itself), in table order."""
    depth = 0 if not path else path.count(".") + 1
    return [k for k in CONTRACT if k.count(".") == depth and (not path or k.startswith(path + "."))]


def leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def test_the_documented_contract_is_the_schemas():
    """The table above is what the models' Fields say: the same keys, types, bounds, choices, defaults."""
    import typing

    from annotated_types import Ge, Le, Lt
    from pydantic import BaseModel

    def contract_of(model: type[BaseModel], prefix: str) -> dict[str, Key]:
        found: dict[str, Key] = {}
        for name, info in model.model_fields.items():
            path, ann = prefix + name, info.annotation
            args = typing.get_args(ann)
            nullable = type(None) in args
            sub = next((a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
            default = None if info.is_required() else info.get_default(call_default_factory=True)
            required = info.is_required()
            if sub is not None:
                found[path] = Key("object", nullable=nullable, required=required)
                found.update(contract_of(sub, path + "."))
            elif ann is bool:
                found[path] = Key("bool", default, required=required)
            elif ann is int:
                lo = next((m.ge for m in info.metadata if isinstance(m, Ge)), None)
                hi = next((m.le for m in info.metadata if isinstance(m, Le)),
                          next((m.lt - 1 for m in info.metadata if isinstance(m, Lt)), None))
                found[path] = Key("int", default, lo=lo, hi=hi, required=required)
            elif typing.get_origin(ann) is Literal:
                found[path] = Key("choice", default, choices=args, required=required)
            elif typing.get_origin(ann) is list and typing.get_origin(args[0]) is Literal:
                assert "at most once" in info.description  # documented; the model's validator enforces it
                found[path] = Key("regions", default, choices=typing.get_args(args[0]), required=required)
            else:
                raise AssertionError(f"{path}: an annotation this table has no kind for: {ann}")
        return found

    assert contract_of(FairCastConfig, "") == CONTRACT
    # strict: a wrong JSON type is never coerced ("seed": "12", "enabled": "true", 1.0 for an int)
    assert FairCastConfig.model_config["strict"] and FairCastConfig.model_fields["diagnostics"].annotation.model_config[
        "strict"]


def accepted(key: Key, value: Any) -> bool:
    """Whether ``value`` is inside the documented contract of a scalar key (this table's own reading)."""
    if key.kind == "bool":
        return isinstance(value, bool)
    if key.kind == "int":
        return (isinstance(value, int) and not isinstance(value, bool) and value >= key.lo
                and (key.hi is None or value <= key.hi))
    if key.kind == "choice":
        return isinstance(value, str) and value in key.choices
    raise AssertionError(key.kind)


def near_strings(choices: tuple[str, ...]) -> list[str]:
    """Strings one slip away from an accepted one: case, a space, a letter dropped or added, - for _."""
    slips = {s for c in choices for s in (c.upper(), c.capitalize(), c + " ", " " + c, c[:-1], c[1:], c + "s",
                                          c.replace("_", "-"), c.replace("-", "_"), c.replace("-", ""), "")}
    return sorted(slips - set(choices))


def near_values(key: Key) -> list[Any]:
    """Refused values one step outside a scalar key's documented range, or of a close but wrong type."""
    if key.kind == "bool":
        return [0, 1, 0.0, 1.0, "true", "false", "True", None, [], [True]]
    if key.kind == "int":
        edges = [key.lo - 1, key.lo - 2**64] + ([key.hi + 1, key.hi + 2**64] if key.hi is not None else [])
        inside = key.lo + 1
        return edges + [float(key.lo), float(inside), inside + 0.5, True, False, str(inside), None, [inside]]
    return near_strings(key.choices) + [None, 0, True, list(key.choices[:1])]


def valid_value(path: str) -> st.SearchStrategy[Any]:
    """Any value the contract accepts for ``path``, its range's edges weighted in."""
    key = CONTRACT[path]
    if key.kind == "bool":
        return st.booleans()
    if key.kind == "int":
        top = key.hi if key.hi is not None else key.lo + 2**70  # no bound: JSON integers beyond 64 bits too
        return st.one_of(st.integers(key.lo, top), st.sampled_from([key.lo, top, min(top, key.lo + 1)]))
    if key.kind == "choice":
        return st.sampled_from(key.choices)
    if key.kind == "regions":
        return st.lists(st.sampled_from(key.choices), unique=True)
    subkeys = children(path)
    section = st.fixed_dictionaries({leaf(k): valid_value(k) for k in subkeys if CONTRACT[k].required},
                                    optional={leaf(k): valid_value(k) for k in subkeys if not CONTRACT[k].required})
    return st.one_of(st.none(), section) if key.nullable else section


VALID_SECTION = st.fixed_dictionaries(
    {}, optional={k: valid_value(k) for k in children("")})
TYPOS = ["moed", "Mode", "seeds", "on_non_finite", "diagnostic", "align", "enable", "", "evry", "engin", "region"]


def unknown_key(path: str) -> st.SearchStrategy[str]:
    """A key the contract does not document under ``path``."""
    known = {leaf(k) for k in children(path)}
    return st.one_of(st.sampled_from(TYPOS), st.text(max_size=12)).filter(lambda k: k not in known)


@st.composite
def refused_value(draw, path: str) -> tuple[Any, str]:
    """A value the contract refuses for ``path``, and the key path the error must name."""
    key = CONTRACT[path]
    if key.kind in ("bool", "int", "choice"):
        return draw(st.one_of(st.sampled_from(near_values(key)), JSON.filter(lambda v: not accepted(key, v)))), path
    if key.kind == "regions":
        good = draw(st.lists(st.sampled_from(key.choices), unique=True))
        how = draw(st.sampled_from(["not a list", "a near miss", "a repeat"]))
        if how == "not a list" or not good and how == "a repeat":
            return draw(st.one_of(st.sampled_from(list(key.choices) + [None, {}]),
                                  JSON.filter(lambda v: not isinstance(v, list)))), path
        where = draw(st.integers(0, len(good)))
        slip = draw(st.sampled_from(near_strings(key.choices) + [None, 3, ["rope"]])) if how == "a near miss" \
            else draw(st.sampled_from(good))
        return good[:where] + [slip] + good[where:], path  # an element's error names path.<index>: path too
    # an object: not an object, a required key missing, an unknown key, or one of its keys refused
    how = draw(st.sampled_from(["not an object", "missing", "unknown key", "a key refused"]))
    section = dict(draw(valid_value(path).filter(lambda v: v is not None)))
    required = [k for k in children(path) if CONTRACT[k].required]
    if how == "not an object":
        wrong = st.one_of(st.sampled_from([[], [section], "off", 10, True] + ([] if key.nullable else [None])),
                          JSON.filter(lambda v: not isinstance(v, dict) and (v is not None or not key.nullable)))
        return draw(wrong), path
    if how == "missing" and required:
        gone = draw(st.sampled_from(required))
        del section[leaf(gone)]
        return section, gone
    if how in ("missing", "unknown key"):
        typo = draw(unknown_key(path))
        section[typo] = draw(JSON_SCALAR)
        return section, f"{path}.{typo}"
    sub = draw(st.sampled_from(children(path)))
    section[leaf(sub)], named = draw(refused_value(sub))
    return section, named


@st.composite
def one_miss(draw) -> tuple[dict, str]:
    """A valid section with one key made wrong (a refused value, or an unknown key): (section, the key path
    the error must name)."""
    section = dict(draw(VALID_SECTION))
    if draw(st.booleans()):
        key = draw(unknown_key(""))
        section[key] = draw(JSON_SCALAR)
        return section, key
    key = draw(st.sampled_from(children("")))
    section[key], named = draw(refused_value(key))
    return section, named


def expected_config(section: dict, path: str = "") -> dict:
    """What a valid section validates to, from the contract alone: each key as given, else its default."""
    out: dict[str, Any] = {}
    for k in children(path):
        name, key = leaf(k), CONTRACT[k]
        if key.kind == "object":
            given = section.get(name, None if key.nullable else {})
            out[name] = None if given is None else expected_config(given, k)
        else:
            out[name] = section.get(name, key.default)
    return out



def minimal(path: str) -> dict:
    """The smallest valid object at ``path``: its required keys, each at its first documented choice."""
    return {leaf(k): CONTRACT[k].choices[0] for k in children(path) if CONTRACT[k].required}


def placed(path: str, value: Any) -> dict:
    """A section holding ``value`` at ``path`` and nothing else but the required keys around it."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        value = {**minimal(".".join(parts[:i])), parts[i]: value}
    return {parts[0]: value}


def documented_edges() -> tuple[list[dict], list[tuple[dict, str]]]:
    """Every key's documented edges, enumerated: (sections that must validate: each bound, choice and the
    smallest object; sections that must be refused, with the key path the error must name: one step past
    each bound, each close but wrong type, each slip of each choice, a repeated region, a missing required
    key, a typo of a key)."""
    good: list[dict] = []
    bad: list[tuple[dict, str]] = []
    for path, key in CONTRACT.items():
        if key.kind == "bool":
            good += [placed(path, True), placed(path, False)]
        elif key.kind == "int":
            good += [placed(path, v) for v in (key.lo, key.lo + 1, key.hi if key.hi is not None else key.lo + 2**70)]
        elif key.kind == "choice":
            good += [placed(path, c) for c in key.choices]
        elif key.kind == "regions":
            good += [placed(path, v) for v in ([], list(key.choices), *([c] for c in key.choices))]
            bad += [(placed(path, [key.choices[0], slip]), path) for slip in near_strings(key.choices) + [None, 3]]
            bad += [(placed(path, [c, key.choices[-1], c]), path) for c in key.choices[:-1]]
            bad += [(placed(path, v), path) for v in (key.choices[0], {}, None, 3)]
        else:
            good += [placed(path, minimal(path))] + ([placed(path, None)] if key.nullable else [])
            bad += [(placed(path, v), path) for v in ([], "off", 10, True, [minimal(path)], *([] if key.nullable
                                                                                           else [None]))]
            for gone in (k for k in children(path) if CONTRACT[k].required):
                bad.append((placed(path, {k: v for k, v in minimal(path).items() if k != leaf(gone)}), gone))
        if key.kind in ("bool", "int", "choice"):
            bad += [(placed(path, v), path) for v in near_values(key)]
    for path in ["", *(k for k, key in CONTRACT.items() if key.kind == "object")]:
        known = {leaf(k) for k in children(path)}
        for typo in (t for t in TYPOS if t not in known):
            bad.append(((placed(path, {**minimal(path), typo: 1}) if path else {typo: 1}),
                        f"{path}.{typo}" if path else typo))
    return good, bad


def test_every_documented_edge():
    """Each bound, choice and sub-section the contract documents validates; one step past each, each
    close but wrong type and each slip is refused, naming its key (the property tests below draw these
    edges too, but too rarely to be sure of each one)."""
    good, bad = documented_edges()
    refused = [(section, str(exc)) for section in good for exc in [validate(section)]
               if not isinstance(exc, FairCastConfig)]
    assert not refused, refused
    for section in good:
        assert validate(section).model_dump() == expected_config(section), section
    wrong = []
    for section, named in bad:
        error = validate(section)
        if not isinstance(error, FairCastConfigError):
            wrong.append((section, "validated"))
        elif not re.search(re.escape(f"\n  fair_cast.{named}") + "[:.]", str(error)):
            wrong.append((section, f"the error does not name fair_cast.{named}: {error}"))
    assert not wrong, wrong
    assert len(bad) > 150  # every key contributed its edges


def validate(section: Any) -> FairCastConfig | FairCastConfigError:
    """A config, or a FairCastConfigError naming the section; never any other exception."""
    try:
        config = FairCastConfig.from_section(section)
    except FairCastConfigError as exc:
        assert type(exc) is FairCastConfigError
        assert "fair_cast" in str(exc)
        return exc
    assert isinstance(config, FairCastConfig)
    assert FairCastConfig.from_section(config.model_dump()) == config  # what validates, re-validates as itself
    return config


def check_section(section: Any) -> FairCastConfig | FairCastConfigError:
    """``validate``, inside a property: --hypothesis-show-statistics shows the share of each outcome."""
    result = validate(section)
    event("refused" if isinstance(result, FairCastConfigError) else "valid")
    return result


@settings(max_examples=EXAMPLES["config_json"], **PROPERTY)
@given(value=JSON)
def test_any_json_value_gives_a_config_or_a_config_error(value):
    check_section(value)


@settings(max_examples=EXAMPLES["config_valid"], **PROPERTY)
@given(section=VALID_SECTION)
def test_valid_sections_validate(section):
    """Every section inside the documented ranges validates, to the values it gives and the documented
    defaults for the rest (sub-sections included)."""
    config = check_section(section)
    assert isinstance(config, FairCastConfig), config
    assert config.model_dump() == expected_config(section)


@settings(max_examples=EXAMPLES["config_near_miss"], **PROPERTY)
@given(case=one_miss())
def test_a_near_miss_is_refused_naming_its_key(case):
    """One value outside its documented range, of another type, a missing required key or an unknown key:
    refused, with a line of the error naming that key's path."""
    section, named = case
    error = check_section(section)
    assert isinstance(error, FairCastConfigError), f"{section} validated"
    assert re.search(re.escape(f"\n  fair_cast.{named}") + "[:.]", str(error)), (named, str(error))
