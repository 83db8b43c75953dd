"""``faircast-ds inspect``: what a checkpoint's Fair Cast state or an export holds, per parameter group.

A checkpoint tag directory (``<tag>/fair_cast/rank*-of-*.pt``, see :mod:`faircast_ds.shard.state`):
mode, seed, noise step, element counts and, for ``error_feedback``, the mean |residual| in units of
the bf16 spacing at the served value.

An export directory (safetensors, e.g. from :func:`faircast_ds.export.save_hf`): dtypes, shapes,
element counts, the SHA-256 check against ``faircast_export.json``, and, given the checkpoint of
the same step, the mean |master - served| in units of the bf16 spacing at the master (the masters read
one parameter at a time by the framework's reader: ``faircast_ds.deepspeed.masters`` for DeepSpeed's
``zero_to_fp32``).

Groups: ``type`` (layer indices folded: ``model.layers.*.mlp.up_proj.weight``), ``layer``
(``model.layers.0``, ``lm_head``, ...) or ``param``.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sys
from collections import defaultdict
from typing import Any, Callable

import torch

from faircast_ds.casting.bits import bf16_from_bits, bf16_spacing
from faircast_ds.casting.modes import spec
from faircast_ds.export.hf import EXPORT_FORMAT, MANIFEST
from faircast_ds.export.safetensors_stream import read_header, read_tensor
from faircast_ds.shard.state import FairCastStateError, read_records, saved_bits, state_dir

GROUPINGS = ("type", "layer", "param")


def group_of(name: str, by: str) -> str:
    if by == "param":
        return name
    if by == "type":
        return re.sub(r"\.\d+(?=\.|$)", ".*", name)
    m = re.match(r"^(.*?\.\d+)(\.|$)", name)
    return m.group(1) if m else name.rsplit(".", 1)[0]


class _Acc:
    """Running sums for one group."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.elements = 0
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.dtypes: dict[str, int] = defaultdict(int)
        self.shapes: dict[str, list[int]] = {}

    def add(self, stat: str, values: torch.Tensor) -> None:
        self.add_sum(stat, float(values.sum()), values.numel())

    def add_sum(self, stat: str, total: float, count: int) -> None:
        self.sums[stat] += float(total)
        self.counts[stat] += int(count)

    def row(self) -> dict[str, Any]:
        row: dict[str, Any] = {"params": len(self.names), "elements": self.elements}
        if self.dtypes:
            row["dtypes"] = dict(self.dtypes)
            row["shapes"] = dict(self.shapes)
        for stat, total in self.sums.items():
            row[stat] = total / self.counts[stat] if self.counts[stat] else None
        return row


def _table(groups: dict[str, _Acc]) -> tuple[dict[str, Any], dict[str, Any]]:
    total = _Acc()
    for acc in groups.values():
        total.names |= acc.names
        total.elements += acc.elements
        for stat in acc.sums:
            total.sums[stat] += acc.sums[stat]
            total.counts[stat] += acc.counts[stat]
        for d, n in acc.dtypes.items():
            total.dtypes[d] += n
    rows = {g: groups[g].row() for g in sorted(groups)}
    summary = total.row()
    summary.pop("shapes", None)
    return rows, summary


def inspect_checkpoint(tag_dir: str, by: str = "type") -> dict[str, Any]:
    """Per group: parameters, elements, and (error_feedback) mean |residual| / spacing(served)."""
    groups: dict[str, _Acc] = defaultdict(_Acc)
    info: dict[str, Any] = {}
    files = 0
    for _, record in read_records(tag_dir):
        files += 1
        info = {k: record.get(k) for k in ("mode", "seed", "step", "zero_stage", "world_size")}
        residual, served = record["residual"], record["served"]
        has_values = spec(record["mode"]).residual and residual.numel() > 0
        offset = 0
        for entry in record["slices"]:
            acc = groups[group_of(entry["name"], by)]
            acc.names.add(entry["name"])
            acc.elements += entry["numel"]
            if has_values and "sum_abs_residual_spacings" in entry:
                # faircast-ds/3 keeps the served bits relative to the masters: the save summed this for us
                acc.add_sum("mean_abs_residual_spacings", entry["sum_abs_residual_spacings"], entry["numel"])
            elif has_values:
                r = residual.narrow(0, offset, entry["numel"]).double()
                bits = saved_bits(served.narrow(0, offset, entry["numel"]))
                sp = bf16_spacing(bf16_from_bits(bits)).double()
                acc.add("mean_abs_residual_spacings", r.abs() / sp)
            offset += entry["numel"]
    rows, total = _table(groups)
    return {"kind": "checkpoint", "path": os.path.abspath(tag_dir), **info, "rank_files": files, "by": by,
            "groups": rows, "total": total}


MastersReader = Callable[[str], Callable[[str], "torch.Tensor | None"]]
"""tag folder -> (parameter name -> its full fp32 master, or None): how a framework's checkpoint keeps
its masters (DeepSpeed's: ``faircast_ds.deepspeed.masters.reader``)."""


