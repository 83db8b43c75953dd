"""faircast_ds.shard.caster in process: slices and padding, the cast of a flat shard, its counts, residuals,
non-finite handling, the cross-device branch and the observer hook. No DeepSpeed, no launch."""
from __future__ import annotations

import pytest
import torch

from faircast_ds.casting.reference import cast_reference
from faircast_ds.casting.bits import bf16_bits, fp32_bits
from faircast_ds.casting.modes import MODES
from faircast_ds.casting.rules import cast
from faircast_ds.config.section import FairCastConfig
from faircast_ds.shard import caster as shard_caster
from faircast_ds.shard.caster import CastStats, NonFiniteWeightError, ShardCaster, ShardSlice, with_padding

SEED = 1234
TOTAL = 100
# two parameters in one flat shard, with alignment padding before, between and after them; the first
# starts inside its parameter (element 5), as a ZeRO partition that cuts across parameters does
PARAMS = [ShardSlice("blocks.0.w", 5, 40, 3), ShardSlice("blocks.1.b", 0, 50, 47)]


def caster(mode: str, **kw) -> ShardCaster:
    return ShardCaster(FairCastConfig(mode=mode, seed=SEED, **kw))


def values(n: int, seed: int) -> torch.Tensor:
    """fp32 weights off the bf16 grid, so the modes disagree with round-to-nearest and each other."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.05


def counts(stats: CastStats) -> tuple[int, int, int]:
    return stats.step, stats.numel, stats.changed


def param_mask(slices) -> torch.Tensor:
    mask = torch.zeros(TOTAL, dtype=torch.bool)
    for s in slices:
        if not s.is_padding:
            mask[s.offset:s.offset + s.numel] = True
    return mask


def expected(master: torch.Tensor, slices, mode: str, step: int, residual: torch.Tensor | None = None) -> torch.Tensor:
    """What the served flat shard must hold: the reference cast (faircast_ds.casting.reference: its own statement
    of the noise and of each mode's rounding, no product code) of every parameter slice at its own
    (name, start), DeepSpeed's round-to-nearest copy on padding. ``residual`` (flat, error feedback) is
    updated."""
    out = master.to(torch.bfloat16)
    for s in slices:
        if s.is_padding:
            continue
        res = residual.narrow(0, s.offset, s.numel) if residual is not None else None
        out[s.offset:s.offset + s.numel] = cast_reference(master[s.offset:s.offset + s.numel], mode, seed=SEED,
                                                          step=step, name=s.name, start=s.start, residual=res)
    return out


def assert_served_as(served: torch.Tensor, want: torch.Tensor, mode: str) -> None:
    """Bit for bit, except where ``nearest`` serves a NaN: its bits are left open (casts.py: torch's NaN
    for the device; torch's own conversion gives 0x7fc0 or 0xffff on the CPU by path), so NaN for NaN."""
    got, exp = bf16_bits(served), bf16_bits(want)
    if mode == "nearest":
        nan = torch.isnan(want.float())
        assert torch.equal(torch.isnan(served.float()), nan)
        got, exp = got[~nan], exp[~nan]
    assert torch.equal(got, exp)


# ---- with_padding ---------------------------------------------------------------------------------

def test_with_padding_fills_every_gap_in_offset_order():
    a, b = ShardSlice("a", 3, 4, 2), ShardSlice("b", 0, 5, 12)
    got = with_padding([b, a], 20)  # given out of order
    assert got == [ShardSlice(None, 0, 2, 0), a, ShardSlice(None, 0, 6, 6), b, ShardSlice(None, 0, 3, 17)]
    assert [s.is_padding for s in got] == [True, False, True, False, True]
    # contiguous and exactly covering the shard
    assert all(x.offset + x.numel == y.offset for x, y in zip(got, got[1:]))
    assert got[0].offset == 0 and got[-1].offset + got[-1].numel == 20


def test_with_padding_adds_nothing_where_there_is_no_gap():
    a, b = ShardSlice("a", 0, 4, 0), ShardSlice("b", 9, 6, 4)
    assert with_padding([a, b], 10) == [a, b]
    assert with_padding([], 3) == [ShardSlice(None, 0, 3, 0)]


def test_with_padding_refuses_overlaps_and_overruns():
    with pytest.raises(ValueError, match="overlapping shard slices at offset 3"):
        with_padding([ShardSlice("a", 0, 4, 0), ShardSlice("b", 0, 4, 3)], 10)
    with pytest.raises(ValueError, match="overlapping"):
        with_padding([ShardSlice("a", 0, 4, 2), ShardSlice("b", 0, 1, 2)], 10)  # same offset
    with pytest.raises(ValueError, match="end at 11, past the flat shard's 10 elements"):
        with_padding([ShardSlice("a", 0, 4, 0), ShardSlice("b", 0, 5, 6)], 10)


# ---- cast_flat ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_parameter_slices_get_the_cast_padding_keeps_deepspeeds_copy(mode):
    slices = with_padding(PARAMS, TOTAL)
    assert [s.is_padding for s in slices] == [True, False, True, False, True]
    c = caster(mode)
    c.begin_step()
    c.begin_step()  # step 2: the noise step is the caster's, not a constant
    master = values(TOTAL, 0)
    old = values(TOTAL, 1).to(torch.bfloat16)  # the previous step's served bits
    served = old.clone()
    residual = None
    if mode == "error_feedback":  # a carried residual of about a spacing, so the result is not round-to-nearest
        residual = values(TOTAL, 2) * 0.01
        c.residuals["g0"] = residual.clone()
    c.cast_flat("g0", master, served, slices)
    want = expected(master, slices, mode, step=2, residual=residual)
    if residual is not None:
        assert torch.equal(fp32_bits(c.residuals["g0"]), fp32_bits(residual))
    assert torch.equal(bf16_bits(served), bf16_bits(want))
    pad = ~param_mask(slices)
    assert torch.equal(bf16_bits(served[pad]), bf16_bits(master[pad].to(torch.bfloat16)))  # a plain copy_
    if mode != "nearest":
        # the parameter bits really are the mode's own (not a copy_), and keyed by (name, start), not by offset
        p = PARAMS[1]
        x = master[p.offset:p.offset + p.numel]
        assert not torch.equal(bf16_bits(served[p.offset:p.offset + p.numel]), bf16_bits(x.to(torch.bfloat16)))
        if mode != "error_feedback":
            shifted = cast(x, mode, seed=SEED, step=2, name=p.name, start=p.offset)
            assert not torch.equal(bf16_bits(served[p.offset:p.offset + p.numel]), bf16_bits(shifted))
    # counts: parameter elements only, against what the served buffer held before
    mask = param_mask(slices)
    assert counts(c.last) == (2, int(mask.sum()), int((bf16_bits(old)[mask] != bf16_bits(want)[mask]).sum()))
    assert c.last.changed > 0


@pytest.mark.parametrize("mode", MODES)
def test_changes_counted_against_previous_which_is_updated(mode):
    """Optimizers that overwrite the served shard by round-to-nearest first: the change is counted
    against ``previous`` (the last served bits), which then holds the new bits, as does ``served``."""
    slices = with_padding(PARAMS, TOTAL)
    c = caster(mode)
    c.begin_step()
    master = values(TOTAL, 2)
    served = master.to(torch.bfloat16)  # what the optimizer's own copy_ left there
    prev_old = values(TOTAL, 3).to(torch.bfloat16)
    previous = prev_old.clone()
    c.cast_flat("g0", master, served, slices, previous=previous)
    want = expected(master, slices, mode, step=1, residual=torch.zeros(TOTAL) if mode == "error_feedback" else None)
    mask = param_mask(slices)
    assert torch.equal(bf16_bits(served), bf16_bits(want))
    assert torch.equal(bf16_bits(previous[mask]), bf16_bits(want[mask]))
    assert torch.equal(bf16_bits(previous[~mask]), bf16_bits(prev_old[~mask]))  # padding: previous not used
    vs_previous = int((bf16_bits(prev_old)[mask] != bf16_bits(want)[mask]).sum())
    vs_served = int((bf16_bits(master.to(torch.bfloat16))[mask] != bf16_bits(want)[mask]).sum())
    assert c.last.changed == vs_previous
    assert vs_previous != vs_served  # the two baselines are told apart by this data


def test_length_mismatch_is_refused():
    with pytest.raises(ValueError, match="master has 10 elements, served 9"):
        caster("stochastic").cast_flat("k", torch.zeros(10), torch.zeros(9, dtype=torch.bfloat16),
                                       [ShardSlice("w", 0, 9, 0)])


# ---- the cross-device branch ------------------------------------------------------------------------

_DEVICE = torch.Tensor.device


class OnOtherDevice(torch.Tensor):
    """A CPU tensor that reports device ``cpu:0``, which compares unequal to a plain CPU tensor's ``cpu``.

    ``cast_flat`` picks its branch by ``target.device == src.device``; on a CPU-only machine this is the
    only way to make the two differ. Everything else is real: the caster's cross-device code runs on
    real memory (``.to(target.device)`` is a real transfer to the CPU), only the device label differs."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is _DEVICE:  # the ``device`` property
            return torch.device("cpu", 0)
        return super().__torch_function__(func, types, args, kwargs or {})


def plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor)


def fused_only(monkeypatch):
    """Fail if a cast falls back to the eager torch path (the staged route must use the fused kernel), and
    record every ``cast_into`` the caster makes: (output tensor, name)."""
    from faircast_ds.casting import kernels
    from faircast_ds.casting import rules as casts

    if kernels.backend_for(torch.device("cpu")) != "cpp":
        pytest.skip("the fused CPU kernel cannot be built here")
    monkeypatch.setattr(casts, "cast_with", lambda *a, **k: pytest.fail("eager path taken"))
    calls = []
    real = shard_caster.cast_into_with

    def recording(rule, out, x, *a, **k):
        calls.append((out, k["name"]))
        return real(rule, out, x, *a, **k)

    monkeypatch.setattr(shard_caster, "cast_into_with", recording)
    return calls


def two_steps(c, master, served, prev, slices, **cast_kwargs):
    """Steps 1 and 2 of caster ``c`` (the master moved by 1e-3 each) into ``served``, with ``prev`` as the
    previous bits (None: the served shard holds them); the per-step counts."""
    got = []
    for step in (1, 2):
        c.begin_step()
        c.cast_flat("g", master + step * 1e-3, served, slices, previous=prev, **cast_kwargs)
        got.append(counts(c.last))
    return got


def reference_run(mode, master, old, slices, use_previous):
    """Two steps on one device (the direct fused path): served, previous, per-step counts, the caster."""
    same = caster(mode)
    served, prev = old.clone(), old.clone()
    got = two_steps(same, master, served, prev if use_previous else None, slices)
    return served, prev, got, same


@pytest.mark.parametrize("use_previous", (False, True))
@pytest.mark.parametrize("mode", MODES)
def test_cross_device_path_gives_the_same_bits_counts_and_residual(monkeypatch, mode, use_previous):
    """fp32 master on one device, bf16 served on another (e.g. the master offloaded to the CPU): the fused
    kernel casts on the master's device into a staging buffer there, then one copy goes to the served
    device; never the eager path, never a cast into the other device's tensor."""
    slices = with_padding(PARAMS, TOTAL)
    master = values(TOTAL, 4)
    old = values(TOTAL, 5).to(torch.bfloat16)
    served_same, prev_same, same_counts, same = reference_run(mode, master, old, slices, use_previous)
    calls = fused_only(monkeypatch)
    other = caster(mode)
    served_other = old.clone().as_subclass(OnOtherDevice)
    prev_other = old.clone().as_subclass(OnOtherDevice)
    assert served_other.device != master.device
    stats = two_steps(other, master, served_other, prev_other if use_previous else None, slices)
    assert [name for _, name in calls] == [p.name for p in PARAMS] * 2
    assert all(type(out) is torch.Tensor and out.device == master.device for out, _ in calls)
    stage = other.stages["g"]  # the caster's own staging buffer, made once and kept
    assert all(out.untyped_storage().data_ptr() == stage.untyped_storage().data_ptr() for out, _ in calls)
    assert torch.equal(bf16_bits(plain(served_other)), bf16_bits(served_same))
    if use_previous:  # previous: the served bits on every parameter element (its padding is never read)
        mask = param_mask(slices)
        assert torch.equal(bf16_bits(plain(prev_other))[mask], bf16_bits(prev_same)[mask])
    assert stats == same_counts  # per step: step, elements, changed
    assert same.last.changed > 0
    if mode == "error_feedback":
        assert torch.equal(fp32_bits(other.residuals["g"]), fp32_bits(same.residuals["g"]))
        assert bool(same.residuals["g"].ne(0).any())


@pytest.mark.parametrize("use_previous", (False, True))
@pytest.mark.parametrize("mode", MODES)
def test_forced_staging_route_on_one_device(monkeypatch, mode, use_previous):
    """``FAIRCAST_DS_STAGING=always`` takes the staging route on the CPU alone (how CI tests it): the same
    bits, counts and residual as the direct path, the cast written into the caster's staging buffer."""
    slices = with_padding(PARAMS, TOTAL)
    master = values(TOTAL, 8)
    old = values(TOTAL, 9).to(torch.bfloat16)
    served_same, prev_same, same_counts, same = reference_run(mode, master, old, slices, use_previous)
    calls = fused_only(monkeypatch)
    monkeypatch.setenv(shard_caster.STAGING_ENV, "always")
    forced = caster(mode)
    assert forced.force_staging
    served, prev = old.clone(), old.clone()
    stats = two_steps(forced, master, served, prev if use_previous else None, slices)
    stage = forced.stages["g"]
    assert stage.data_ptr() not in (served.data_ptr(), prev.data_ptr())
    assert all(out.untyped_storage().data_ptr() == stage.untyped_storage().data_ptr() for out, _ in calls)
    assert torch.equal(bf16_bits(served), bf16_bits(served_same)) and stats == same_counts
    assert torch.equal(bf16_bits(stage), bf16_bits(served))  # what went to the served shard, in one copy
    if use_previous:
        mask = param_mask(slices)
        assert torch.equal(bf16_bits(prev)[mask], bf16_bits(prev_same)[mask])
    if mode == "error_feedback":
        assert torch.equal(fp32_bits(forced.residuals["g"]), fp32_bits(same.residuals["g"]))


def test_given_staging_buffer_is_used_and_checked(monkeypatch):
    """An adapter's staging buffer (DeepSpeed's own pinned one for ZeRO-1/2 offload) is written in place of
    the caster's own; a buffer of the wrong dtype, length or device is refused."""
    slices = with_padding(PARAMS, TOTAL)
    master = values(TOTAL, 10)
    served_same, _, same_counts, _ = reference_run("stochastic", master, values(TOTAL, 11).to(torch.bfloat16),
                                                   slices, True)
    calls = fused_only(monkeypatch)
    c = caster("stochastic")
    c.force_staging = True
    theirs = torch.full((TOTAL,), 7.0, dtype=torch.bfloat16)  # DeepSpeed left its round-to-nearest copy here
    served, prev = values(TOTAL, 11).to(torch.bfloat16), values(TOTAL, 11).to(torch.bfloat16)
    stats = two_steps(c, master, served, prev, slices, staging=theirs)
    assert c.stages == {}  # none of its own
    assert all(out.untyped_storage().data_ptr() == theirs.untyped_storage().data_ptr() for out, _ in calls)
    assert torch.equal(bf16_bits(served), bf16_bits(served_same)) and stats == same_counts
    for bad, words in ((torch.zeros(TOTAL), "torch.float32"), (torch.zeros(TOTAL - 1, dtype=torch.bfloat16), "99"),
                       (torch.zeros(TOTAL, dtype=torch.bfloat16, device="meta"), "meta")):
        with pytest.raises(ValueError, match=f"staging buffer must be bf16 with {TOTAL} elements on cpu, got .*{words}"):
            c.cast_flat("g", master, served, slices, staging=bad)


def test_staging_switch_is_validated(monkeypatch):
    monkeypatch.setenv(shard_caster.STAGING_ENV, "sometimes")
    with pytest.raises(ValueError, match="FAIRCAST_DS_STAGING='sometimes'; accepted: auto, always"):
        caster("dither")
    monkeypatch.setenv(shard_caster.STAGING_ENV, "")
    assert not caster("dither").force_staging


def test_cross_device_path_raises_on_nonfinite(monkeypatch):
    slices = with_padding(PARAMS, TOTAL)
    master = values(TOTAL, 6)
    master[3 + 9] = float("inf")  # element 5 + 9 of blocks.0.w
    c = caster("stochastic")
    c.begin_step()
    calls = fused_only(monkeypatch)
    with pytest.raises(NonFiniteWeightError, match=r"'blocks\.0\.w' element 14 would be served as inf"):
        c.cast_flat("g", master, torch.zeros(TOTAL, dtype=torch.bfloat16).as_subclass(OnOtherDevice), slices)
    # raised once the whole flat shard is cast: every slice went through the staged route
    assert [name for _, name in calls] == ["blocks.0.w", "blocks.1.b"]


# ---- non-finite masters ------------------------------------------------------------------------------

# 3.4e38 is finite in fp32 and beyond bf16's range: round-to-nearest (and error feedback, which serves
# round-to-nearest of it with no residual) make it Inf; stochastic and dither may serve bf16's max instead
@pytest.mark.parametrize("mode, bad", [(m, b) for m in MODES for b in (float("nan"), float("-inf"))]
                         + [("nearest", 3.4e38), ("error_feedback", 3.4e38)])
def test_nonfinite_error_names_parameter_and_element(mode, bad):
    slices = with_padding(PARAMS, TOTAL)
    master = values(TOTAL, 7)
    master[47 + 12] = bad  # element 12 of blocks.1.b
    c = caster(mode)
    c.begin_step()
    with pytest.raises(NonFiniteWeightError, match=r"parameter 'blocks\.1\.b' element 12 would be served as") as info:
        c.cast_flat("g", master, torch.zeros(TOTAL, dtype=torch.bfloat16), slices)
    assert "1 non-finite element(s)" in str(info.value)
    assert isinstance(info.value, FloatingPointError)


@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_propagate_serves_it(mode):
    slices = with_padding(PARAMS, TOTAL)
    master = values(TOTAL, 8)
    master[47 + 12] = float("nan")
    master[3 + 1] = float("-inf")
    c = caster(mode, on_nonfinite="propagate")
    c.begin_step()
    served = torch.zeros(TOTAL, dtype=torch.bfloat16)
    c.cast_flat("g", master, served, slices)
    assert torch.isnan(served[59].float()) and served[4].float() == float("-inf")
    assert int((~torch.isfinite(served.float())).sum()) == 2
    want = expected(master, slices, mode, step=1, residual=torch.zeros(TOTAL) if mode == "error_feedback" else None)
    assert_served_as(served, want, mode)


def test_nonfinite_padding_is_not_an_error():
    """Padding belongs to no parameter: DeepSpeed's copy of it is kept, whatever it holds."""
    slices = with_padding(PARAMS, TOTAL)
    master = values(TOTAL, 9)
    master[0] = float("nan")
    master[99] = float("inf")
    c = caster("stochastic")
    c.begin_step()
    served = torch.zeros(TOTAL, dtype=torch.bfloat16)
    c.cast_flat("g", master, served, slices)
    assert torch.isnan(served[0].float()) and served[99].float() == float("inf")


class TwoShards:
    """A rank with two flat shards (an optimizer with two parameter groups): the step's cast of the first
    raises, the second is never reached by it."""

    def __init__(self, c: ShardCaster, bad: bool = True):
        from faircast_ds.shard.adapter import Adapter

        class _Adapter(Adapter):
            zero_stage = 2

            def install(self):
                pass

            def publish(self):
                pass

            def flat_groups(inner):
                yield from ((k, self.masters[k], self.served[k], self.slices[k]) for k in ("a", "b"))

        self.slices = {"a": with_padding(PARAMS, TOTAL), "b": with_padding([ShardSlice("blocks.2.w", 0, 30, 0)], 30)}
        self.masters = {"a": values(TOTAL, 21), "b": values(30, 22)}
        if bad:
            self.masters["a"][3 + 2] = float("nan")  # element 7 of blocks.0.w
        self.served = {k: torch.full((m.numel(),), 9.0).to(torch.bfloat16) for k, m in self.masters.items()}
        self.adapter = _Adapter(optimizer=None, caster=c, names={})


@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_cast_finishes_the_flat_shard_before_raising(mode):
    """Raised once every slice of the flat shard is cast (residual included): never half of one step and
    half of the last in a shard; the caster keeps the error as ``failed`` until the next step."""
    slices = with_padding(PARAMS, TOTAL)
    master = values(TOTAL, 20)
    master[3 + 2] = float("nan")  # in the first slice
    c = caster(mode)
    c.begin_step()
    served = torch.zeros(TOTAL, dtype=torch.bfloat16)
    with pytest.raises(NonFiniteWeightError, match=r"'blocks\.0\.w' element 7 would be served as nan .* at step 1"):
        c.cast_flat("g", master, served, slices)
    residual = torch.zeros(TOTAL) if mode == "error_feedback" else None
    want = expected(master, slices, mode, step=1, residual=residual)
    assert_served_as(served, want, mode)  # the second slice too
    if mode == "error_feedback":
        assert torch.equal(c.residuals["g"].view(torch.int32), residual.view(torch.int32))
    assert isinstance(c.failed, NonFiniteWeightError) and c.cast_keys == {"g"}
    c.begin_step()
    assert c.failed is None and c.cast_keys == set()


@pytest.mark.parametrize("mode", ["stochastic", "error_feedback"])
def test_complete_step_casts_the_shards_a_failed_step_did_not_reach(mode, tmp_path):
    """The step raises in shard "a"; shard "b" still holds the last step's bits until complete_step (which
    save_state calls) casts it at the same step, without raising, so a checkpoint holds one step."""
    from faircast_ds.shard import state as checkpoint

    c = caster(mode)
    rank = TwoShards(c)
    c.begin_step()
    with pytest.raises(NonFiniteWeightError):
        rank.adapter.cast_all()
    assert c.cast_keys == {"a"} and bool((rank.served["b"].float() == 9.0).all())  # not reached
    assert checkpoint.complete_step(rank.adapter, c) is True
    want = expected(rank.masters["b"], rank.slices["b"], mode, step=1,
                    residual=torch.zeros(30) if mode == "error_feedback" else None)
    assert torch.equal(bf16_bits(rank.served["b"]), bf16_bits(want))
    assert c.cast_keys == {"a", "b"} and checkpoint.complete_step(rank.adapter, c) is False  # nothing left
    checkpoint.save_state(rank.adapter, c, str(tmp_path), rank=0, world=1, engine_step=0)
    (_, record), = checkpoint.read_records(str(tmp_path))
    assert record["step"] == 1 and record["engine_step"] == 0
    healthy = TwoShards(caster(mode), bad=False)
    assert checkpoint.complete_step(healthy.adapter, healthy.adapter.caster) is False  # no failed step: no-op


def test_unchecked_casts_note_nonfinite_weights_instead_of_raising():
    """What a checkpoint load uses to reproduce a served copy saved after a failed step."""
    slices = with_padding(PARAMS, TOTAL)
    master = values(TOTAL, 23)
    master[47 + 1] = float("inf")
    c = caster("dither")
    with c.unchecked():
        c.cast_flat("g", master, torch.zeros(TOTAL, dtype=torch.bfloat16), slices)
    assert isinstance(c.suppressed, NonFiniteWeightError) and "'blocks.1.b' element 1" in str(c.suppressed)
    assert c.failed is None and c.checking
    with pytest.raises(NonFiniteWeightError):  # checked again afterwards
        c.cast_flat("g", master, torch.zeros(TOTAL, dtype=torch.bfloat16), slices)


# ---- error feedback, steps, observer --------------------------------------------------------------

def test_error_feedback_residual_per_key_kept_between_steps():
    c = caster("error_feedback")
    slices_a = with_padding(PARAMS, TOTAL)
    slices_b = with_padding([ShardSlice("blocks.2.w", 100, 30, 0)], 32)
    masters = {"a": values(TOTAL, 10), "b": values(32, 11)}
    served = {"a": torch.zeros(TOTAL, dtype=torch.bfloat16), "b": torch.zeros(32, dtype=torch.bfloat16)}
    layout = {"a": slices_a, "b": slices_b}
    mine = {k: torch.zeros(m.numel()) for k, m in masters.items()}  # the residual as the definition evolves it
    first = {}
    for step in (1, 2, 3):
        c.begin_step()
        for k in ("a", "b"):
            masters[k] += 3e-4  # a small update: the residual carries what the cast leaves behind
            c.cast_flat(k, masters[k], served[k], layout[k])
            want = expected(masters[k], layout[k], "error_feedback", step, residual=mine[k])
            assert torch.equal(bf16_bits(served[k]), bf16_bits(want)), (k, step)
            assert torch.equal(fp32_bits(c.residuals[k]), fp32_bits(mine[k])), (k, step)
            first.setdefault(k, c.residuals[k])
    assert set(c.residuals) == {"a", "b"}
    assert c.residuals["a"].shape == (TOTAL,) and c.residuals["b"].shape == (32,)
    assert all(c.residuals[k] is first[k] for k in first)  # one tensor per key, kept, updated in place
    assert c.residuals["a"].dtype == torch.float32 and bool(c.residuals["a"].ne(0).any())
    assert bool((c.residuals["a"][~param_mask(slices_a)] == 0).all())  # padding carries no residual
    # a residual that was not carried would serve something else at step 3
    fresh = expected(masters["a"], slices_a, "error_feedback", 3, residual=torch.zeros(TOTAL))
    assert not torch.equal(bf16_bits(served["a"]), bf16_bits(fresh))


@pytest.mark.parametrize("mode", ("nearest", "stochastic", "dither"))
def test_other_modes_keep_no_residual(mode):
    c = caster(mode)
    c.begin_step()
    c.cast_flat("g", values(TOTAL, 12), torch.zeros(TOTAL, dtype=torch.bfloat16), with_padding(PARAMS, TOTAL))
    assert c.residuals == {} and c.residual_for("g", torch.zeros(3)) is None


def test_begin_step_resets_the_counts_which_sum_over_groups():
    c = caster("stochastic")
    slices = with_padding(PARAMS, TOTAL)
    assert c.begin_step() == 1
    served1, served2 = torch.zeros(TOTAL, dtype=torch.bfloat16), torch.zeros(TOTAL, dtype=torch.bfloat16)
    c.cast_flat(1, values(TOTAL, 13), served1, slices)
    after_one = c.last.changed
    c.cast_flat(2, values(TOTAL, 14), served2, slices)
    mask = param_mask(slices)
    assert c.last.numel == 2 * int(mask.sum())
    assert c.last.changed == after_one + int((bf16_bits(served2)[mask] != 0).sum()) and after_one > 0
    assert c.begin_step() == 2 and c.step == 2
    assert c.last == CastStats(step=2, numel=0, changed=0)


class Recorder:
    def __init__(self, served: dict):
        self.calls = []
        self.served = served

    def on_cast(self, key, master, served, slices, step):
        assert served is self.served[key]  # the served shard itself
        # called after the group is cast: the served shard already holds this step's bits
        self.calls.append((key, master, slices, step, bf16_bits(self.served[key]).clone()))


def test_observer_called_once_per_flat_group_with_key_master_slices_step():
    c = caster("dither")
    slices = {"g0": with_padding(PARAMS, TOTAL), "g1": with_padding([ShardSlice("blocks.2.w", 0, 8, 0)], 8)}
    masters = {"g0": values(TOTAL, 15).view(4, 25), "g1": values(8, 16)}  # a 2-D master is used flat
    served = {k: torch.zeros(m.numel(), dtype=torch.bfloat16) for k, m in masters.items()}
    rec = Recorder(served)
    c.observers.append(rec)
    for _ in range(2):
        c.begin_step()
        for k in ("g0", "g1"):
            c.cast_flat(k, masters[k], served[k], slices[k])
    assert [(key, step) for key, _, _, step, _ in rec.calls] == [("g0", 1), ("g1", 1), ("g0", 2), ("g1", 2)]
    for key, master, sl, step, bits in rec.calls:
        assert sl is slices[key]
        assert master.dim() == 1 and master.numel() == masters[key].numel()
        assert master.data_ptr() == masters[key].data_ptr()  # the master itself, not a copy
        want = expected(masters[key].reshape(-1), sl, "dither", step)
        assert torch.equal(bits, bf16_bits(want))


def test_bench_offload_reports_a_row_per_size_and_mode():
    """`python3 -m faircast_bench --offload` reports, for each (size, mode), the three routes' times (DeepSpeed's
    cross-device copy, the staged route, the eager route it replaced; forced on the CPU here) and their
    ratios. Only the report: what the staged route serves is checked against the oracle in
    test_the_offload_route_serves_the_reference_cast."""
    import math

    from faircast_bench import casts as bench

    rows = bench.run_offload((4096,), modes=("stochastic", "error_feedback"), repeats=1)
    assert [(r.size, r.mode) for r in rows] == [(4096, "stochastic"), (4096, "error_feedback")]
    assert all(math.isfinite(t) and t >= 0 for r in rows for t in (r.rn_ms, r.staged_ms, r.eager_ms))
    lines = bench.format_offload(rows).splitlines()
    assert lines[2].split() == ["size", "mode", "device", "RN", "copy_", "ms", "staged", "ms", "staged/RN", "eager",
                                "route", "ms", "eager/staged"]
    assert [line.split()[1] for line in lines[4:]] == ["stochastic", "error_feedback"]
    assert all(("cuda" in line or "(staging forced)" in line) for line in lines[4:])


@pytest.mark.parametrize("mode", MODES)
def test_the_offload_route_serves_the_reference_cast(mode):
    """The route `bench --offload` times (ShardCaster with the staging route, as for an fp32 master on the
    host and a served shard on an accelerator; forced on the CPU here) serves, at each of two steps, the
    reference cast of every parameter slice bit for bit, and keeps the reference's residual."""
    slices = with_padding(PARAMS, TOTAL)
    master = values(TOTAL, 17)
    c = ShardCaster(FairCastConfig(mode=mode, seed=SEED), force_staging=True)
    served = master.to(torch.bfloat16)  # DeepSpeed's round-to-nearest copy at initialize
    residual = torch.zeros(TOTAL) if mode == "error_feedback" else None
    mask = param_mask(slices)
    for step in (1, 2):
        moved = master + step * 1e-3
        c.begin_step()
        c.cast_flat("g", moved, served, slices)
        want = expected(moved, slices, mode, step, residual)
        assert torch.equal(bf16_bits(served), bf16_bits(want)), (mode, step)
        if mode in ("stochastic", "dither"):  # the comparison is telling: not round-to-nearest here
            assert int((bf16_bits(want) != bf16_bits(moved.to(torch.bfloat16)))[mask].sum()) > 5
        if residual is not None:
            assert torch.equal(fp32_bits(c.residuals["g"])[mask], fp32_bits(residual)[mask])
    assert c.stages["g"].numel() == TOTAL  # the staging buffer was the route taken
