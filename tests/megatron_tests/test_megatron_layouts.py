"""Fair Cast under Megatron-Core tensor and pipeline parallelism (faircast_ds/megatron/layout.py): the noise
of an element is keyed by the full, unsplit parameter's name (global layer number) and the element's index
in it, so every layout serves the same bits.

Unit tests check the index map against ``torch.chunk``/``torch.cat`` and the naming against hand-built
modules. With megatron-core installed, tests/dist/megatron_layout_worker.py runs a GPT model (fused GQA QKV,
SwiGLU, biases) on CPU ranks over gloo in two launches: 2 ranks, on the hook route, for (TP1, PP1, DP2),
(TP2, PP1, DP1), (TP1, PP2, DP1) and (TP1, PP2 with 2 virtual stages, DP1); 4 ranks, on the runtime route, for (TP2, PP1, DP2) and (TP2, PP2, DP1), the expert-parallel refusal, and a
checkpoint saved on (TP2, PP1, DP2) and resumed on (TP1, PP2, DP2).
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from conftest import DIST, ROOT, cpu_env, free_port, run_logged
from test_megatron import needs_megatron, patched_megatron  # noqa: F401  (the patched copy: a fixture)

from faircast_ds.casting.reference import cast_reference
from faircast_ds.config.section import FairCastConfig
from faircast_ds.megatron.layout import TensorSplit, global_names
from faircast_ds.shard.caster import ShardCaster

MODES = ["nearest", "stochastic", "dither", "error_feedback"]
SPLITS = [((8, 6), 0, 1, 2), ((8, 6), 1, 1, 2), ((8, 6), 0, 2, 2), ((16, 4), 0, 2, 4), ((2, 6, 4), 1, 1, 2),
          ((16,), 0, 1, 4), ((8, 4), 1, 2, 2)]


def local_of(full: torch.Tensor, dim: int, stride: int, size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s slice as Megatron's CPU initialization cuts a master weight: ``stride * size`` chunks
    along ``dim``, rank ``r`` takes chunks ``r, r + size, ...``."""
    return torch.cat(torch.chunk(full, stride * size, dim)[rank::size], dim)


@pytest.mark.parametrize("shape,dim,stride,size", SPLITS)
def test_tensor_split_maps_every_local_range_to_its_full_indices(shape, dim, stride, size):
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    for rank in range(size):
        local = local_of(full, dim, stride, size, rank)
        split = TensorSplit(tuple(local.shape), dim, stride, size, rank)
        assert split.full_shape == tuple(shape)
        flat = local.reshape(-1)
        for a in range(flat.numel()):
            for b in range(a + 1, flat.numel() + 1):
                got = torch.full((b - a,), -1, dtype=torch.int64)
                for s in split.slices("w", a, b - a):
                    got[s.offset:s.offset + s.numel] = s.indices()
                assert torch.equal(got, flat[a:b]), (rank, a, b)