def inspect_export(export_dir: str, checkpoint: str | None = None, by: str = "type",
                   masters: MastersReader | None = None) -> dict[str, Any]:
    """Per group: parameters, elements, dtypes and shapes; with ``checkpoint`` (read by ``masters``),
    mean |master - served| in bf16 spacings at the master."""
    if checkpoint and masters is None:
        raise ValueError("--checkpoint: no reader for this checkpoint's fp32 masters was given")
    files = sorted(glob.glob(os.path.join(export_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {export_dir}")
    manifest_path = os.path.join(export_dir, MANIFEST)
    manifest = json.loads(open(manifest_path).read()) if os.path.exists(manifest_path) else None
    integrity = None
    if manifest is not None and manifest.get("format") == EXPORT_FORMAT:
        bad = [f for f, meta in manifest["files"].items() if _sha256(os.path.join(export_dir, f)) != meta["sha256"]]
        listed = set(manifest["files"])
        bad += [os.path.basename(f) + " (not in manifest)" for f in files if os.path.basename(f) not in listed]
        integrity = "ok" if not bad else f"MISMATCH: {bad}"
    read = masters(checkpoint) if checkpoint else None
    groups: dict[str, _Acc] = defaultdict(_Acc)
    missing_masters = []
    for path in files:
        start, header = read_header(path)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            acc = groups[group_of(name, by)]
            acc.names.add(name)
            numel = 1
            for d in entry["shape"]:
                numel *= d
            acc.elements += numel
            acc.dtypes[entry["dtype"]] += numel
            acc.shapes[name] = entry["shape"]
            if read is None:
                continue
            master = read(name)
            if master is None:
                missing_masters.append(name)
                continue
            served = read_tensor(path, start, entry).double().reshape(-1)
            m = master.reshape(-1)
            gap = (m.double() - served).abs() / bf16_spacing(m.float()).double()
            acc.add("mean_abs_master_minus_served_spacings", gap)
    rows, total = _table(groups)
    report = {"kind": "export", "path": os.path.abspath(export_dir), "files": len(files), "integrity": integrity,
              "version": manifest.get("version") if manifest else None,
              "fair_cast": manifest.get("fair_cast") if manifest else None, "by": by, "groups": rows, "total": total}
    if checkpoint:
        report["checkpoint"] = os.path.abspath(checkpoint)
        report["missing_masters"] = missing_masters
    return report


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def inspect_path(path: str, checkpoint: str | None = None, by: str = "type",
                 masters: MastersReader | None = None) -> dict[str, Any]:
    """Inspect a checkpoint tag directory or an export directory (recognized by their contents);
    ``masters``: reads ``checkpoint``'s fp32 masters (see :func:`inspect_export`)."""
    if by not in GROUPINGS:
        raise ValueError(f"by must be one of {GROUPINGS}")
    if os.path.isdir(state_dir(path)):
        if checkpoint:
            raise ValueError("--checkpoint goes with an export directory; PATH is a checkpoint")
        return inspect_checkpoint(path, by)
    if glob.glob(os.path.join(path, "*.safetensors")):
        return inspect_export(path, checkpoint, by, masters)
    raise FileNotFoundError(f"{path} is neither a checkpoint tag directory (no fair_cast/) nor an export "
                            "(no *.safetensors)")


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.4f}" if isinstance(x, float) else str(x)


def format_report(report: dict[str, Any]) -> str:
    """The report as text: a header and one table row per group."""
    lines = []
    if report["kind"] == "checkpoint":
        lines.append(f"checkpoint {report['path']}: mode={report['mode']} seed={report['seed']} step={report['step']} "
                     f"zero_stage={report['zero_stage']} world_size={report['world_size']}")
        cols = [("params", "params"), ("elements", "elements"),
                ("mean_abs_residual_spacings", "mean |residual| (bf16 spacings)")]
    else:
        fc = report["fair_cast"]
        lines.append(f"export {report['path']}: {report['files']} file(s), version={report['version']}, "
                     f"fair_cast={fc if fc else '-'}, sha256 {report['integrity'] or 'not checked (no manifest)'}")
        if report.get("checkpoint"):
            lines.append(f"masters from {report['checkpoint']}"
                         + (f" ({len(report['missing_masters'])} parameters without a master)"
                            if report["missing_masters"] else ""))
        cols = [("params", "params"), ("elements", "elements"), ("dtypes", "dtype"), ("shapes", "shape")]
        if report.get("checkpoint"):
            cols.append(("mean_abs_master_minus_served_spacings", "mean |master - served| (bf16 spacings)"))
    rows = [{**r, "group": g} for g, r in report["groups"].items()] + [{**report["total"], "group": "TOTAL"}]
    header = ["group"] + [title for _, title in cols]
    table = [header]
    for r in rows:
        cells = [r["group"]]
        for key, _ in cols:
            v = r.get(key)
            if key == "dtypes" and v:
                v = ",".join(sorted(v))
            elif key == "shapes" and v:
                shapes = sorted({"x".join(map(str, s)) for s in v.values()})
                v = ",".join(shapes[:3]) + (f" (+{len(shapes) - 3})" if len(shapes) > 3 else "")
            cells.append(_fmt(v))
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(path: str, checkpoint: str | None, by: str, as_json: bool, masters: MastersReader | None = None) -> int:
    try:
        report = inspect_path(path, checkpoint, by, masters)
    except (FileNotFoundError, ValueError, FairCastStateError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if as_json else format_report(report))
    return 0 if report.get("integrity") in (None, "ok") else 1
