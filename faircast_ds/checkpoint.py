"""Fair Cast's durable state inside a DeepSpeed checkpoint.

What a checkpoint tag directory gains: ``<tag>/fair_cast/rank<r>-of-<n>.pt``, one file per rank,
written (atomically) before DeepSpeed writes its own files, so ``latest`` never points at a
checkpoint without them. Each file holds the mode, seed and noise step, and, for
``error_feedback``, every local slice's residual (fp32) and served bits (bf16) keyed by
(parameter name, start index) with a CRC32 per slice. Because the key is (parameter, index) and
not (rank, offset), a checkpoint saved at one world size or ZeRO stage restores at any other: each
rank reads only the pieces that overlap its own slices (files are memory-mapped, so no rank reads
the whole model's residual).

Restoring reproduces the served copy bit for bit: ``stochastic``/``dither``/``nearest`` recompute it
from the restored fp32 master at the saved step; ``error_feedback`` puts back the saved served
bits and residual (the served value depends on the residual before the last cast, which is gone).
"""
from __future__ import annotations

import glob
import os
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from faircast_ds.adapter import Adapter
from faircast_ds.casts import bf16_bits, bf16_from_bits
from faircast_ds.shard_caster import ShardCaster

FORMAT = "faircast-ds/1"
STATE_DIR = "fair_cast"


class FairCastStateError(RuntimeError):
    """The checkpoint's Fair Cast state is missing, from another configuration, or corrupted."""


def state_dir(tag_dir: str) -> str:
    return os.path.join(tag_dir, STATE_DIR)


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


def save_state(adapter: Adapter, caster: ShardCaster, tag_dir: str, *, rank: int, world: int) -> str:
    """Write this rank's Fair Cast state under ``tag_dir``; returns the file written."""
    cfg = caster.config
    keep_values = cfg.mode == "error_feedback"
    slices, residuals, served_bits = [], [], []
    for key, master, served, group_slices in adapter.flat_groups():
        residual = caster.residuals.get(key)
        for s in group_slices:
            if s.is_padding:
                continue
            entry: dict[str, Any] = {"name": s.name, "start": s.start, "numel": s.numel}
            if keep_values:
                res = (residual.narrow(0, s.offset, s.numel) if residual is not None
                       else torch.zeros(s.numel, dtype=torch.float32))
                bits = bf16_bits(served.detach().narrow(0, s.offset, s.numel)).to(torch.int32).cpu()
                entry.update(crc_residual=_crc(res), crc_served=_crc(bits))
                residuals.append(res.detach().cpu())
                served_bits.append(bits)
            slices.append(entry)
    payload = {
        "format": FORMAT, "mode": cfg.mode, "seed": cfg.seed, "step": caster.step,
        "zero_stage": adapter.zero_stage, "rank": rank, "world_size": world, "slices": slices,
        "residual": torch.cat(residuals) if residuals else torch.zeros(0),
        "served": torch.cat(served_bits) if served_bits else torch.zeros(0, dtype=torch.int32),
    }
    directory = state_dir(tag_dir)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank{rank:05d}-of-{world:05d}.pt")
    torch.save(payload, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


@dataclass
class _Piece:
    start: int
    numel: int
    record: dict[str, Any]
    offset: int  # in the record's concatenated residual/served arrays
    entry: dict[str, Any]
    file: str


def read_records(tag_dir: str) -> list[tuple[str, dict[str, Any]]]:
    """Every rank file of a tag directory's Fair Cast state, checked for format and completeness
    (memory-mapped: nothing is read until used)."""
    files = sorted(glob.glob(os.path.join(state_dir(tag_dir), "rank*-of-*.pt")))
    if not files:
        raise FairCastStateError(f"no Fair Cast state in {state_dir(tag_dir)} (checkpoint saved without fair_cast?)")
    records = []
    for f in files:
        try:
            record = torch.load(f, mmap=True, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is corruption, named below
            raise FairCastStateError(f"cannot read Fair Cast state file {f}: {exc}") from exc
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise FairCastStateError(f"{f} is not a {FORMAT} state file")
        records.append((f, record))
    worlds = {r["world_size"] for _, r in records}
    if len(worlds) != 1 or len(records) != worlds.pop():
        raise FairCastStateError(f"{state_dir(tag_dir)} holds {len(records)} rank files of inconsistent world sizes; "
                                 "a rank's file is missing")
    return records


def _index(records: list[tuple[str, dict[str, Any]]]) -> dict[str, list[_Piece]]:
    index: dict[str, list[_Piece]] = {}
    for f, record in records:
        offset = 0
        for entry in record["slices"]:
            index.setdefault(entry["name"], []).append(_Piece(entry["start"], entry["numel"], record, offset, entry, f))
            offset += entry["numel"]
    return index


@torch.no_grad()
def restore_state(adapter: Adapter, caster: ShardCaster, tag_dir: str) -> int:
    """Restore this rank's state from ``tag_dir`` (any saved world size or stage); returns the step.

    Local only (no collective), so that a failure on one rank can be agreed on before anyone
    communicates; call :func:`publish_restored` on every rank afterwards. Raises FairCastStateError
    on any mismatch."""
    cfg = caster.config
    records = read_records(tag_dir)
    first_file, first = records[0]
    for what in ("mode", "seed"):
        if first[what] != getattr(cfg, what):
            raise FairCastStateError(f"checkpoint {tag_dir} was saved with fair_cast.{what}={first[what]!r}, "
                                     f"this run has {getattr(cfg, what)!r}")
    step = int(first["step"])
    index = _index(records)
    values = cfg.mode == "error_feedback"
    verified: set[tuple[str, int]] = set()
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
                res_all, bits_all = p.record["residual"], p.record["served"]
                if (p.file, p.offset) not in verified:
                    whole_res = res_all.narrow(0, p.offset, p.numel)
                    whole_bits = bits_all.narrow(0, p.offset, p.numel)
                    if _crc(whole_res) != p.entry["crc_residual"] or _crc(whole_bits) != p.entry["crc_served"]:
                        raise FairCastStateError(f"{p.file}: CRC mismatch for {s.name} [{p.start}, "
                                                 f"{p.start + p.numel}): the state file is corrupted")
                    verified.add((p.file, p.offset))
                src = p.offset + lo - p.start
                dst = s.offset + lo - s.start
                residual.narrow(0, dst, hi - lo).copy_(res_all.narrow(0, src, hi - lo))
                served.narrow(0, dst, hi - lo).data.copy_(bf16_from_bits(bits_all.narrow(0, src, hi - lo).to(torch.int64)))
            if covered != s.numel:
                raise FairCastStateError(f"checkpoint {tag_dir} does not cover {s.name} elements "
                                         f"[{s.start}, {s.start + s.numel}) (covered {covered})")
        previous = adapter.previous(key)
        if values and previous is not None:
            previous.copy_(served.detach())
    caster.step = step
    return step


@torch.no_grad()
def publish_restored(adapter: Adapter, caster: ShardCaster) -> None:
    """Collective second half of a restore: make the model serve exactly what it served at save time."""
    if caster.config.mode == "error_feedback":
        adapter.publish()  # the saved served bits are already in the shards
    else:
        adapter.recast_and_publish()  # deterministic in (seed, step, name, index): the bits served at save time


@torch.no_grad()
def reset_state(adapter: Adapter, caster: ShardCaster, step: int) -> None:
    """Start over from the restored masters: zero residual, noise step ``step``."""
    caster.residuals.clear()
    caster.step = step
    adapter.recast_and_publish()