def test_long_row_parallel_runs_are_plain_slices_for_the_fused_kernel():
    """A real model's row-parallel rows (>= MIN_KERNEL_RUN elements) stay plain slices, one kernel call each;
    short rows become one slice with index runs. Either way the indices are the full parameter's."""
    from faircast_ds.megatron.layout import MIN_KERNEL_RUN

    for cols, indexed in ((2 * MIN_KERNEL_RUN, False), (2 * MIN_KERNEL_RUN - 2, True)):
        full = torch.arange(6 * cols).reshape(6, cols)
        local = local_of(full, 1, 1, 2, 1).reshape(-1)
        split = TensorSplit((6, cols // 2), 1, 1, 2, 1)
        for a, b in ((0, local.numel()), (5, local.numel() - 7), (cols // 2 - 1, cols // 2 + 1)):
            slices = split.slices("w", a, b - a)
            assert any(s.runs is not None for s in slices) == (indexed and b - a > cols), (cols, a, b)
            got = torch.cat([s.indices() for s in sorted(slices, key=lambda s: s.offset)])
            assert torch.equal(got, local[a:b]), (cols, a, b)


def test_tensor_split_refuses_what_it_cannot_map():
    with pytest.raises(ValueError, match="partition_stride"):
        TensorSplit((6, 4), 0, 4, 2, 0)
    with pytest.raises(ValueError, match="partition_dim"):
        TensorSplit((6, 4), 2, 1, 2, 0)


@pytest.mark.parametrize("mode", ["stochastic", "dither", "nearest"])
def test_tp_slices_cast_as_the_full_parameter(mode):
    """Each rank's DP-cut pieces of its TP slice, cast by the caster (plain runs and index runs), put back
    with torch.cat: the reference cast of the full parameter."""
    torch.manual_seed(3)
    full = torch.randn(8, 12) * 3
    want = cast_reference(full.reshape(-1), mode, seed=5, step=2, name="w").view(torch.int16).reshape(8, 12)
    for dim, stride in ((0, 1), (1, 1), (0, 2)):
        served = []
        kinds = set()
        for rank in range(2):
            local = local_of(full, dim, stride, 2, rank).reshape(-1)
            split = TensorSplit(tuple(local_of(full, dim, stride, 2, rank).shape), dim, stride, 2, rank)
            out = torch.zeros(local.numel(), dtype=torch.bfloat16)
            caster = ShardCaster(FairCastConfig(mode=mode, seed=5))
            caster.step = 1
            caster.begin_step()
            for a, b in ((0, 17), (17, 48)):  # two data-parallel pieces, one cut inside a row
                slices = split.slices("w", a, b - a)
                kinds |= {s.runs is not None for s in slices}
                caster.cast_flat(("w", a), local[a:b], out[a:b], slices)
            served.append(out.view(torch.int16).reshape(local_of(full, dim, stride, 2, rank).shape))
        if stride == 2:  # [gate_r; up_r] back to [gate; up]
            halves = [torch.chunk(p, 2, 0) for p in served]
            whole = torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
        else:
            whole = torch.cat(served, dim)
        assert torch.equal(whole, want), (mode, dim, stride)
        if dim == 1:
            assert True in kinds  # the row-parallel cut takes the index-runs path


class _Layer(torch.nn.Module):
    def __init__(self, number: int) -> None:
        super().__init__()
        self.layer_number = number  # Megatron's TransformerLayer: global, 1-based
        self.mlp = torch.nn.Linear(2, 2)


class _Stage(torch.nn.Module):
    def __init__(self, offset: int, last: bool) -> None:
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([_Layer(offset + i + 1) for i in range(2)])
        if last:
            self.output_layer = torch.nn.Linear(2, 3, bias=False)
            self.output_layer.weight.shared_embedding = True  # a last stage's copy of tied embeddings


def test_global_names_number_layers_globally_and_name_the_tied_copy():
    wrapped = torch.nn.Module()
    wrapped.module = _Stage(offset=2, last=True)  # stage 1 of 2, behind a wrapper
    names = set(global_names([wrapped]).values())
    assert names == {"decoder.layers.2.mlp.weight", "decoder.layers.2.mlp.bias", "decoder.layers.3.mlp.weight",
                     "decoder.layers.3.mlp.bias", "embedding.word_embeddings.weight"}
    assert "decoder.layers.0.mlp.weight" in global_names([_Stage(offset=0, last=False)]).values()
    with pytest.raises(ValueError, match="one full parameter"):
        global_names([_Stage(0, False), _Stage(0, False)])


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, patched_megatron):  # noqa: F811 (the fixture imported above)
    """Two launches of tests/dist/megatron_layout_worker.py: 2 ranks (4 layouts) on the hook route (a copy of
    Megatron-Core with patches/megatron-core-0.16.1-fair-cast.patch first on the path), 4 ranks (2 layouts,
    the refusal, the checkpoint) on the runtime route."""
    runs = {}
    hook_path = os.pathsep.join([str(patched_megatron), str(ROOT)])
    for ranks, layouts, extra in ((2, "1,1;2,1;1,2;1,2,2", {"ROUTE": "hook", "PYTHONPATH": hook_path}),
                                  (4, "2,1;2,2", {"EXPERT_CHECK": "1", "CHECKPOINT_LAYOUTS": "2,1>1,2"})):
        out = tmp_path_factory.mktemp(f"megatron_layouts_{ranks}")
        env = cpu_env(OUT_DIR=str(out), LAYOUTS=layouts, STEPS="2", **extra)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(free_port()), str(DIST / "megatron_layout_worker.py")]
        run_logged(cmd, out / "launch.log", env=env, timeout=900)
        runs[ranks] = out
    return runs


def _reports(layout_runs) -> dict:
    out = {}
    for run in layout_runs.values():
        for report in json.loads((run / "layouts.json").read_text())["layouts"]:
            out[report["layout"]] = report
    return out


def _bits(layout_runs, label: str) -> dict:
    for run in layout_runs.values():
        path = run / f"bits_{label}.pt"
        if path.exists():
            return torch.load(path)
    raise AssertionError(f"no bits for layout {label}")


LAYOUTS = ["1x1x2", "2x1x1", "1x2x1", "1x2x1v2", "2x1x2", "2x2x1"]  # v2: virtual pipeline, 2 chunks per rank
HOOK_LAYOUTS = LAYOUTS[:4]  # the 2-rank launch runs on the hook route: both routes serve the same bits


@needs_megatron
@pytest.mark.slow
def test_every_layout_serves_the_reference_cast_of_the_full_masters(layout_runs):
    """Per layout and mode: the full parameters reassembled (torch.cat) from every rank's served slices are
    cast_reference of the full masters, keyed by the full name; after one real training step (Megatron's
    schedule, pipelined under PP, and its optimizer step) too, against the masters that step produced."""
    reports = _reports(layout_runs)
    assert sorted(reports) == sorted(LAYOUTS)
    for label, report in reports.items():
        for mode in MODES:
            case = report["modes"][mode]
            assert case["equal_reference"], (label, mode, case["mismatches"])
            assert case["train_step_ok"] and case["masters_moved"] > 10000, (label, mode)
            assert case["after_train_equal_reference"], (label, mode, case["mismatches"])
            assert case["caster_step"] == 3
            assert case["route"] == ("megatron-hook" if label in HOOK_LAYOUTS else "megatron-runtime"), (label, case)
            assert len(case["names"]) == 53  # every parameter of the model, under its full name
        if label.startswith("2x"):  # row-parallel slices take the index-runs path, the rest plain runs
            for rank in report["slices_per_rank"]:
                assert rank["stochastic"]["indexed_slices"] > 0 and rank["stochastic"]["plain_slices"] > 0


@needs_megatron
@pytest.mark.slow
def test_layouts_serve_identical_bits(layout_runs):
    base = _bits(layout_runs, "1x1x2")
    for label in LAYOUTS[1:]:
        other = _bits(layout_runs, label)
        for mode in MODES:
            for step, (a, b) in enumerate(zip(base[mode], other[mode]), start=1):
                assert a.keys() == b.keys(), (label, mode)
                for name in a:
                    assert torch.equal(a[name], b[name]), f"{label} {mode} step {step}: {name}"
    # the comparison can fail: stochastic and round-to-nearest differ somewhere
    assert any(not torch.equal(base["stochastic"][0][n], base["nearest"][0][n]) for n in base["nearest"][0])


@needs_megatron
@pytest.mark.slow
def test_expert_parallel_is_refused_naming_what_is_missing(layout_runs):
    refusal = json.loads((layout_runs[4] / "layouts.json").read_text())["expert_parallel_refusal"]
    assert "expert_model_parallel_size 2" in refusal and "global expert ids" in refusal


@needs_megatron
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stochastic", "error_feedback"])
def test_checkpoint_saved_on_one_layout_resumes_bitwise_on_another(layout_runs, mode):
    """dist_checkpointing saved on (TP2, PP1, DP2) and loaded on (TP1, PP2, DP2) (Megatron reshards the model and
    the fully_reshardable optimizer; Fair Cast's entry with the model's sharded state dict puts the residual in
    the model's space): every full parameter's served bits, fp32 master and residual as saved, and the next
    refresh serves what the run that never stopped served (error feedback: through the restored residual)."""
    case = json.loads((layout_runs[4] / "layouts.json").read_text())["checkpoint"][mode]
    assert case["restored_differs"] == [] and case["resumed_differs"] == [], case
    assert case["step_changed"] > 1000 and case["caster_step"] == 4  # the resumed refresh served new bits
    if mode == "error_feedback":
        assert case["residual_nonzero"] > 10000, case  # the comparison covers a real residual
