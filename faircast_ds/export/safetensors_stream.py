"""Writing safetensors files one tensor at a time.

The safetensors format is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range, then the raw little-endian bytes. Shapes and dtypes are known
before any data is read (:func:`faircast_ds.export.source.served_specs`), so the header is written
first and the data streamed after it: the writer never holds more than the tensor it is handed.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Sequence

import torch

DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(entries: Sequence[TensorEntry], max_shard_bytes: int) -> list[list[TensorEntry]]:
    """Split entries, in order, into files of at most ``max_shard_bytes`` (a larger tensor gets a file
    of its own)."""
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return [s for s in shards if s]


def shard_file_names(count: int, stem: str = "model") -> list[str]:
    """Hugging Face's names: ``model.safetensors`` or ``model-00001-of-00003.safetensors``."""
    if count == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


@dataclass
class SafetensorsFile:
    """One safetensors file written in ``entries`` order; call :meth:`write` once per entry, then
    :meth:`close` (which checks that every entry was written and fsyncs)."""

    path: str
    entries: Sequence[TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)
    sha256: str = ""
    size: int = 0

    def __post_init__(self) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt", **self.metadata}}
        offset = 0
        for e in self.entries:
            if e.dtype not in DTYPES:
                raise TypeError(f"{e.name}: dtype {e.dtype} has no safetensors equivalent")
            header[e.name] = {"dtype": DTYPES[e.dtype], "shape": list(e.shape),
                              "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the reference writer does
        self._expected_size = 8 + len(raw) + offset
        self._file: BinaryIO = open(self.path, "wb")
        self._hash = hashlib.sha256()
        self._next = 0
        self._put(struct.pack("<Q", len(raw)) + raw)

    def _put(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)
        self.size += len(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self.entries):
            raise ValueError(f"{self.path}: unexpected tensor {name!r}, all entries already written")
        e = self.entries[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != (e.name, e.shape, e.dtype):
            raise ValueError(f"{self.path}: expected {e.name} {list(e.shape)} {e.dtype}, got {name} "
                             f"{list(tensor.shape)} {tensor.dtype}")
        t = tensor.detach().to("cpu").contiguous().view(-1)
        if sys.byteorder != "little" and t.element_size() > 1:
            raise NotImplementedError("safetensors is little-endian; this machine is not")
        self._put(memoryview(t.view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.entries):
            missing = [e.name for e in self.entries[self._next:]]
            self._file.close()
            raise ValueError(f"{self.path}: {len(missing)} tensors never written, first {missing[0]!r}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        assert self.size == self._expected_size, (self.size, self._expected_size)
        self.sha256 = self._hash.hexdigest()

    def abort(self) -> None:
        self._file.close()


_TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


def read_header(path: str) -> tuple[int, dict[str, Any]]:
    """(data start offset, header) of a safetensors file; ``__metadata__`` included if present."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 * 2**20:
            raise ValueError(f"{path}: implausible safetensors header length {n}")
        return 8 + n, json.loads(f.read(n))


def read_tensor(path: str, start: int, entry: dict[str, Any]) -> torch.Tensor:
    """One tensor of a safetensors file (read from disk, nothing else loaded)."""
    dtype = _TORCH_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise TypeError(f"{path}: dtype {entry['dtype']} is not supported here")
    lo, hi = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(start + lo)
        raw = bytearray(f.read(hi - lo))
    if len(raw) != hi - lo:
        raise ValueError(f"{path}: truncated data for a tensor at [{lo}, {hi})")
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(entry["shape"]) if raw else \
        torch.zeros(entry["shape"], dtype=dtype)
