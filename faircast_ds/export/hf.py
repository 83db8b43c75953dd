"""Export the served weights as a Hugging Face model directory, atomically.

The directory holds ``config.json`` (from the model's own config, with ``architectures`` naming the
model's class when the config has none), ``generation_config.json`` when
the model has one, the weights as safetensors (one file, or shards plus
``model.safetensors.index.json``), and ``faircast_export.json``: the training step, the Fair Cast
settings, and a SHA-256 per weight file. It appears under its final name only when complete.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from faircast_ds._util.dist import from_rank0, rank_world
from faircast_ds.export.atomic import AtomicDirectory
from faircast_ds.export.safetensors_stream import (
    SafetensorsFile,
    TensorEntry,
    plan_shards,
    shard_file_names,
)
from faircast_ds.export.served import module_of
from faircast_ds.export.source import ServedSource, fair_cast_summary

MANIFEST = "faircast_export.json"
EXPORT_FORMAT = "faircast-ds-export/1"
INDEX = "model.safetensors.index.json"


class ExportError(RuntimeError):
    """The export failed on the writing rank; nothing was published (raised on every rank)."""


@dataclass(frozen=True)
class ExportResult:
    path: str
    version: int | None
    files: dict[str, dict[str, Any]]  # file name -> {"sha256", "bytes"}
    tensors: int


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers that belong in a state dict (DeepSpeed does not partition buffers)."""
    out = []
    for prefix, m in module.named_modules():
        for name, buf in m._buffers.items():
            if buf is not None and name not in m._non_persistent_buffers_set:
                out.append((f"{prefix}.{name}" if prefix else name, buf))
    return out


def _write_config(module: torch.nn.Module, directory: Path, dtype: torch.dtype) -> None:
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config = copy.deepcopy(config)
    config.dtype = dtype  # what the weights are stored as, so from_pretrained(dtype="auto") picks it
    if not getattr(config, "architectures", None) and getattr(type(module), "config_class", None) is not None:
        # a model built from a config (not loaded) has none; without it an engine guesses the architecture
        # (vLLM loads a Qwen3 without it as the embedding model Qwen3Model, not the causal LM trained here)
        config.architectures = [type(module).__name__]
    config.save_pretrained(directory)
    generation = getattr(module, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(directory)


class _ShardedWriter:
    """Fills the planned safetensors files in order, one tensor at a time."""

    def __init__(self, directory: Path, entries: list[TensorEntry], max_shard_bytes: int,
                 metadata: dict[str, str]) -> None:
        self.directory, self.metadata = directory, metadata
        self.shards = plan_shards(entries, max_shard_bytes)
        self.names = shard_file_names(len(self.shards))
        self.file_of = {e.name: self.names[i] for i, shard in enumerate(self.shards) for e in shard}
        self.open: tuple[str, SafetensorsFile] | None = None
        self.written: dict[str, dict[str, Any]] = {}

    def put(self, name: str, tensor: torch.Tensor) -> None:
        target = self.file_of[name]
        if self.open is None or self.open[0] != target:
            self._close_open()
            shard = self.shards[self.names.index(target)]
            self.open = (target, SafetensorsFile(str(self.directory / target), shard, metadata=self.metadata))
        self.open[1].write(name, tensor)

    def _close_open(self) -> None:
        if self.open is not None:
            name, f = self.open
            self.open = None
            f.close()
            self.written[name] = {"sha256": f.sha256, "bytes": f.size}

    def finish(self) -> None:
        self._close_open()
        if len(self.names) > 1:
            total = sum(e.nbytes for shard in self.shards for e in shard)
            index = {"metadata": {"total_size": total}, "weight_map": self.file_of}
            (self.directory / INDEX).write_text(json.dumps(index, indent=2))

    def abort(self) -> None:
        if self.open is not None:
            self.open[1].abort()
            self.open = None


def save_hf(model: Any, path: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30,
            version: int | None = None, source: ServedSource | None = None) -> ExportResult:
    """Write the served weights of ``model`` (a DeepSpeed engine or an ``nn.Module``) as a Hugging Face
    directory at ``path``. A collective: call it on every rank; rank 0 writes.

    Memory: one parameter at a time (one dense walk of :class:`~faircast_ds.export.source.ServedSource`). Atomic: ``path`` is either absent,
    the previous complete export, or this complete export, whenever the writer stops. ``version``
    defaults to the engine's ``global_steps``. Raises :class:`ExportError` on every rank if rank 0
    failed; nothing is published then. ``source``: the served-weight source to read (default: the
    model's own, read by the reader its integration provided, :func:`~faircast_ds.export.source.reader_of`;
    a reader given directly: ``ServedSource(reader=...)``).
    """
    module = module_of(model)
    if version is None:
        version = getattr(model, "global_steps", None)
    rank, _ = rank_world()
    if source is None:
        source = ServedSource(model, delta=False)  # an export is whole: no baseline kept
    specs = source.specs
    buffers = persistent_buffers(module)
    entries = [TensorEntry(s.name, s.shape, s.dtype) for s in specs]
    entries += [TensorEntry(n, tuple(b.shape), b.dtype) for n, b in buffers]
    error: str | None = None
    staging: AtomicDirectory | None = None
    writer: _ShardedWriter | None = None
    if rank == 0:
        try:
            staging = AtomicDirectory(path)
            metadata = {"faircast_version": str(version)} if version is not None else {}
            writer = _ShardedWriter(staging.path, entries, max_shard_bytes, metadata)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = f"cannot stage the export beside {path}: {exc!r}"
    # every rank walks the parameters (ZeRO-3 gathers are collectives); only rank 0 writes
    for item in source.walk("dense", version=version):
        if writer is not None and error is None:
            try:
                writer.put(item.name, item.tensor)
            except Exception as exc:  # noqa: BLE001
                error = f"writing {item.name}: {exc!r}"
    if writer is not None and error is None:
        try:
            for name, buf in buffers:
                writer.put(name, buf)
            writer.finish()
            dtypes = [s.dtype for s in specs]
            _write_config(module, staging.path, max(dtypes, key=dtypes.count) if dtypes else torch.bfloat16)
            manifest = {"format": EXPORT_FORMAT, "version": version, "fair_cast": fair_cast_summary(source.reader),
                        "tensors": len(entries), "parameters": len(specs), "files": writer.written}
            (staging.path / MANIFEST).write_text(json.dumps(manifest, indent=1))
            staging.commit()
        except Exception as exc:  # noqa: BLE001
            error = f"finishing the export: {exc!r}"
    if error is not None and staging is not None:
        if writer is not None:
            writer.abort()
        staging.discard()
    error, written = from_rank0((error, writer.written if writer is not None else None))
    if error is not None:
        raise ExportError(f"export to {path} failed on rank 0, nothing was published: {error}")
    return ExportResult(str(Path(path).absolute()), version, written, len(entries))
