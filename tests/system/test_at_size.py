"""Defects that only a real model size exposes (issue 23), each checked at or near that size without
a model: memory that must be bounded by a chunk or a sample rather than by the shard, on a slice as
large as Qwen3-0.6B's 151,936 x 1,024 embedding half (one rank of two).

Peak memory is read in a fresh interpreter (``ru_maxrss`` after the inputs are made, against the
peak before the call), so torch's own allocations count, which tracemalloc does not see."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT, cpu_env

MIB = 1 << 20
EMBEDDING_HALF = 151_936 * 1024 // 2  # elements of the tied embedding on one of two ranks


def _peak_growth(setup: str, call: str) -> dict:
    """Run ``setup`` then ``call`` in a fresh interpreter; return the peak RSS growth the call caused
    (bytes) and what ``call`` left in ``result`` (JSON-able)."""
    script = textwrap.dedent(f"""
        import json, resource, torch
        torch.set_num_threads(1)
        {setup}
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        {call}
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({{"growth": (after - before) * 1024, "result": result}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=cpu_env(), cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the diagnostics' sample selection

def _independent_hash(i: int, salt: int) -> int:
    """mix32((i mod 2^32) ^ salt), written from the specification in faircast_ds/casting/noise.py's docstring."""
    x = (i & 0xFFFFFFFF) ^ salt
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


def _fnv1a(name: str) -> int:
    h = 0x811C9DC5
    for byte in name.encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h


@pytest.mark.parametrize("chunk", [7, 64, 1 << 18])
def test_sample_selection_is_the_documented_hash_whatever_the_chunk(chunk):
    from faircast_ds.shard.caster import ShardSlice
    from faircast_ds.shard.diagnostics import _SAMPLE_SALT, sampled_indices

    part = ShardSlice("model.layers.0.mlp.up_proj.weight", 1_000, 3_001, 40)
    threshold = 1 << 30  # about a quarter of the elements
    got = sampled_indices(part, threshold, chunk=chunk).tolist()
    salt = _fnv1a(part.name) ^ _SAMPLE_SALT
    want = [j for j in range(part.numel) if _independent_hash(part.start + j, salt) < threshold]
    assert got == want and 600 < len(want) < 900


def test_sample_selection_memory_is_bounded_by_the_chunk_not_the_slice():
    # the whole-slice hash made int64 temporaries of ~20 bytes per element: ~780 MB here
    out = _peak_growth(
        "from faircast_ds.shard.diagnostics import Diagnostics\n"
        "        from faircast_ds.config.section import DiagnosticsConfig\n"
        "        from faircast_ds.shard.caster import ShardSlice\n"
        f"        d = Diagnostics(DiagnosticsConfig(), model_numel={2 * EMBEDDING_HALF})\n"
        f"        part = ShardSlice('model.embed_tokens.weight', {EMBEDDING_HALF}, {EMBEDDING_HALF}, 0)",
        "result = int(d._sample_positions([part]).numel())")
    assert 6_000 < out["result"] < 10_000  # half the model: about half the default 16,384 sample
    assert out["growth"] < 48 * MIB, f"sample selection grew the peak by {out['growth'] / MIB:.0f} MiB"


def test_diagnostics_report_memory_is_bounded_by_the_chunk_not_the_shard():
    # the gap over the whole flat group made fp32 and int64 temporaries of ~30 bytes per element
    out = _peak_growth(
        "from faircast_ds.shard.diagnostics import Diagnostics\n"
        "        from faircast_ds.config.section import DiagnosticsConfig\n"
        "        from faircast_ds.shard.caster import CastStats, ShardSlice\n"
        f"        n = {EMBEDDING_HALF // 4}\n"
        "        master = torch.randn(n) * 0.02\n"
        "        served = master.to(torch.bfloat16)\n"
        "        slices = [ShardSlice('w', 0, n - 5, 0), ShardSlice(None, 0, 5, n - 5)]\n"
        "        d = Diagnostics(DiagnosticsConfig(), model_numel=n)\n"
        "        d.on_cast('g', master, served, slices, 1)",
        "report = d.compute([('g', master, served, slices)], CastStats(step=1, numel=n, changed=0), 1)\n"
        "        result = report['gap_spacings']")
    assert 0.05 < out["result"] < 0.5  # round-to-nearest's mean |error| is a quarter spacing
    assert out["growth"] < 48 * MIB, f"the report grew the peak by {out['growth'] / MIB:.0f} MiB"


def test_in_place_mix32_matches_the_allocating_one():
    import torch

    from faircast_ds.casting.noise import MASK32, mix32, mix32_

    x = torch.randint(0, 1 << 32, (10_000,), dtype=torch.int64, generator=torch.Generator().manual_seed(5))
    x[:3] = torch.tensor([0, MASK32, 1 << 31])
    want = mix32(x.clone())
    got = x.clone()
    assert mix32_(got, torch.empty_like(got)) is not None
    assert torch.equal(got, want)
    assert [_independent_hash(int(v), 0) for v in x[:50]] == got[:50].tolist()


# ---------------------------------------------------------------- error feedback's checkpoint state

_ONE_GROUP_ADAPTER = """
        from faircast_ds.shard.adapter import Adapter
        from faircast_ds.config.section import FairCastConfig
        from faircast_ds.shard.caster import ShardCaster, ShardSlice
        n = {n}
        class OneGroup(Adapter):
            def install(self): pass
            def publish(self): pass
            def flat_groups(self):
                yield 'g', self.master, self.served, self.slices
        caster = ShardCaster(FairCastConfig(mode='error_feedback', seed=3))
        a = OneGroup(optimizer=None, caster=caster, names={{}})
        a.master = torch.randn(n) * 0.02
        a.served = torch.empty(n, dtype=torch.bfloat16)
        a.slices = [ShardSlice('model.embed_tokens.weight', 0, n - 3, 0), ShardSlice(None, 0, 3, n - 3)]
        caster.begin_step()
        caster.cast_flat('g', a.master, a.served, a.slices)
        import tempfile
        from faircast_ds.shard.state import save_state
        tag = tempfile.mkdtemp()
"""


def test_error_feedback_save_holds_the_payload_and_little_more():
    # the payload is the residual (4 bytes) and the served bits (one neighbour bit per element, format
    # faircast-ds/3; 2 bytes in /2, 4 in /1); the save made int64 bits, per-slice copies joined at the end and
    # a bytes copy per CRC on top (~2x the payload) before issue 23
    n = 20_000_000
    out = _peak_growth(_ONE_GROUP_ADAPTER.format(n=n),
                       "path = save_state(a, caster, tag, rank=0, world=1)\n"
                       "        import os; result = os.path.getsize(path)")
    payload = 4 * (n - 3) + (n - 3 + 7) // 8
    assert payload < out["result"] < payload + MIB
    assert out["growth"] < payload + 48 * MIB, f"the save grew the peak by {out['growth'] / MIB:.0f} MiB"


def test_error_feedback_state_round_trips_after_the_in_place_save(tmp_path):
    import torch

    from faircast_ds.casting.bits import bf16_bits
    from faircast_ds.config.section import FairCastConfig
    from faircast_ds.shard.adapter import Adapter
    from faircast_ds.shard.caster import ShardCaster, ShardSlice
    from faircast_ds.shard.state import restore_state, save_state

    class OneGroup(Adapter):
        def install(self): pass
        def publish(self): pass
        def flat_groups(self):
            yield "g", self.master, self.served, self.slices

    def make():
        a = OneGroup(optimizer=None, caster=ShardCaster(FairCastConfig(mode="error_feedback", seed=3)), names={})
        a.master = torch.linspace(-0.05, 0.05, 1000)
        a.served = torch.full((1000,), 7.0, dtype=torch.bfloat16)
        a.slices = [ShardSlice("w", 5, 600, 0), ShardSlice(None, 0, 10, 600), ShardSlice("v", 0, 390, 610)]
        return a

    a = make()
    for _ in range(3):
        a.caster.begin_step()
        a.caster.cast_flat("g", a.master, a.served, a.slices)
        a.master += 1e-4
    save_state(a, a.caster, str(tmp_path), rank=0, world=1)
    b = make()
    b.master = a.master.clone()  # a load restores the fp32 masters before Fair Cast's state
    assert restore_state(b, b.caster, str(tmp_path)) == 3
    keep = torch.ones(1000, dtype=torch.bool)
    keep[600:610] = False  # padding is not state
    assert torch.equal(bf16_bits(b.served)[keep], bf16_bits(a.served)[keep])
    assert torch.equal(b.caster.residuals["g"][keep].view(torch.int32), a.caster.residuals["g"][keep].view(torch.int32))


# ---------------------------------------------------------------- the guard's full check

def test_the_guards_full_check_holds_digests_not_a_copy_of_the_shard():
    # the full record was an int16 copy of the shard (2 bytes per element: 148 MiB here) held from the
    # step's start to its check, plus a bool per element to compare: the first step's peak grew with it
    out = _peak_growth(
        "from types import SimpleNamespace\n"
        "        from faircast_ds.shard.guard import Guard\n"
        "        from faircast_ds.shard.caster import ShardSlice\n"
        f"        n = {EMBEDDING_HALF}\n"
        "        served = torch.randint(-2**15, 2**15, (n,), dtype=torch.int16).view(torch.bfloat16)\n"
        "        slices = [ShardSlice('model.embed_tokens.weight', 0, n, 0)]\n"
        "        class Stand:\n"
        "            caster = SimpleNamespace(observers=[], step=0)\n"
        "            def flat_groups(self):\n"
        "                yield 0, None, served, slices\n"
        "            def served_views(self, key):\n"
        "                yield slices[0], served\n"
        "        g = Guard(Stand(), describe_sites='the stand-in')",
        "g.prepare(full=True)\n"
        "        g.record(0, served, slices)\n"
        "        clean = g.local_problem('step 1')\n"
        "        served.view(torch.int16)[n // 2] += 1\n"
        "        result = [clean, g.local_problem('step 1')]")
    clean, caught = out["result"]
    assert clean is None and "1 of 18992 checked blocks" in caught and "elements 38895616..38899711" in caught
    assert out["growth"] < 48 * MIB, f"the full check grew the peak by {out['growth'] / MIB:.0f} MiB"
