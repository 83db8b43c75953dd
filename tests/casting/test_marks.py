"""Change marks (issue 32 item 4): the cast marks, 1 bit per element, every element whose served bits it
changed, on every path (the C++ kernel, the eager torch path, the Triton kernel in its interpreter), and
:class:`~faircast_ds.casting.marks.ChangeMarks` finds a reader's slices in them.

The oracle is the bits themselves: a copy of the served buffer before the cast compared with the buffer
after it (numpy, no package code), and numpy's ``unpackbits(..., bitorder="little")`` for the bitmap.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import ROOT

from faircast_ds.casting import marks as M
from faircast_ds.casting.modes import MODES
from faircast_ds.casting.rules import cast_into
from faircast_ds.casting.runs import Runs
from faircast_ds.config.section import FairCastConfig
from faircast_ds.shard.caster import ShardCaster, ShardSlice

try:
    import triton  # noqa: F401
    TRITON = True
except Exception:  # noqa: BLE001
    TRITON = False


def unpacked(bits: torch.Tensor) -> np.ndarray:
    """The bitmap as one bool per bit (numpy's own unpacking, little-endian bit order)."""
    return np.unpackbits(bits.numpy(), bitorder="little").astype(bool)


def differ(before: torch.Tensor, after: torch.Tensor) -> np.ndarray:
    return before.view(torch.int16).numpy() != after.view(torch.int16).numpy()


@pytest.fixture(params=["cpp", "eager"])
def backend(request, monkeypatch):
    monkeypatch.setenv("FAIRCAST_DS_KERNELS", request.param)
    return request.param


@pytest.mark.parametrize("density", [0.0, 0.003, 0.05, 0.6, 1.0])
def test_read_indices_lists_the_set_bits_of_any_window(density):
    """The changed indices a net-plane delta sends come from the marks without a byte per element:
    against numpy's unpacking, for windows starting and ending anywhere inside a byte."""
    gen = torch.Generator().manual_seed(int(density * 1000) + 1)
    bits = (torch.rand(803 * 8, generator=gen) < density)
    bitmap = torch.from_numpy(np.packbits(bits.numpy(), bitorder="little"))
    truth = unpacked(bitmap)
    for start, numel in [(0, 6424), (3, 1000), (7, 1), (8, 8), (13, 0), (1, 6423), (4095, 2000)]:
        got = M.read_indices(bitmap, start, numel)
        assert got.dtype == torch.int64
        assert got.tolist() == np.flatnonzero(truth[start:start + numel]).tolist(), (start, numel)


def test_bitmap_helpers_against_numpy():
    gen = torch.Generator().manual_seed(5)
    for _ in range(200):
        numel = int(torch.randint(1, 300, (1,), generator=gen))
        bits = M.new_bitmap(numel, fill=False)
        assert bits.numel() % 4 == 0 and bits.numel() * 8 >= numel
        want = np.zeros(bits.numel() * 8, dtype=bool)
        for _ in range(3):
            start = int(torch.randint(0, numel, (1,), generator=gen))
            n = int(torch.randint(0, numel - start + 1, (1,), generator=gen))
            if torch.rand(1, generator=gen) < 0.5:
                M.set_range(bits, start, n)
                want[start:start + n] = True
            else:
                mask = torch.rand(n, generator=gen) < 0.3
                M.or_mask(bits, start, mask)
                want[start:start + n] |= mask.numpy()
            assert np.array_equal(unpacked(bits), want)
            a = int(torch.randint(0, numel, (1,), generator=gen))
            b = int(torch.randint(a, numel + 1, (1,), generator=gen))
            assert np.array_equal(M.read_mask(bits, a, b - a).numpy(), want[a:b])
            assert M.count_range(bits, a, b - a) == int(want[a:b].sum())
    full = M.new_bitmap(77)
    assert unpacked(full)[:77].all() and not unpacked(full)[77:].any()


@pytest.mark.parametrize("mode", MODES)
def test_the_cast_marks_exactly_the_elements_whose_bits_it_changed(mode, backend):
    """Every mode, an unaligned first bit, bits already set kept (the marks are ORed, never cleared),
    nothing marked outside the slice."""
    gen = torch.Generator().manual_seed(11)
    n, base = 70_001, 13
    x = torch.randn(n, generator=gen) * 0.02
    out = x.to(torch.bfloat16)
    x = x + torch.randn(n, generator=gen) * 2e-5  # a step below half a bf16 spacing for most elements
    before = out.clone()
    bits = M.new_bitmap(base + n + 50, fill=False)
    M.set_range(bits, 0, 3)  # set before: kept
    M.set_range(bits, base + 100, 1)
    residual = torch.zeros(n) if mode == "error_feedback" else None
    changed, _ = cast_into(out, x, mode, seed=3, step=2, name="w", start=9, residual=residual, marks=bits,
                           mark_base=base)
    want = np.zeros(bits.numel() * 8, dtype=bool)
    want[:3] = True
    want[base + 100] = True
    want[base:base + n] |= differ(before, out)
    assert 0 < changed < n
    assert np.array_equal(unpacked(bits), want)


def test_runs_and_several_slices_into_one_flat_bitmap(backend):
    """A slice of runs (the Megatron row-parallel layout) and two slices side by side in one flat buffer,
    each at its own bit offset, as the caster passes them."""
    gen = torch.Generator().manual_seed(2)
    n = 4_099
    x = torch.randn(2 * n, generator=gen) * 0.01
    served = x.to(torch.bfloat16)
    x = x + torch.randn(2 * n, generator=gen) * 3e-5
    before = served.clone()
    bits = M.new_bitmap(2 * n, fill=False)
    runs = Runs.of([0, 5000], [1000, n - 1000])
    cast_into(served[:n], x[:n], "dither", seed=1, step=4, name="a", runs=runs, marks=bits, mark_base=0)
    cast_into(served[n:], x[n:], "stochastic", seed=1, step=4, name="b", start=7, marks=bits, mark_base=n)
    assert np.array_equal(unpacked(bits)[:2 * n], differ(before, served))
    assert not unpacked(bits)[2 * n:].any()


def test_bad_marks_are_refused_by_name():
    x = torch.randn(40)
    out = torch.zeros(40, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cannot hold bits"):
        cast_into(out, x, "dither", seed=0, step=1, name="w", marks=M.new_bitmap(40), mark_base=30)
    with pytest.raises(TypeError, match="uint8"):
        cast_into(out, x, "dither", seed=0, step=1, name="w", marks=torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="32-bit words"):
        cast_into(out, x, "dither", seed=0, step=1, name="w", marks=torch.zeros(9, dtype=torch.uint8))
    assert not out.view(torch.int16).any()  # nothing written


def test_caster_marks_accumulate_until_cleared_and_find_a_readers_views():
    """A caster over two flat shards, three steps between acknowledgements: the marks are the union of
    what each step changed (against copies kept here; a superset of the net change), a reader's view anywhere in a shard finds its
    bits, a restore marks its whole shard, clear() forgets everything."""
    cfg = FairCastConfig(mode="dither", seed=4)
    caster = ShardCaster(cfg)
    marks = caster.track_changes()
    gen = torch.Generator().manual_seed(8)
    masters = {k: torch.randn(n, generator=gen) * 0.01 for k, n in (("g0", 3000), ("g1", 1001))}
    served = {k: torch.zeros(m.numel(), dtype=torch.bfloat16) for k, m in masters.items()}
    slices = {"g0": [ShardSlice("a", 0, 1000, 0), ShardSlice("b", 17, 2000, 1000)], "g1": [ShardSlice("c", 5, 1001, 0)]}

    def step():
        caster.begin_step()
        for k in masters:
            masters[k] += torch.randn(masters[k].numel(), generator=gen) * 2e-6
            caster.cast_flat(k, masters[k], served[k], slices[k])

    step()
    assert len(marks) == 2 and marks.nbytes == M.bitmap_bytes(3000) + M.bitmap_bytes(1001)
    assert all(marks.count(served[k]) == served[k].numel() for k in served)  # new marks: all set
    marks.clear()
    acked = {k: v.clone() for k, v in served.items()}
    want_all = {k: np.zeros(v.numel(), dtype=bool) for k, v in served.items()}
    for _ in range(3):
        before = {k: v.clone() for k, v in served.items()}
        step()
        for k in served:  # an element that changed and changed back is marked all the same
            want_all[k] |= differ(before[k], served[k])
    for k in served:
        want = want_all[k]
        assert want.any() and not want.all()
        assert not (differ(acked[k], served[k]) & ~want).any()  # every net change is in the union
        assert np.array_equal(marks.mask(served[k]).numpy(), want)
        view = served[k][123:777]  # a reader's slice
        assert np.array_equal(marks.mask(view).numpy(), want[123:777])
        assert marks.count(view) == int(want[123:777].sum())
        assert marks.indices(view).tolist() == np.flatnonzero(want[123:777]).tolist()
    assert not marks.covers(torch.zeros(5, dtype=torch.bfloat16))
    caster.restored("g1", served["g1"], slices["g1"])
    assert marks.count(served["g1"]) == 1001
    marks.clear()
    assert marks.count(served["g0"]) == marks.count(served["g1"]) == 0


@pytest.mark.skipif(not TRITON, reason="Triton is not installed (launch/setup.d/40-triton.sh installs it)")
def test_triton_kernel_marks_in_the_cpu_interpreter(tmp_path):
    """The Triton kernel's marks (32-bit words ORed atomically) in Triton's interpreter, in a subprocess
    (the interpreter is chosen when Triton is imported): two blocks and a partial one, an unaligned first
    bit, runs and a contiguous slice, against the bits before and after."""
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, torch
        from faircast_ds.casting import marks as M, modes
        from faircast_ds.casting.kernels import triton_cast
        from faircast_ds.casting.runs import Runs
        n, base = 2 * triton_cast.BLOCK + 333, 45
        g = torch.Generator().manual_seed(3)
        checked = 0
        for mode in ("nearest", "dither", "error_feedback"):
            for runs in (None, Runs.of([0, 9000], [100, n - 100])):
                x = torch.randn(n, generator=g) * 0.01
                out = x.to(torch.bfloat16)
                x = x + torch.randn(n, generator=g) * 3e-5
                before = out.clone()
                bits = M.new_bitmap(base + n + 64, fill=False)
                M.set_range(bits, 1, 2)
                res = torch.zeros(n) if mode == "error_feedback" else None
                key = modes.noise_key(mode, seed=1, step=2, name="w")
                changed, _ = triton_cast.cast_into(out, x, mode, key=key, start=3, residual=res,
                                                   runs=runs if mode == "dither" else None, marks=bits, mark_base=base)
                want = np.zeros(bits.numel() * 8, dtype=bool)
                want[1:3] = True
                d = before.view(torch.int16).numpy() != out.view(torch.int16).numpy()
                want[base:base + n] |= d
                got = np.unpackbits(bits.numpy(), bitorder="little").astype(bool)
                assert 0 < changed == int(d.sum()) < n, (mode, changed)
                assert np.array_equal(got, want), (mode, runs is not None, np.nonzero(got != want)[0][:5])
                checked += 1
        print(f"ok: {checked} marked casts")
    """))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "ok: 6 marked casts" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_every_vector_width_of_the_cpu_kernel_marks_alike():
    """The AVX-512 (native here), AVX2 and portable builds each compute the changed lanes their own way
    (a mask compare; compare, narrow and movemask; a loop): each against the bits."""
    from test_kernels import narrower_builds_here

    from faircast_ds.casting import modes
    from faircast_ds.casting.kernels import cpu

    if not cpu.available():
        pytest.skip(f"fused CPU kernel unavailable: {cpu.unavailable_reason()}")
    builds = ["native", *narrower_builds_here()[0]]
    gen = torch.Generator().manual_seed(6)
    for build in builds:
        for mode in ("nearest", "dither", "error_feedback"):
            n, base = 50_003, 29
            x = torch.randn(n, generator=gen) * 0.01
            out = x.to(torch.bfloat16)
            x = x + torch.randn(n, generator=gen) * 3e-5
            before = out.clone()
            bits = M.new_bitmap(base + n + 10, fill=False)
            residual = torch.zeros(n) if mode == "error_feedback" else None
            changed, _ = cpu.cast_into(out, x, mode, key=modes.noise_key(mode, seed=1, step=1, name="w"), start=0,
                                       residual=residual, arch=build, marks=bits, mark_base=base)
            want = np.zeros(bits.numel() * 8, dtype=bool)
            want[base:base + n] = differ(before, out)
            assert 0 < changed < n
            assert np.array_equal(unpacked(bits), want), (build, mode)
