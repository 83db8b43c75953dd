"""Fair Cast's durable state inside a checkpoint.

What a checkpoint tag directory gains: ``<tag>/fair_cast/rank<r>-of-<n>.pt``, one file per rank,
written (atomically, fsynced) before the framework writes its own files. Each file holds the mode,
seed and noise step, the framework's own step counter at save time (``engine_step``: a load checks
it against the framework's files, so a tag holding parts of two saves is refused), and, for
``error_feedback``, every local slice's residual (fp32) and served bits keyed by (parameter name, start
index) with a CRC32 per slice. Format ``faircast-ds/3`` keeps the served bits as one bit per element
(which bf16 neighbour of the master was served, :mod:`faircast_ds.shard.neighbour`; the load rebuilds
the pattern from the restored master) plus the rare elements that bit cannot give, whole: 4.125 bytes
per element with the residual. ``faircast-ds/2`` files (the 16-bit patterns, 6 bytes per element) and
``faircast-ds/1`` files (patterns as int32, 8 bytes) still load. Because the key is (parameter, index) and not (rank,
offset), a checkpoint saved at one world size or ZeRO stage restores at any other: each rank reads
only the pieces that overlap its own slices (files are memory-mapped, so no rank reads the whole
model's residual).

Restoring reproduces the served copy bit for bit: ``stochastic``/``dither``/``nearest`` recompute it
from the restored fp32 master at the saved step; ``error_feedback`` puts back the saved served
bits (a /3 file: rebuilt from the restored masters and the neighbour bits) and residual (the served value
depends on the residual before the last cast, which is gone).
Where a load rebuilds the master from the model's bf16 weights instead (a module-only load),
:class:`SavedCast` gives those weights as they were served.
"""
from __future__ import annotations

import glob
import os
import sys
import zlib
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from faircast_ds.casting.bits import bf16_from_bits, bf16_spacing
from faircast_ds.casting.modes import spec
from faircast_ds.casting.rules import cast
from faircast_ds.config.section import FairCastConfig
from faircast_ds.shard.adapter import Adapter
from faircast_ds.shard import neighbour
from faircast_ds.shard.caster import ShardCaster

FORMAT = "faircast-ds/3"  # what save_state writes
# the formats a load reads, and the dtype each stores the served bits in (/1: int32 holding the bf16 pattern
# in [0, 2^16); /2: int16, the pattern itself; /3: int16 patterns of the exceptions only, the rest as
# neighbour bits). A reader that knows only an older format refuses a newer file by its format.
SERVED_DTYPES = {"faircast-ds/1": torch.int32, "faircast-ds/2": torch.int16, FORMAT: torch.int16}
NEIGHBOUR_FORMATS = (FORMAT,)  # formats whose served bits are neighbour bits and exceptions
STATE_DIR = "fair_cast"


class FairCastStateError(RuntimeError):
    """The checkpoint's Fair Cast state is missing, from another configuration, or corrupted."""


class MissingStateError(FairCastStateError):
    """The checkpoint has no Fair Cast state at all (saved without Fair Cast, or converted by a tool that
    does not carry ``fair_cast/`` along)."""


def state_dir(tag_dir: str) -> str:
    return os.path.join(tag_dir, STATE_DIR)


def _crc(t: torch.Tensor) -> int:
    # over the tensor's own buffer (no bytes copy: a slice of a real embedding is hundreds of MB)
    return zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy())


