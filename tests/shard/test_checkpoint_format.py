"""faircast_ds.shard.state in process, with a fake two-group adapter and fake ranks (no DeepSpeed launch).

The fake adapter lays out parameters the way ZeRO-1/2 does: each flat group concatenates its parameters
(each aligned to ALIGN elements, the gaps are padding), pads the whole to a multiple of the world size and
gives rank r the r-th equal part, so a partition cuts across parameters. A save at world 2 and a restore
at world 3 therefore see different slices of the same named parameters.
"""
from __future__ import annotations

import os
import struct
import zipfile
import zlib
from typing import Hashable, Iterator

import pytest
import torch

from faircast_ds.casting.bits import bf16_bits, fp32_bits
from faircast_ds.casting.modes import MODES
from faircast_ds.casting.rules import cast
from faircast_ds.config.section import FairCastConfig
from faircast_ds.shard import state as checkpoint
from faircast_ds.shard.adapter import Adapter, Setup
from faircast_ds.shard.caster import ShardCaster, ShardSlice, with_padding
from faircast_ds.shard.state import FairCastStateError, publish_restored, reset_state, restore_state, save_state

SEED = 77
ALIGN = 4
GROUPS = {  # flat group key -> its parameters (name, numel)
    0: [("embed.weight", 30), ("layers.0.w", 45)],
    1: [("layers.1.w", 37), ("head.b", 11)],
}
PAD_VALUE = 0.1234567  # fp32 in the padding (DeepSpeed keeps its own copy there)


def initial_params(groups=GROUPS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(n, generator=g) * 0.05 for params in groups.values() for name, n in params}


def update(full: dict[str, torch.Tensor], step: int) -> None:
    """An optimizer step of about a tenth of a spacing, a function of (parameter, index, step) only."""
    for i, (name, p) in enumerate(full.items()):
        idx = torch.arange(p.numel(), dtype=torch.float32)
        p += 2e-5 * torch.sin(0.7 * idx + 1.3 * step + i)


