"""A slice made of runs of a parameter, cast in one kernel call (faircast_ds/casting/runs.py, ``cast_into(runs=)``).

Each element's noise is keyed by its own index in the parameter; the oracle casts every run on its own
with the slow reference (``cast_reference(run, start=its start)``, which shares no code with the kernels)
and concatenates. Runs cross the places the kernels cut their work (the CPU kernel's 2^16 index blocks and
vector lanes, its threads' chunks; Triton's blocks) and the 32-bit words of the index.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from conftest import ROOT
from faircast_ds.casting import kernels
from faircast_ds.casting.bits import bf16_bits, fp32_bits
from faircast_ds.casting.modes import MODES
from faircast_ds.casting.rules import cast, cast_into
from faircast_ds.config.section import FairCastConfig
from faircast_ds.casting.kernels import cpu
from faircast_ds.megatron.layout import TensorSplit
from faircast_ds.casting.reference import cast_reference
from faircast_ds.casting.runs import Runs
from faircast_ds.shard.caster import ShardCaster, ShardSlice
from test_casts import awkward_values, specials

NAME = "decoder.layers.3.self_attention.linear_proj.weight"
# (start, length): empty runs, single elements, lane-sized and odd lengths, a run across a multiple of 2^16,
# one across 2^32, one past 2^45, starts out of order
LAYOUT = [(5, 17), (100, 0), (2**16 - 9, 40), (7, 1), (2**32 - 3, 33), (2**45 + 17, 16), (900, 15), (300, 0),
          (2**16 * 3 + 5, 1030), (64, 31)]


def _values(n: int, seed: int = 0) -> torch.Tensor:
    pool = torch.cat([specials(), awkward_values(1500, seed=seed)])
    return pool.repeat(n // pool.numel() + 1)[:n]


def _reference(x: torch.Tensor, layout, mode: str, seed: int, step: int) -> torch.Tensor:
    parts, at = [], 0
    for start, length in layout:
        parts.append(cast_reference(x[at:at + length], mode, seed=seed, step=step, name=NAME, start=start))
        at += length
    return torch.cat(parts)


def _index_oracle(layout) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in layout]))


def _table(layout) -> Runs:
    return Runs.of([s for s, _ in layout], [n for _, n in layout])


@pytest.fixture(scope="module")
def fused() -> None:
    if kernels.requested_backend() == "eager":
        pytest.skip("FAIRCAST_DS_KERNELS=eager: the fused CPU kernel is not used in this session")
    if not cpu.available():
        pytest.skip(f"fused CPU kernel unavailable: {cpu.unavailable_reason()}")


def test_runs_indices_and_refusals():
    table = _table(LAYOUT)
    assert table.numel == sum(n for _, n in LAYOUT) and table.count == len(LAYOUT)
    assert torch.equal(table.indices(), _index_oracle(LAYOUT))
    with pytest.raises(ValueError, match="negative index"):
        Runs.of([3, -1], [2, 2])
    with pytest.raises(ValueError, match="negative length"):
        Runs.of([3, 9], [2, -2])
    with pytest.raises(ValueError, match="one length"):
        Runs.of([3, 9], [2])
    with pytest.raises(ValueError, match="at least one run"):
        Runs.of([], [])
    with pytest.raises(ValueError, match="2\\^63"):
        Runs.of([2**63 - 4], [5])
    x = torch.zeros(table.numel - 1)
    with pytest.raises(ValueError, match=f"runs cover {table.numel} elements, x has {table.numel - 1}"):
        cast_into(torch.zeros_like(x, dtype=torch.bfloat16), x, "dither", seed=1, step=1, name=NAME, runs=table)
    with pytest.raises(TypeError, match="Runs"):
        cast_into(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3), "dither", seed=1, step=1, name=NAME,
                  runs=[(0, 3)])


@pytest.mark.parametrize("mode", MODES)
def test_fused_runs_equal_the_reference_run_by_run(fused, mode):
    table = _table(LAYOUT)
    x = _values(table.numel)
    for seed, step in ((7, 3), (2**40 + 3, 2**33 + 5)):
        e_ref = torch.randn(table.numel, generator=torch.Generator().manual_seed(seed % 97)) * 1e-4 \
            if mode == "error_feedback" else None
        e_got = e_ref.clone() if e_ref is not None else None
        if mode == "error_feedback":  # no noise: the reference is one cast of the whole slice
            want = cast_reference(x, mode, seed=seed, step=step, name=NAME, residual=e_ref)
        else:
            want = _reference(x, LAYOUT, mode, seed, step)
        old = cast(x * 1.001, "nearest", seed=0, step=0, name=NAME)
        out = old.clone()
        counts = cast_into(out, x, mode, seed=seed, step=step, name=NAME, runs=table, residual=e_got)
        got, ref = bf16_bits(out), bf16_bits(want)
        if mode == "nearest":  # torch's NaN bits, which the reference leaves open
            nan = torch.isnan(want.float())
            assert torch.isnan(out.float()[nan]).all()
            got, ref = got[~nan], ref[~nan]
        assert torch.equal(got, ref), (mode, seed, int((got != ref).sum()))
        assert counts == (int((bf16_bits(old) != bf16_bits(out)).sum()), int((~torch.isfinite(out.float())).sum()))
        assert e_ref is None or torch.equal(fp32_bits(e_got), fp32_bits(e_ref))


@pytest.mark.parametrize("mode", ["stochastic", "dither"])
def test_fused_runs_across_threads_chunks(fused, mode):
    """A large slice (several of the parallel loop's chunks of 2^15, each starting inside a run) against
    ``cast`` keyed by an index built here with numpy; also under one thread."""
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 3000, (150,), generator=g).tolist() + [70_001]
    starts = (torch.randint(0, 2**34, (len(lengths),), generator=g)).tolist()
    layout = list(zip(starts, lengths))
    table = _table(layout)
    x = torch.randn(table.numel, generator=g)
    want = cast(x, mode, seed=3, step=9, name=NAME, index=_index_oracle(layout))
    threads = torch.get_num_threads()
    try:
        for n in {threads, 1}:
            torch.set_num_threads(n)
            out = torch.zeros(table.numel, dtype=torch.bfloat16)
            cast_into(out, x, mode, seed=3, step=9, name=NAME, runs=table)
            assert torch.equal(bf16_bits(out), bf16_bits(want)), n
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("backend", ["cpp", "eager"])
@pytest.mark.parametrize("staging", [False, True])
def test_shard_caster_casts_a_slice_of_any_runs(backend, staging, monkeypatch):
    """ShardCaster with a slice of runs (and padding and a plain slice beside it) in one flat shard, on the
    direct and the staged route, with the fused kernel and the eager path: the reference, run by run."""
    if backend == "cpp" and (kernels.requested_backend() == "eager" or not cpu.available()):
        pytest.skip("the fused CPU kernel is not used here")
    monkeypatch.setenv(kernels.ENV_VAR, backend)
    table = _table(LAYOUT)
    n = table.numel
    x = _values(n + 40, seed=2)
    slices = [ShardSlice(NAME, LAYOUT[0][0], n, 0, runs=table), ShardSlice("b", 3, 30, n + 10)]
    from faircast_ds.shard.caster import with_padding

    slices = with_padding(slices, n + 40)
    caster = ShardCaster(FairCastConfig(mode="dither", seed=11, on_nonfinite="propagate"), force_staging=staging)
    caster.begin_step()
    served = torch.zeros(n + 40, dtype=torch.bfloat16)
    caster.cast_flat("k", x, served, slices)
    want = torch.cat([_reference(x[:n], LAYOUT, "dither", 11, 1), x[n:n + 10].to(torch.bfloat16),
                      cast_reference(x[n + 10:n + 40], "dither", seed=11, step=1, name="b", start=3)])
    assert torch.equal(bf16_bits(served), bf16_bits(want))
    assert caster.last.numel == n + 30


def test_a_slice_whose_runs_do_not_match_it_is_refused():
    with pytest.raises(ValueError, match="its runs cover 35 elements, the slice has 34"):
        ShardSlice("w", 5, 34, 0, runs=Runs.of([5, 40], [17, 18])).run_table
    with pytest.raises(ValueError, match="starts at 6, its first run at 5"):
        ShardSlice("w", 6, 35, 0, runs=Runs.of([5, 40], [17, 18])).run_table


def test_a_row_parallel_shard_is_one_kernel_call(monkeypatch):
    """A real model's row-parallel weight (2048 rows of 2752 on this rank) is one slice, cast by one call."""
    split = TensorSplit((2048, 2752), 1, 1, 2, 1)
    n = 2048 * 2752
    slices = split.slices("w", 0, n)
    assert len(slices) == 1 and slices[0].run_table.count == 2048
    calls = []
    real = kernels.fused_cast_into
    monkeypatch.setattr(kernels, "fused_cast_into", lambda *a, **k: calls.append(k.get("runs")) or real(*a, **k))
    caster = ShardCaster(FairCastConfig(mode="stochastic", seed=1))
    caster.begin_step()
    x = torch.randn(n) * 0.02
    served = torch.zeros(n, dtype=torch.bfloat16)
    caster.cast_flat("w", x, served, slices)
    assert len(calls) == 1 and calls[0] is slices[0].run_table
    rows = [0, 1, 1000, 2047]  # spot-check whole rows against the reference at their full-parameter starts
    for r in rows:
        want = cast_reference(x[r * 2752:(r + 1) * 2752], "stochastic", seed=1, step=1, name="w",
                              start=r * 5504 + 2752)
        assert torch.equal(bf16_bits(served[r * 2752:(r + 1) * 2752]), bf16_bits(want)), r


TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not TRITON, reason="Triton is not installed (launch/setup.d/40-triton.sh installs it)")
def test_triton_runs_in_the_cpu_interpreter(tmp_path):
    """The Triton kernel's runs path in Triton's interpreter (TRITON_INTERPRET=1; a subprocess, as the
    interpreter is chosen at import): runs across its blocks and across 2^32, against the reference run by
    run, with and without the change count, and a one-run table against the contiguous path."""
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path[:0] = [{str(ROOT / 'tests' / 'casting')!r}, {str(ROOT / 'tests')!r}]
        from faircast_ds.casting import modes
        from faircast_ds.casting.bits import bf16_bits
        from faircast_ds.casting.rules import cast
        from faircast_ds.casting.kernels import triton_cast
        from faircast_ds.casting.runs import Runs
        from test_runs import LAYOUT, NAME, _reference, _values
        block = triton_cast.BLOCK
        layout = LAYOUT + [(2**32 - 700, block - 800), (12, 900)]  # Triton's blocks cut runs
        table = Runs.of([s for s, _ in layout], [n for _, n in layout])
        x = _values(table.numel)
        checked = 0
        for mode in ("stochastic", "dither"):
            for seed, step in {{"stochastic": ((2**40 + 3, 2**33 + 5),), "dither": ((7, 3),)}}[mode]:
                want = bf16_bits(_reference(x, layout, mode, seed, step))
                key = modes.noise_key(mode, seed=seed, step=step, name=NAME)
                for count_changed in (True, False):
                    old = cast(x * 1.001, "nearest", seed=0, step=0, name=NAME)
                    out = old.clone()
                    counts = triton_cast.cast_into(out, x, mode, key=key, start=0, residual=None, runs=table,
                                                   count_changed=count_changed)
                    bad = (bf16_bits(out) != want).nonzero()[:5, 0].tolist()
                    assert not bad, (mode, seed, count_changed, bad)
                    changed = int((bf16_bits(old) != bf16_bits(out)).sum()) if count_changed else -1
                    assert counts == (changed, int((~torch.isfinite(out.float())).sum())), (mode, counts)
                    checked += 1
                one = Runs.of([2**32 - 5], [table.numel])
                a, b = torch.zeros_like(x, dtype=torch.bfloat16), torch.zeros_like(x, dtype=torch.bfloat16)
                triton_cast.cast_into(a, x, mode, key=key, start=2**32 - 5, residual=None)
                triton_cast.cast_into(b, x, mode, key=key, start=0, residual=None, runs=one)
                assert torch.equal(bf16_bits(a), bf16_bits(b)), mode
        print(f"ok: {{checked}} interpreter runs over {{table.count}} runs, {{table.numel}} elements")
    """))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0 and "ok: 4 interpreter runs" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