def _write_atomically(payload: Any, path: str) -> None:
    """torch.save to ``path`` so that a reader sees the old file or the whole new one, also after a
    power loss (the data is on disk before the rename)."""
    with open(path + ".tmp", "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


@torch.no_grad()
def complete_step(adapter: Adapter, caster: ShardCaster) -> bool:
    """After a cast that stopped on a non-finite weight (``on_nonfinite: error``), cast the flat shards
    that step did not reach, at the same step and without raising, so that every served shard (and the
    residual) is that one step's cast. Local; returns whether anything was cast (then the caller
    publishes the shards). A no-op when no step failed."""
    if caster.failed is None:
        return False
    done = False
    for key, master, served, slices in adapter.flat_groups():
        if key not in caster.cast_keys:
            caster.cast_flat(key, master, served, slices, previous=adapter.previous(key), check=False)
            done = True
    return done


def save_state(adapter: Adapter, caster: ShardCaster, tag_dir: str, *, rank: int, world: int,
               engine_step: int | None = None) -> str:
    """Write this rank's Fair Cast state under ``tag_dir``; returns the file written. ``engine_step``:
    the framework's step counter, checked against its own files at load time."""
    complete_step(adapter, caster)  # never a served copy half of one step and half of the next
    cfg = caster.config
    keep_values = cfg.spec.residual
    groups = [(key, master, served, [s for s in group_slices if not s.is_padding])
              for key, master, served, group_slices in adapter.flat_groups()]
    total = sum(s.numel for _, _, _, parts in groups for s in parts) if keep_values else 0
    packed = sum(neighbour.nbytes(s.numel) for _, _, _, parts in groups for s in parts) if keep_values else 0
    # Written in place, slice by slice, into the arrays the file holds: no per-slice copies joined at the
    # end, no int64 bits (issue 23: at a real size those made the save's peak ~3x the payload).
    residuals = torch.empty(total, dtype=torch.float32)
    neighbours = torch.empty(packed, dtype=torch.uint8)
    exception_at: list[torch.Tensor] = []
    exception_bits: list[torch.Tensor] = []
    slices, at, packed_at = [], 0, 0
    for key, master, served, parts in groups:
        residual = caster.residuals.get(key)
        flat_master, flat_served = master.detach().view(-1), served.detach().view(-1)
        for s in parts:
            entry: dict[str, Any] = {"name": s.name, "start": s.start, "numel": s.numel}
            if keep_values:
                res = residuals.narrow(0, at, s.numel)
                if residual is not None:
                    res.copy_(residual.detach().narrow(0, s.offset, s.numel))
                else:
                    res.zero_()
                bits = flat_served.narrow(0, s.offset, s.numel)
                flags = neighbours.narrow(0, packed_at, neighbour.nbytes(s.numel))
                where, patterns = neighbour.encode(flat_master.narrow(0, s.offset, s.numel), bits, flags)
                exception_at.append(where + at)
                exception_bits.append(patterns)
                picks = _master_sample_positions(s.numel)
                entry.update(crc_residual=_crc(res), crc_neighbour=_crc(flags), neighbour_at=packed_at,
                             exceptions=where.numel(), sum_abs_residual_spacings=_residual_spacings(res, bits),
                             # the served bits are rebuilt from the masters a load restores: a sample of
                             # them, bit patterns, to refuse a load whose masters are not these
                             master_sample=flat_master.narrow(0, s.offset, s.numel)[picks.to(flat_master.device)]
                             .cpu().view(torch.int32).tolist())
                at += s.numel
                packed_at += flags.numel()
            slices.append(entry)
    exceptions = torch.cat(exception_at) if exception_at else torch.zeros(0, dtype=torch.int64)
    exception_served = torch.cat(exception_bits) if exception_bits else torch.zeros(0, dtype=torch.int16)
    payload = {
        "format": FORMAT, "mode": cfg.mode, "seed": cfg.seed, "step": caster.step, "engine_step": engine_step,
        **adapter.setup.state(), "rank": rank, "world_size": world, "slices": slices,
        "residual": residuals, "neighbour": neighbours, "exception_at": exceptions, "served": exception_served,
        "crc_exceptions": zlib.crc32(exception_served.view(torch.uint8).numpy(),
                                     zlib.crc32(exceptions.view(torch.uint8).numpy())),
        # the diagnostics' sampled master history (their lag needs the steps before the save)
        "diagnostics": next((o.checkpoint_state() for o in caster.observers if hasattr(o, "checkpoint_state")), None),
    }
    directory = state_dir(tag_dir)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank{rank:05d}-of-{world:05d}.pt")
    _write_atomically(payload, path)
    return path


MASTER_SAMPLES = 64  # fp32 masters per slice a /3 file keeps to check the load's masters against


def _master_sample_positions(numel: int) -> torch.Tensor:
    """Evenly spaced element positions of a slice, first and last included (at most MASTER_SAMPLES)."""
    if numel <= MASTER_SAMPLES:
        return torch.arange(numel)
    return torch.arange(MASTER_SAMPLES) * (numel - 1) // (MASTER_SAMPLES - 1)


def _check_masters(p: "_Piece", first: int, master: torch.Tensor) -> None:
    """Refuse to rebuild a /3 piece's served bits from masters other than those saved: the sampled positions
    inside ``[first, first + master.numel())`` must hold the saved fp32 bit patterns."""
    picks = _master_sample_positions(p.numel)
    saved = p.entry.get("master_sample")
    if saved is None or len(saved) != picks.numel():
        raise FairCastStateError(f"{p.file}: no sample of the fp32 masters for {p.entry['name']}: the file is corrupted")
    inside = (picks >= first) & (picks < first + master.numel())
    if not bool(inside.any()):
        return
    got = master.detach().reshape(-1)[(picks[inside] - first).to(master.device)].cpu().contiguous().view(torch.int32)
    want = torch.tensor(saved, dtype=torch.int32)[inside]
    if not torch.equal(got, want):
        at = int(picks[inside][torch.ne(got, want)][0]) + p.start
        raise FairCastStateError(
            f"{p.file}: the fp32 masters this load restored for {p.entry['name']} are not the ones saved with the Fair "
            f"Cast state (element {at} differs); error feedback's served bits are rebuilt from them. Was the load "
            "told to rebuild the masters from the bf16 weights (zero_optimization.load_from_fp32_weights: false)?")


def _residual_spacings(residual: torch.Tensor, served: torch.Tensor, chunk: int = 1 << 18) -> float:
    """Sum of |residual| in bf16 spacings at the served value over one slice (what ``faircast-ds inspect``
    averages; kept in the file, whose served bits no longer say the spacing without the masters)."""
    total = 0.0
    for at in range(0, residual.numel(), chunk):
        k = min(chunk, residual.numel() - at)
        spacing = bf16_spacing(served.narrow(0, at, k).to(residual.device))
        total += float((residual.narrow(0, at, k).abs() / spacing).sum(dtype=torch.float64))
    return total


@dataclass
class _Piece:
    start: int
    numel: int
    record: dict[str, Any]
    offset: int  # in the record's concatenated residual/served arrays
    entry: dict[str, Any]
    file: str

    @property
    def by_neighbour(self) -> bool:
        """Its served bits are neighbour bits and exceptions (rebuilt from the masters), not patterns."""
        return self.record["format"] in NEIGHBOUR_FORMATS


def read_records(tag_dir: str) -> list[tuple[str, dict[str, Any]]]:
    """Every rank file of a tag directory's Fair Cast state, checked for format, completeness and that
    all of them come from one save (memory-mapped: nothing is read until used)."""
    files = sorted(glob.glob(os.path.join(state_dir(tag_dir), "rank*-of-*.pt")))
    if not files:
        raise MissingStateError(f"no Fair Cast state in {state_dir(tag_dir)} (checkpoint saved without fair_cast, "
                                "or converted without its fair_cast/ folder?)")
    records = []
    for f in files:
        try:
            record = torch.load(f, mmap=True, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is corruption, named below
            raise FairCastStateError(f"cannot read Fair Cast state file {f}: {exc}") from exc
        if not isinstance(record, dict) or record.get("format") not in SERVED_DTYPES:
            raise FairCastStateError(f"{f} is not a {FORMAT} state file (nor an earlier "
                                     f"{', '.join(sorted(set(SERVED_DTYPES) - {FORMAT}))} one)")
        want = SERVED_DTYPES[record["format"]]
        served = record.get("served")
        if not isinstance(served, torch.Tensor) or served.dtype != want:
            raise FairCastStateError(f"{f}: a {record['format']} state file stores its served bits as {want}, this one "
                                     f"as {getattr(served, 'dtype', type(served).__name__)}: the file is corrupted")
        if record["format"] in NEIGHBOUR_FORMATS:
            _check_neighbour_arrays(f, record)
        records.append((f, record))
    worlds = {r["world_size"] for _, r in records}
    if len(worlds) != 1 or len(records) != worlds.pop():
        raise FairCastStateError(f"{state_dir(tag_dir)} holds {len(records)} rank files of inconsistent world sizes; "
                                 "a rank's file is missing")
    saves = {(r["mode"], r["seed"], r["step"], r.get("engine_step")) for _, r in records}
    if len(saves) != 1:
        steps = ", ".join(f"{os.path.basename(f)}: step {r['step']}" for f, r in records)
        raise FairCastStateError(f"{state_dir(tag_dir)} holds rank files of different saves ({steps}): a save into "
                                 "this tag was interrupted after some ranks had written theirs")
    return records


def _check_neighbour_arrays(f: str, record: dict[str, Any]) -> None:
    """A /3 file's neighbour bits and exceptions: their dtypes, lengths, order and CRC (they are small)."""
    flags, at, served = record.get("neighbour"), record.get("exception_at"), record["served"]
    if not isinstance(flags, torch.Tensor) or flags.dtype != torch.uint8 or not isinstance(at, torch.Tensor) \
            or at.dtype != torch.int64 or at.dim() != 1 or at.numel() != served.numel():
        raise FairCastStateError(f"{f}: its neighbour bits or exception list are missing or of the wrong type: the "
                                 "file is corrupted")
    crc = zlib.crc32(served.view(torch.uint8).numpy(), zlib.crc32(at.view(torch.uint8).numpy()))
    if crc != record.get("crc_exceptions"):
        raise FairCastStateError(f"{f}: CRC mismatch for its exception list: the state file is corrupted")
    if at.numel() and (bool((at[1:] <= at[:-1]).any()) or int(at[0]) < 0
                       or int(at[-1]) >= record["residual"].numel()):
        raise FairCastStateError(f"{f}: its exception list is not increasing inside the file's elements: the file is "
                                 "corrupted")


def _exceptions(p: "_Piece", first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A /3 piece's exceptions among its elements ``[first, first + count)``: (positions relative to
    ``first``, their 16-bit patterns)."""
    at = p.record["exception_at"]
    if not at.numel():
        return at, p.record["served"]
    lo_hi = torch.tensor([p.offset + first, p.offset + first + count], dtype=torch.int64)
    lo, hi = torch.searchsorted(at, lo_hi).tolist()
    return at[lo:hi] - (p.offset + first), p.record["served"][lo:hi]


def _neighbour_bytes(p: "_Piece") -> torch.Tensor:
    return p.record["neighbour"].narrow(0, p.entry["neighbour_at"], neighbour.nbytes(p.numel))


def _patterns(p: "_Piece", master: torch.Tensor, first: int) -> torch.Tensor:
    """A /3 piece's served patterns (int16) of elements ``[first, first + master.numel())``, rebuilt from
    ``master`` (the same elements' restored fp32 masters), exceptions written over them."""
    patterns = neighbour.served_bits_packed(master, _neighbour_bytes(p), first)
    neighbour.apply_exceptions(patterns, *_exceptions(p, first, master.numel()))
    return patterns


def _rebuild_bits(out: torch.Tensor, master: torch.Tensor, p: "_Piece", first: int) -> int:
    """:func:`_patterns` into the bf16 ``out``; returns how many elements changed bits."""
    patterns = _patterns(p, master, first)
    changed = _differing(out.view(torch.int16), patterns)
    out.view(torch.int16).copy_(patterns)
    return changed


def _index(records: list[tuple[str, dict[str, Any]]]) -> dict[str, list[_Piece]]:
    index: dict[str, list[_Piece]] = {}
    for f, record in records:
        offset = 0
        for entry in record["slices"]:
            index.setdefault(entry["name"], []).append(_Piece(entry["start"], entry["numel"], record, offset, entry, f))
            offset += entry["numel"]
    return index


def _verified(p: _Piece, verified: set[tuple[str, int]]) -> None:
    if (p.file, p.offset) in verified:
        return
    whole_res = p.record["residual"].narrow(0, p.offset, p.numel)
    if p.by_neighbour:
        bits_ok = _crc(_neighbour_bytes(p)) == p.entry["crc_neighbour"]
    else:
        bits_ok = _crc(p.record["served"].narrow(0, p.offset, p.numel)) == p.entry["crc_served"]
    if _crc(whole_res) != p.entry["crc_residual"] or not bits_ok:
        raise FairCastStateError(f"{p.file}: CRC mismatch for {p.entry['name']} [{p.start}, "
                                 f"{p.start + p.numel}): the state file is corrupted")
    verified.add((p.file, p.offset))


_COPY_CHUNK = 1 << 20  # elements per chunk of a verified copy: 8 MiB of the file, still in cache for the copy


def saved_bits(bits: torch.Tensor) -> torch.Tensor:
    """Saved served bits of either format as int64 in [0, 2^16), what :func:`bf16_from_bits` takes."""
    return bits.to(torch.int64).bitwise_and_(0xFFFF)


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many of two int16 tensors' elements differ (XOR and a nonzero count: about 4x faster than
    summing ``a != b`` on one core, measured in benchmarks/results/restore_pass.txt)."""
    return int(torch.count_nonzero(torch.bitwise_xor(a, b)))


def _copy_bits(out: torch.Tensor, bits: torch.Tensor) -> int:
    """Saved served bits into the bf16 tensor ``out``, with no temporary: int16 (``faircast-ds/2``) copied as
    they are; int32 holding the pattern in [0, 2^16) (``faircast-ds/1``) by the low half of each (on a
    little-endian machine; elsewhere through bf16_from_bits). Returns how many elements of ``out`` held
    other bits before (read in the same pass's cache)."""
    if bits.dtype == torch.int16:
        changed = _differing(out.view(torch.int16), bits)
        out.view(torch.int16).copy_(bits)
        return changed
    if sys.byteorder == "little" and bits.is_contiguous() and out.is_contiguous():
        saved = bits.view(torch.int16)[0::2]
        changed = _differing(out.view(torch.int16), saved)
        out.view(torch.int16).copy_(saved)
    else:
        saved = bf16_from_bits(bits.to(torch.int64))
        changed = _differing(out.view(torch.int16), saved.view(torch.int16))
        out.copy_(saved)
    return changed


def _copy_verified(p: _Piece, residual: torch.Tensor, served: torch.Tensor, master: torch.Tensor) -> int:
    """Copy a whole saved piece into ``residual`` and ``served`` chunk by chunk, each chunk's CRC taken just
    before it is copied (the file is read once: the copy reads what the CRC brought into cache); a /3 piece's
    served bits are rebuilt from ``master`` (the piece's restored fp32 masters). A CRC mismatch raises after
    the copy: the caller then stops the load or resets the state, which rewrites both. Returns how many
    served elements the copy changed."""
    changed = 0
    res_all = p.record["residual"].narrow(0, p.offset, p.numel)
    by_neighbour = p.by_neighbour
    bits_all = _neighbour_bytes(p) if by_neighbour else p.record["served"].narrow(0, p.offset, p.numel)
    crc_res = crc_bits = 0
    chunk = -(-_COPY_CHUNK // 8) * 8 if by_neighbour else _COPY_CHUNK  # neighbour bits: a chunk starts on a byte
    for at in range(0, p.numel, chunk):
        k = min(chunk, p.numel - at)
        res = res_all.narrow(0, at, k)
        bits = bits_all.narrow(0, at // 8, neighbour.nbytes(k)) if by_neighbour else bits_all.narrow(0, at, k)
        crc_res = zlib.crc32(res.view(torch.uint8).numpy(), crc_res)
        crc_bits = zlib.crc32(bits.view(torch.uint8).numpy(), crc_bits)
        residual.narrow(0, at, k).copy_(res)
        if by_neighbour:
            changed += _rebuild_bits(served.narrow(0, at, k), master.narrow(0, at, k), p, at)
        else:
            changed += _copy_bits(served.narrow(0, at, k), bits)
    want_bits = p.entry["crc_neighbour"] if by_neighbour else p.entry["crc_served"]
    if crc_res != p.entry["crc_residual"] or crc_bits != want_bits:
        raise FairCastStateError(f"{p.file}: CRC mismatch for {p.entry['name']} [{p.start}, "
                                 f"{p.start + p.numel}): the state file is corrupted")
    return changed


def check_engine_step(records: list[tuple[str, dict[str, Any]]], tag_dir: str, engine_step: int | None) -> None:
    """Refuse a tag whose Fair Cast state and framework files come from different saves."""
    saved = records[0][1].get("engine_step")
    if engine_step is not None and saved is not None and int(saved) != int(engine_step):
        raise FairCastStateError(f"{tag_dir}: the Fair Cast state was saved at engine step {saved} but the "
                                 f"checkpoint's own files are from step {engine_step}: the tag holds parts of two "
                                 "saves (an interrupted save into an existing tag?)")


@torch.no_grad()
def cast_mismatch(saved: Mapping[str, Any], cfg: FairCastConfig, where: str) -> str | None:
    """How a saved state's mode or seed differs from this run's ``cfg`` (``where``: what was saved, e.g.
    "checkpoint <dir>"), first mode then seed; None when both match: a state is only valid for its cast."""
    for what in ("mode", "seed"):
        if saved[what] != getattr(cfg, what):
            return f"{where} was saved with fair_cast.{what}={saved[what]!r}, this run has {getattr(cfg, what)!r}"
    return None


def restore_state(adapter: Adapter, caster: ShardCaster, tag_dir: str, *, engine_step: int | None = None) -> int:
    """Restore this rank's state from ``tag_dir`` (any saved world size or stage); returns the step.

    Local only (no collective), so that a failure on one rank can be agreed on before anyone
    communicates; call :func:`publish_restored` on every rank afterwards. Raises FairCastStateError
    on any mismatch, including a state saved at another ``engine_step`` than the framework's files."""
    cfg = caster.config
    records = read_records(tag_dir)
    first = records[0][1]
    mismatch = cast_mismatch(first, cfg, f"checkpoint {tag_dir}")
    if mismatch is not None:
        raise FairCastStateError(mismatch)
    check_engine_step(records, tag_dir, engine_step)
    step = int(first["step"])
    index = _index(records)
    values = cfg.spec.residual
    verified: set[tuple[str, int]] = set()
    changed = 0  # served elements whose bits the restore changed (what the framework's load had put there)
    for key, master, served, group_slices in adapter.flat_groups():
        residual = caster.residual_for(key, master)
        for s in group_slices:
            if s.is_padding:
                continue
            covered = 0
            for p in index.get(s.name, []):
                lo, hi = max(s.start, p.start), min(s.start + s.numel, p.start + p.numel)
                if lo >= hi:
                    continue
                covered += hi - lo
                if not values:
                    continue
                dst = s.offset + lo - s.start
                res_out, bits_out = residual.narrow(0, dst, hi - lo), served.detach().narrow(0, dst, hi - lo)
                master_in = master.detach().view(-1).narrow(0, dst, hi - lo)
                if p.by_neighbour:
                    _check_masters(p, lo - p.start, master_in)
                if lo == p.start and hi == p.start + p.numel and (p.file, p.offset) not in verified:
                    # the same layout as saved: one pass over the piece
                    changed += _copy_verified(p, res_out, bits_out, master_in)
                    verified.add((p.file, p.offset))
                    continue
                _verified(p, verified)
                src = p.offset + lo - p.start
                res_out.copy_(p.record["residual"].narrow(0, src, hi - lo))
                if p.by_neighbour:
                    changed += _rebuild_bits(bits_out, master_in, p, lo - p.start)
                else:
                    changed += _copy_bits(bits_out, p.record["served"].narrow(0, src, hi - lo))
            if covered != s.numel:
                raise FairCastStateError(f"checkpoint {tag_dir} does not cover {s.name} elements "
                                         f"[{s.start}, {s.start + s.numel}) (covered {covered})")
        previous = adapter.previous(key)
        if values and previous is not None:
            previous.copy_(served.detach())
    caster.step = step
    caster.failed = None
    adapter.restore_changed = changed if values else None
    for observer in caster.observers:
        if hasattr(observer, "restore_checkpoint_state"):
            why = observer.restore_checkpoint_state([r.get("diagnostics") for _, r in records], adapter.flat_groups())
            if why is not None:
                print(f"[fair_cast] diagnostics start over from step {step}: {why}; the lag reads short for the "
                      f"next {observer.config.horizon} steps", file=sys.stderr, flush=True)
    return step


@torch.no_grad()
def publish_restored(adapter: Adapter, caster: ShardCaster) -> None:
    """Collective second half of a restore: make the model serve exactly what it served at save time."""
    if caster.config.spec.residual:
        for key, _, served, slices in adapter.flat_groups():  # written by the restore, not a cast: still ours
            caster.restored(key, served, slices)
        # the saved served bits are already in the shards: gathered, unless an adapter knows the gather
        # changes nothing (ZeRO-1/2, when the restore changed no rank's bits)
        adapter.publish_restored(getattr(adapter, "restore_changed", None))
    else:
        # deterministic in (seed, step, name, index): the bits served at save time
        adapter.recast_and_publish(after_load=True)


@torch.no_grad()
def reset_state(adapter: Adapter, caster: ShardCaster, step: int) -> None:
    """Start over from the restored masters: zero residual, noise step ``step``."""
    caster.residuals.clear()
    caster.step = step
    caster.failed = None
    adapter.recast_and_publish()


class SavedCast:
    """What a checkpoint's run served, parameter by parameter, for loads that rebuild the master from
    the model's bf16 weights (a module-only load): given a parameter's whole fp32 master from the
    checkpoint, :meth:`served` returns its served bf16 values. With the checkpoint's Fair Cast state
    (``records``) that is the cast at the saved (mode, seed, step), or for ``error_feedback`` the saved
    served bits; without it, the cast this run's ``config`` gives at ``step`` (the whole state of every
    mode but ``error_feedback``; round-to-nearest, a zero residual, for ``error_feedback``)."""

    def __init__(self, records: list[tuple[str, dict[str, Any]]] | None, config: FairCastConfig,
                 step: int | None = None) -> None:
        self.records = records
        if records is not None:
            first = records[0][1]
            self.mode, self.seed, self.step = first["mode"], int(first["seed"]), int(first["step"])
            self._index = _index(records)
        else:
            if step is None:
                raise ValueError("SavedCast without a checkpoint's state needs the step")
            self.mode, self.seed, self.step = config.mode, config.seed, int(step)
            self._index = {}
        self._verified: set[tuple[str, int]] = set()

    @torch.no_grad()
    def served(self, name: str, master: torch.Tensor) -> torch.Tensor:
        flat = master.detach().reshape(-1).to(torch.float32)
        if spec(self.mode).residual and self.records is not None:
            bits = torch.full((flat.numel(),), -1, dtype=torch.int64)
            covered = 0
            for p in self._index.get(name, []):
                _verified(p, self._verified)
                if p.by_neighbour:  # rebuilt from this load's fp32 masters
                    _check_masters(p, 0, flat[p.start:p.start + p.numel])
                    bits[p.start:p.start + p.numel] = saved_bits(_patterns(p, flat[p.start:p.start + p.numel], 0))
                else:
                    bits[p.start:p.start + p.numel] = saved_bits(p.record["served"].narrow(0, p.offset, p.numel))
                covered += p.numel
            if covered != flat.numel():
                raise FairCastStateError(f"the checkpoint's Fair Cast state covers {covered} of {flat.numel()} "
                                         f"elements of {name}")
            out = bf16_from_bits(bits)
        elif spec(self.mode).residual:  # no saved residual: what a zero residual serves
            out = spec(self.mode).rule(flat, None, torch.zeros_like(flat))
        else:
            out = cast(flat, self.mode, seed=self.seed, step=self.step, name=name, start=0)
        return out.reshape(master.shape)