def partition(params: list[tuple[str, int]], rank: int, world: int) -> tuple[list[ShardSlice], int]:
    """Rank ``rank``'s slices of one flat group (padding included) and its partition size."""
    ranges, cursor = [], 0
    for name, n in params:
        ranges.append((name, cursor, n))
        cursor += -(-n // ALIGN) * ALIGN
    size = -(-cursor // world)
    lo_rank, hi_rank = rank * size, (rank + 1) * size
    slices = []
    for name, a, n in ranges:
        lo, hi = max(a, lo_rank), min(a + n, hi_rank)
        if lo < hi:
            slices.append(ShardSlice(name, lo - a, hi - lo, lo - lo_rank))
    return with_padding(slices, size), size


class FakeAdapter(Adapter):
    """One fake rank's two flat groups; ``previous`` buffers optional (an optimizer that overwrites the
    served shard by round-to-nearest, as ZeRO-1/2's does)."""

    setup = Setup.of(zero_stage=2)  # as a DeepSpeed ZeRO-2 adapter says it

    def __init__(self, caster: ShardCaster, rank: int, world: int, groups=GROUPS, use_previous: bool = False):
        super().__init__(optimizer=None, caster=caster, names={})
        self.layout = {}
        self.masters, self.served, self.prev = {}, {}, {}
        for key, params in groups.items():
            slices, size = partition(params, rank, world)
            self.layout[key] = slices
            self.masters[key] = torch.full((size,), PAD_VALUE)
            # garbage until cast or restored: a restore that forgot an element would show
            self.served[key] = torch.full((size,), -777.0).to(torch.bfloat16)
            if use_previous:
                self.prev[key] = torch.full((size,), 555.0).to(torch.bfloat16)
        self.published = 0

    def install(self) -> None:
        pass

    def flat_groups(self) -> Iterator[tuple[Hashable, torch.Tensor, torch.Tensor, list[ShardSlice]]]:
        for key in self.layout:
            yield key, self.masters[key], self.served[key], self.layout[key]

    def publish(self) -> None:
        self.published += 1

    def previous(self, key: Hashable) -> torch.Tensor | None:
        return self.prev.get(key)

    def load_masters(self, full: dict[str, torch.Tensor]) -> None:
        for key, slices in self.layout.items():
            for s in slices:
                if not s.is_padding:
                    self.masters[key][s.offset:s.offset + s.numel] = full[s.name][s.start:s.start + s.numel]


def make_world(world: int, mode: str, full, *, seed: int = SEED, groups=GROUPS, use_previous=False):
    ranks = []
    for r in range(world):
        caster = ShardCaster(FairCastConfig(mode=mode, seed=seed))
        adapter = FakeAdapter(caster, r, world, groups, use_previous)
        adapter.load_masters(full)
        ranks.append(adapter)
    return ranks


def train_step(ranks, full, step: int, *others) -> None:
    """One optimizer step of the model ``full``, cast by ``ranks`` (and by the ranks of ``others``, other
    worlds holding the same model)."""
    update(full, step)
    for a in [a for world in (ranks, *others) for a in world]:
        a.load_masters(full)
        assert a.caster.begin_step() == step
        a.cast_all()


def gather(ranks, groups=GROUPS) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's served bits and residual, assembled from the ranks' slices (each element once)."""
    sizes = {name: n for params in groups.values() for name, n in params}
    served = {name: torch.full((n,), -1, dtype=torch.int64) for name, n in sizes.items()}
    residual = {name: torch.full((n,), float("nan")) for name, n in sizes.items()}
    seen = {name: torch.zeros(n, dtype=torch.int64) for name, n in sizes.items()}
    for a in ranks:
        for key, _, srv, slices in a.flat_groups():
            res = a.caster.residuals.get(key)
            for s in slices:
                if s.is_padding:
                    continue
                part = slice(s.start, s.start + s.numel)
                served[s.name][part] = bf16_bits(srv[s.offset:s.offset + s.numel])
                if res is not None:
                    residual[s.name][part] = res[s.offset:s.offset + s.numel]
                seen[s.name][part] += 1
    assert all(bool((v == 1).all()) for v in seen.values()), "the fake partition must cover each element once"
    return {"served": served, "residual": residual}


def assert_same(a, b, what: str, *, residual: bool) -> None:
    for name in a["served"]:
        assert torch.equal(a["served"][name], b["served"][name]), f"{what}: served bits of {name}"
        if residual:
            assert torch.equal(fp32_bits(a["residual"][name]), fp32_bits(b["residual"][name])), \
                f"{what}: residual of {name}"


def saved_at_world_2(tmp_path, mode: str, steps: int = 3):
    full = initial_params()
    w2 = make_world(2, mode, full)
    for step in range(1, steps + 1):
        train_step(w2, full, step)
    tag = str(tmp_path / "global_step3")
    files = [save_state(a, a.caster, tag, rank=r, world=2) for r, a in enumerate(w2)]
    return full, w2, tag, files


def test_fake_partitions_cut_across_parameters_differently():
    """The premise of the world-size tests: the two layouts really differ and cut inside parameters."""
    for key, params in GROUPS.items():
        cuts = {w: [[(s.name, s.start, s.numel) for s in partition(params, r, w)[0] if not s.is_padding]
                    for r in range(w)] for w in (2, 3)}
        assert cuts[2] != cuts[3]
        assert any(start > 0 for rank in cuts[3] for _, start, _ in rank)
        assert any(s.is_padding for r in range(2) for s in partition(params, r, 2)[0])


# ---- the round trip, every mode ---------------------------------------------------------------------

@pytest.mark.parametrize("use_previous", (False, True))
@pytest.mark.parametrize("mode", MODES)
def test_save_at_world_2_restore_at_world_3(tmp_path, mode, use_previous):
    full, w2, tag, files = saved_at_world_2(tmp_path, mode)
    assert sorted(os.listdir(checkpoint.state_dir(tag))) == ["rank00000-of-00002.pt", "rank00001-of-00002.pt"]
    assert [os.path.basename(f) for f in files] == ["rank00000-of-00002.pt", "rank00001-of-00002.pt"]
    saved = gather(w2)
    ef = mode == "error_feedback"
    if ef:  # a residual worth restoring
        assert any(bool(v.ne(0).any()) for v in saved["residual"].values())

    w3 = make_world(3, mode, full, use_previous=use_previous)  # fp32 masters as restored; fresh casters
    assert [restore_state(a, a.caster, tag) for a in w3] == [3, 3, 3]
    assert all(a.caster.step == 3 and a.published == 0 for a in w3)  # restore_state itself is local
    for a in w3:
        publish_restored(a, a.caster)
    assert all(a.published == 1 for a in w3)
    restored = gather(w3)
    assert_same(restored, saved, f"{mode} restored at world 3", residual=ef)
    if not ef:
        assert all(a.caster.residuals == {} for a in w3)
    if use_previous:  # the last served bits, for the next step's change count
        for a in w3:
            for key, _, served, slices in a.flat_groups():
                for s in slices:
                    if not s.is_padding:
                        part = slice(s.offset, s.offset + s.numel)
                        assert torch.equal(bf16_bits(a.prev[key][part]), bf16_bits(served[part])), (mode, s)

    # the next step from the restored state is the next step of the run that never stopped
    train_step(w2, full, 4, w3)
    assert_same(gather(w3), gather(w2), f"{mode} step 4 after the restore", residual=ef)
    assert sum(a.caster.last.changed for a in w3) == sum(a.caster.last.changed for a in w2)
    assert sum(a.caster.last.changed for a in w2) > 0


def test_error_feedback_served_bits_restored_in_chunks(tmp_path, monkeypatch):
    """The restore copies saved pieces a chunk at a time (bounded temporaries): with 8-element chunks (the
    neighbour bits' byte), chunk edges fall inside every slice, and the round trip is the same."""
    from faircast_ds.shard import state as cast_state

    monkeypatch.setattr(cast_state, "_COPY_CHUNK", 8)
    test_save_at_world_2_restore_at_world_3(tmp_path, "error_feedback", False)


@pytest.mark.parametrize("mode", MODES)
def test_state_file_contents(tmp_path, mode):
    _, w2, tag, files = saved_at_world_2(tmp_path, mode)
    pieces = {}
    for r, f in enumerate(files):
        record = torch.load(f, weights_only=True)
        assert {k: record[k] for k in ("format", "mode", "seed", "step", "zero_stage", "rank", "world_size")} == \
            {"format": checkpoint.FORMAT, "mode": mode, "seed": SEED, "step": 3, "zero_stage": 2, "rank": r,
             "world_size": 2}
        mine = [(s.name, s.start, s.numel) for _, _, _, sl in w2[r].flat_groups() for s in sl if not s.is_padding]
        assert [(e["name"], e["start"], e["numel"]) for e in record["slices"]] == mine  # no padding entries
        n = sum(e["numel"] for e in record["slices"])
        if mode == "error_feedback":
            assert record["residual"].dtype == torch.float32 and record["residual"].numel() == n
            # the served bits as which bf16 neighbour of the master each is, 8 to a byte from the lowest bit, each
            # slice from a byte of its own; worked out here with Python integers from the rank's own tensors
            mine_slices = [(key, s) for key, _, _, sl in w2[r].flat_groups() for s in sl if not s.is_padding]
            offset, packed_at = 0, 0
            for e, (key, s) in zip(record["slices"], mine_slices):
                masters = w2[r].masters[key][s.offset:s.offset + s.numel]
                served = bf16_bits(w2[r].served[key][s.offset:s.offset + s.numel]).tolist()
                flags = [(b - (m >> 16)) % 65536 for b, m in zip(served, (fp32_bits(masters) & 0xFFFFFFFF).tolist())]
                assert set(flags) <= {0, 1} and 1 in flags  # error feedback serves both neighbours
                want = bytes(sum(f << i for i, f in enumerate(flags[j:j + 8])) for j in range(0, len(flags), 8))
                assert e["neighbour_at"] == packed_at and e["exceptions"] == 0
                got = record["neighbour"][packed_at:packed_at + len(want)]
                assert got.numpy().tobytes() == want
                assert e["crc_residual"] == crc32(record["residual"][offset:offset + e["numel"]])
                assert e["crc_neighbour"] == crc32(got)
                res = record["residual"][offset:offset + e["numel"]].tolist()
                spacing = [2.0 ** (max((b >> 7) & 0xFF, 1) - 134) for b in served]
                assert e["sum_abs_residual_spacings"] == pytest.approx(sum(abs(x) / y for x, y in zip(res, spacing)))
                offset += e["numel"]
                packed_at += len(want)
            assert record["neighbour"].numel() == packed_at
            assert record["exception_at"].numel() == 0 and record["served"].numel() == 0  # all masters finite
        else:  # the served copy is recomputed from the master: nothing but the step is kept
            assert record["residual"].numel() == 0 and record["served"].numel() == 0
            assert record["neighbour"].numel() == 0
            assert all("crc_residual" not in e for e in record["slices"])
        for e in record["slices"]:
            pieces.setdefault(e["name"], []).append((e["start"], e["numel"]))
    sizes = {name: n for params in GROUPS.values() for name, n in params}
    for name, ps in pieces.items():  # together the files hold each element exactly once
        ps.sort()
        assert ps[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(ps, ps[1:]))
        assert ps[-1][0] + ps[-1][1] == sizes[name]
    assert set(pieces) == set(sizes)


@pytest.mark.parametrize("mode", MODES)
def test_reset_state_starts_over_from_the_masters(tmp_path, mode):
    full = initial_params()
    ranks = make_world(3, mode, full)
    for step in (1, 2):
        train_step(ranks, full, step)
    for a in ranks:
        reset_state(a, a.caster, 9)
    assert all(a.caster.step == 9 and a.published == 1 for a in ranks)
    got = gather(ranks)
    for name, p in full.items():
        res = torch.zeros_like(p) if mode == "error_feedback" else None
        want = cast(p, mode, seed=SEED, step=9, name=name, residual=res)
        assert torch.equal(got["served"][name], bf16_bits(want)), name
        if res is not None:  # the residual restarted from zero: one cast's worth, not three
            assert torch.equal(fp32_bits(got["residual"][name]), fp32_bits(res)), name


# ---- what a restore refuses -----------------------------------------------------------------------

def crc32(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (zlib's, over the little-endian raw data)."""
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes())


def tensor_entries(path: str) -> list[tuple[int, int]]:
    """(file offset, size) of each tensor's raw bytes inside a torch.save zip (stored uncompressed)."""
    out = []
    with zipfile.ZipFile(path) as z:
        raw = open(path, "rb").read()
        for info in z.infolist():
            if "/data/" in info.filename and not info.filename.endswith(".pkl"):
                assert info.compress_type == zipfile.ZIP_STORED
                n, e = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
                out.append((info.header_offset + 30 + n + e, info.file_size))
    return out


@pytest.mark.parametrize("array", ("residual", "neighbour"))  # the two arrays of a rank file with bytes in them
def test_a_flipped_byte_is_caught_by_the_crc(tmp_path, array):
    full, _, tag, files = saved_at_world_2(tmp_path, "error_feedback")
    before = torch.load(files[1], weights_only=True)
    sizes = {before[k].numel() * before[k].element_size(): k for k in ("residual", "neighbour")}
    assert len(sizes) == 2  # tell the two arrays apart by their byte counts
    offset, size = next((o, n) for o, n in tensor_entries(files[1]) if sizes.get(n) == array)
    raw = bytearray(open(files[1], "rb").read())
    raw[offset + size // 2 + 1] ^= 0x5A
    open(files[1], "wb").write(raw)
    after = torch.load(files[1], weights_only=True)  # still a readable file: only a value changed
    changed = [k for k in ("residual", "neighbour") if not torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8))]
    assert changed == [array]
    w3 = make_world(3, "error_feedback", full)
    with pytest.raises(FairCastStateError, match=r"rank00001-of-00002\.pt: CRC mismatch for .* the state file is corrupted"):
        for a in w3:
            restore_state(a, a.caster, tag)


def as_format_2(path: str, adapter) -> None:
    """Rewrite a rank file the way faircast-ds/2 wrote it: every served element's 16-bit pattern (taken from
    the saving rank's own served shard), each slice's CRC over them (zlib here, not the library's)."""
    record = torch.load(path, weights_only=True)
    bits = []
    for key, _, served, slices in adapter.flat_groups():
        bits += [bf16_bits(served[s.offset:s.offset + s.numel]).to(torch.int16) for s in slices if not s.is_padding]
    old = torch.cat(bits) if bits else torch.zeros(0, dtype=torch.int16)
    if record["residual"].numel() == 0:
        old = old[:0]
    offset = 0
    for e in record["slices"]:
        for k in ("crc_neighbour", "neighbour_at", "exceptions", "sum_abs_residual_spacings"):
            e.pop(k, None)
        if "crc_residual" in e:
            e["crc_served"] = crc32(old[offset:offset + e["numel"]])
        offset += e["numel"]
    for k in ("neighbour", "exception_at", "crc_exceptions"):
        record.pop(k)
    record.update(format="faircast-ds/2", served=old)
    torch.save(record, path)


def as_format_1(path: str) -> None:
    """Rewrite a faircast-ds/2 rank file the way faircast-ds/1 wrote it: served bits as int32 in [0, 2^16),
    each slice's CRC over those int32 bytes (zlib here, not the library's)."""
    record = torch.load(path, weights_only=True)
    old = record["served"].to(torch.int32) & 0xFFFF
    offset = 0
    for e in record["slices"]:
        if "crc_served" in e:
            e["crc_served"] = crc32(old[offset:offset + e["numel"]])
        offset += e["numel"]
    record.update(format="faircast-ds/1", served=old)
    torch.save(record, path)


@pytest.mark.parametrize("fmt", ("faircast-ds/1", "faircast-ds/2"))
@pytest.mark.parametrize("mode", ("error_feedback", "dither"))
def test_an_older_format_checkpoint_still_restores(tmp_path, mode, fmt):
    """Checkpoints saved before the served bits went to int16 (/1) or to neighbour bits (/2) load to the same
    bits and residual, and the next step equals the run that never stopped."""
    full, w2, tag, files = saved_at_world_2(tmp_path, mode)
    for f, adapter in zip(files, w2):
        as_format_2(f, adapter)
        if fmt == "faircast-ds/1":
            as_format_1(f)
    assert torch.load(files[0], weights_only=True)["format"] == fmt
    w3 = make_world(3, mode, full, use_previous=True)
    assert [restore_state(a, a.caster, tag) for a in w3] == [3, 3, 3]
    for a in w3:
        publish_restored(a, a.caster)
    assert_same(gather(w3), gather(w2), f"{mode} restored from {fmt}", residual=mode == "error_feedback")
    train_step(w2, full, 4, w3)
    assert_same(gather(w3), gather(w2), f"{mode} step 4 after a {fmt} restore",
                residual=mode == "error_feedback")


@pytest.mark.parametrize("fmt, dtype", [("faircast-ds/3", torch.int32), ("faircast-ds/2", torch.int32),
                                        ("faircast-ds/1", torch.int16)])
def test_served_bits_of_the_other_formats_dtype_are_refused(tmp_path, fmt, dtype):
    _, _, tag, files = saved_at_world_2(tmp_path, "error_feedback")
    record = torch.load(files[0], weights_only=True)
    record.update(format=fmt, served=record["served"].to(dtype))
    torch.save(record, files[0])
    a = make_world(3, "error_feedback", initial_params())[0]
    with pytest.raises(FairCastStateError, match=rf"rank00000-of-00002\.pt: a {fmt} state file stores its served "
                                                 rf"bits as {SERVED[fmt]}, this one as {dtype}: the file is corrupted"):
        restore_state(a, a.caster, tag)


SERVED = {"faircast-ds/1": torch.int32, "faircast-ds/2": torch.int16, "faircast-ds/3": torch.int16}


def test_a_missing_rank_file(tmp_path):
    _, _, tag, files = saved_at_world_2(tmp_path, "stochastic")
    os.remove(files[1])
    a = make_world(3, "stochastic", initial_params())[0]
    with pytest.raises(FairCastStateError, match="holds 1 rank files .* a rank's file is missing"):
        restore_state(a, a.caster, tag)


def test_a_stale_rank_file_from_another_world_size(tmp_path):
    full, _, tag, _ = saved_at_world_2(tmp_path, "dither")
    w3 = make_world(3, "dither", full)
    save_state(w3[2], w3[2].caster, tag, rank=2, world=3)  # left over from an older save at world 3
    with pytest.raises(FairCastStateError, match="inconsistent world sizes"):
        restore_state(w3[0], w3[0].caster, tag)


def test_no_state_at_all(tmp_path):
    a = make_world(2, "stochastic", initial_params())[0]
    with pytest.raises(FairCastStateError, match="no Fair Cast state in .*saved without fair_cast"):
        restore_state(a, a.caster, str(tmp_path))


def test_not_a_state_file(tmp_path):
    _, _, tag, files = saved_at_world_2(tmp_path, "stochastic")
    torch.save({"format": "something-else/9"}, files[0])
    a = make_world(3, "stochastic", initial_params())[0]
    with pytest.raises(FairCastStateError, match=r"rank00000-of-00002\.pt is not a faircast-ds/3 state file \(nor an "
                                                 r"earlier faircast-ds/1, faircast-ds/2 one\)"):
        restore_state(a, a.caster, tag)
    open(files[0], "wb").write(b"not a zip at all")
    with pytest.raises(FairCastStateError, match=r"cannot read Fair Cast state file .*rank00000-of-00002\.pt"):
        restore_state(a, a.caster, tag)


@pytest.mark.parametrize("saved, now", [("stochastic", "dither"), ("error_feedback", "nearest"),
                                        ("nearest", "error_feedback")])
def test_a_mode_mismatch(tmp_path, saved, now):
    _, _, tag, _ = saved_at_world_2(tmp_path, saved)
    a = make_world(3, now, initial_params())[0]
    with pytest.raises(FairCastStateError, match=f"saved with fair_cast.mode='{saved}', this run has '{now}'"):
        restore_state(a, a.caster, tag)
    assert a.caster.step == 0 and a.caster.residuals == {}


def test_a_seed_mismatch(tmp_path):
    _, _, tag, _ = saved_at_world_2(tmp_path, "error_feedback")
    a = make_world(3, "error_feedback", initial_params(), seed=SEED + 1)[0]
    with pytest.raises(FairCastStateError, match=f"saved with fair_cast.seed={SEED}, this run has {SEED + 1}"):
        restore_state(a, a.caster, tag)
    assert a.caster.step == 0


@pytest.mark.parametrize("mode", MODES)
def test_incomplete_coverage(tmp_path, mode):
    """The restoring model has elements the checkpoint does not hold: a longer parameter, a new one."""
    full, _, tag, _ = saved_at_world_2(tmp_path, mode)
    longer = {0: GROUPS[0], 1: [("layers.1.w", 37), ("head.b", 13)]}
    big = dict(full, **{"head.b": torch.cat([full["head.b"], torch.zeros(2)])})
    ranks = make_world(1, mode, big, groups=longer)
    with pytest.raises(FairCastStateError, match=r"does not cover head\.b elements \[0, 13\) \(covered 11\)"):
        restore_state(ranks[0], ranks[0].caster, tag)
    extra = {0: GROUPS[0] + [("new.w", 6)], 1: GROUPS[1]}
    ranks = make_world(3, mode, dict(full, **{"new.w": torch.zeros(6)}), groups=extra)
    with pytest.raises(FairCastStateError, match=r"does not cover new\.w elements"):
        for a in ranks:
            restore_state(a, a.caster, tag)


# ---- faircast-ds/3: served bits as neighbour bits, and the exceptions they cannot give --------------------------

def unpacked_patterns(masters: torch.Tensor, packed: torch.Tensor, first: int) -> torch.Tensor:
    """The patterns packed flags name, by this file's own arithmetic: flag i is bit i % 8 of byte i // 8, the
    pattern the master's upper 16 bits plus the flag, mod 2^16 (as int16)."""
    flags = ((packed.to(torch.int64).unsqueeze(1) >> torch.arange(8)) & 1).view(-1)[first:first + masters.numel()]
    lower = (fp32_bits(masters).to(torch.int64) >> 16) & 0xFFFF
    patterns = (lower + flags) & 0xFFFF
    return torch.where(patterns >= 32768, patterns - 65536, patterns).to(torch.int16)


def test_neighbour_bits_give_back_any_served_patterns_exactly():
    """Whatever the served patterns (the rule's on awkward masters, or anything at all), packing them against
    the masters and rebuilding gives them back bit for bit: those that are not a neighbour of their master
    are kept as exceptions."""
    from faircast_ds.shard import neighbour

    g = torch.Generator().manual_seed(3)
    awkward = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-42, -1e-42, 3.3895e38,
                            -3.3895e38, 1.0, -1.0, 2.0 ** -126])
    masters = torch.cat([awkward, torch.randn(5000, generator=g) * 0.02])
    residual = torch.randn(masters.numel(), generator=g) * 1e-4
    ruled = cast(masters, "error_feedback", seed=1, step=1, name="w", residual=residual.clone())
    anything = torch.randint(-32768, 32768, (masters.numel(),), generator=g, dtype=torch.int16)
    for served16, what in ((bf16_bits(ruled).to(torch.int16), "the rule's"), (anything, "random patterns")):
        packed = torch.empty(neighbour.nbytes(masters.numel()), dtype=torch.uint8)
        where, patterns = neighbour.encode(masters, served16.view(torch.bfloat16), packed, chunk=64)
        rebuilt = unpacked_patterns(masters, packed, 0)
        neighbour.apply_exceptions(rebuilt, where, patterns)
        assert torch.equal(rebuilt, served16), what
        lower = (fp32_bits(masters) >> 16) & 0xFFFF
        step = (served16.to(torch.int64) & 0xFFFF) - lower
        assert sorted(where.tolist()) == [i for i, d in enumerate(step.tolist()) if d % 65536 > 1], what
        for first, count in ((0, 7), (3, 100), (61, 4000)):  # any window of the packed bits
            keep = (where >= first) & (where < first + count)
            for window in (unpacked_patterns(masters[first:first + count], packed, first),
                           neighbour.served_bits_packed(masters[first:first + count], packed, first)):
                neighbour.apply_exceptions(window, where[keep] - first, patterns[keep])
                assert torch.equal(window, served16[first:first + count]), (what, first, count)
    assert where.numel() > 4000  # random patterns are mostly exceptions


@pytest.mark.parametrize("chunk", (1 << 20, 8))
@pytest.mark.parametrize("world", (2, 3))
def test_exceptions_restore_at_the_same_and_another_world_size(tmp_path, world, chunk, monkeypatch):
    """Served elements that are not a neighbour of their master (written here by hand before the save) come
    back exactly, through the same layout's one-pass copy (world 2; in one chunk, or in 8-element chunks so
    that exceptions fall in later chunks) and through pieces cut differently (world 3)."""
    monkeypatch.setattr(checkpoint, "_COPY_CHUNK", chunk)
    full = initial_params()
    w2 = make_world(2, "error_feedback", full)
    for step in (1, 2, 3):
        train_step(w2, full, step)
    odd = {}
    for a in w2:  # three elements per rank: patterns no rule would serve for their masters
        for key, _, served, slices in a.flat_groups():
            s = next(s for s in slices if not s.is_padding)
            for i in (0, s.numel // 2, s.numel - 1):
                served.view(torch.int16)[s.offset + i] = 0x1234 + i
                odd[(s.name, s.start + i)] = 0x1234 + i
    tag = str(tmp_path / "global_step3")
    files = [save_state(a, a.caster, tag, rank=r, world=2) for r, a in enumerate(w2)]
    assert sum(int(torch.load(f, weights_only=True)["exception_at"].numel()) for f in files) == len(odd)
    saved = gather(w2)
    for (name, index), pattern in odd.items():
        assert int(saved["served"][name][index]) == pattern
    restored = make_world(world, "error_feedback", full, use_previous=True)
    assert [restore_state(a, a.caster, tag) for a in restored] == [3] * world
    for a in restored:
        publish_restored(a, a.caster)
    assert_same(gather(restored), saved, f"restored at world {world}", residual=True)


@pytest.mark.parametrize("world", (2, 3))
def test_served_bits_are_not_rebuilt_from_other_masters(tmp_path, world):
    """faircast-ds/3 rebuilds error feedback's served bits from the masters the load restored, so a load whose
    masters are not the saved ones (DeepSpeed rebuilding them from the bf16 weights, say) is refused by name,
    found by the masters sampled into the file, instead of serving bits one spacing off."""
    full, _, tag, _ = saved_at_world_2(tmp_path, "error_feedback")
    rounded = {name: p.to(torch.bfloat16).float() for name, p in full.items()}  # masters from the bf16 weights
    ranks = make_world(world, "error_feedback", rounded)
    with pytest.raises(FairCastStateError, match=r"the fp32 masters this load restored for \S+ are not the ones saved "
                                                 r"with the Fair Cast state \(element \d+ differs\).*load_from_fp32_weights"):
        for a in ranks:
            restore_state(a, a.caster, tag)
    one_off = {name: p.clone() for name, p in full.items()}
    one_off["layers.1.w"][-1] = torch.nextafter(one_off["layers.1.w"][-1], torch.tensor(1.0))  # a sampled element
    ranks = make_world(world, "error_feedback", one_off)
    with pytest.raises(FairCastStateError, match=r"for layers\.1\.w are not the ones saved .*\(element 36 differs\)"):
        for a in ranks:
            restore_state(a, a.caster, tag)
