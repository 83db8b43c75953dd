"""Flattened buckets: a rank's served slices moved through a few fixed-size buffers instead of one
staging copy of the whole model (issue 32 item 7, the shape GPU transports use: an engine on a GPU cannot
spare a second copy of the model, so it lends a bucket or two of device memory and loads what each
carries).

**Prepared GPU code, out of the push path.** No push imports this module (``tests/test_layout.py`` checks
that no module of ``faircast_ds/vllm/`` does, nor any module a push loads): it is the shape a GPU transport
would take, run today only by ``benchmarks/gpu_buckets.py``, ``benchmarks/gpu_check.py`` and
``tests/export/test_buckets.py``. The pushes into ``vllm serve`` stage the whole model instead
(:mod:`faircast_ds.vllm.transfer.planes`).

Pure planning and copying, on whatever device the tensors are: no transport, no socket, no CUDA call.
:func:`plan` cuts a rank's write list — ``(param index, start element, numel)`` of the served parameters,
the same pieces the shared-memory plane writes at their :class:`~faircast_ds.export.plane.Layout` offsets —
into buckets of at most ``bucket_bytes``. A piece larger than a bucket is split at an element boundary;
every copy starts on an ``align``-byte boundary of its bucket. Both ends compute the same plan from the
same layout and write list, so only the bucket's number crosses the wire with its bytes.

:func:`pack` fills a bucket buffer from the rank's values; :func:`unpack` writes a filled bucket into a
:class:`~faircast_ds.export.plane.Segment` (the engine's staging, a host segment in the tests) at the
layout's offsets. Packing every bucket and unpacking it writes exactly what writing the pieces in place
writes (``tests/export/test_buckets.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from faircast_ds.export.plane import ALIGN, Layout, PlaneError, Segment, element_size


@dataclass(frozen=True)
class Copy:
    """One contiguous run of one piece inside one bucket."""

    piece: int  # position in the rank's write list
    element: int  # first element of the piece that this copy carries (0: the piece's own start)
    numel: int
    segment_offset: int  # bytes: where these elements live in the staging layout
    bucket_offset: int  # bytes: where they sit in the bucket
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    copies: tuple[Copy, ...]
    nbytes: int  # bytes of the bucket in use (the last copy's end)

    @property
    def payload(self) -> int:
        """Bytes of served values it carries (``nbytes`` less the alignment gaps)."""
        return sum(c.nbytes for c in self.copies)


def plan(layout: Layout, pieces: Sequence[tuple[int, int, int]], bucket_bytes: int,
         align: int = ALIGN) -> list[Bucket]:
    """The buckets that carry ``pieces`` (``(param index, start element, numel)``, in write order) with at
    most ``bucket_bytes`` each; pieces keep their order and fill buckets front to back."""
    if type(bucket_bytes) is not int or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    if type(align) is not int or align <= 0 or align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align!r}")
    buckets: list[Bucket] = []
    copies: list[Copy] = []
    at = 0  # bytes used in the bucket being filled

    def close() -> None:
        nonlocal copies, at
        if copies:
            buckets.append(Bucket(tuple(copies), at))
        copies, at = [], 0

    for k, (index, start, numel) in enumerate(pieces):
        offset, _ = layout.span(index, start, numel)  # ValueError outside the layout or the parameter
        size = element_size(layout.specs[index].dtype)
        if size > bucket_bytes:
            raise ValueError(f"bucket_bytes {bucket_bytes} cannot hold one {size}-byte element")
        done = 0
        while done < numel:
            begin = -(-at // align) * align
            room = (bucket_bytes - begin) // size if begin < bucket_bytes else 0
            if room <= 0:
                close()  # an empty bucket starts at 0, where one element always fits
                continue
            n = min(room, numel - done)
            copies.append(Copy(k, done, n, offset + done * size, begin, n * size))
            at = begin + n * size
            done += n
    close()
    return buckets


def pack(bucket: Bucket, values: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copy the bucket's runs from ``values`` (the pieces' tensors, in the write list's order) into the
    uint8 buffer ``out`` (at least ``bucket.nbytes`` long, on any device)."""
    _check_buffer(out, bucket)
    for c in bucket.copies:
        flat = values[c.piece].detach().reshape(-1)
        src = flat.narrow(0, c.element, c.numel).view(torch.uint8)
        out.narrow(0, c.bucket_offset, c.nbytes).copy_(src)


def unpack(bucket: Bucket, src: torch.Tensor, segment: Segment) -> int:
    """Write a filled bucket (``src``, uint8) into ``segment`` at the layout's offsets; bytes written."""
    _check_buffer(src, bucket)
    written = 0
    for c in bucket.copies:
        segment.bytes_at(c.segment_offset, c.nbytes).copy_(src.narrow(0, c.bucket_offset, c.nbytes))
        written += c.nbytes
    return written


def check_values(layout: Layout, pieces: Sequence[tuple[int, int, int]], values: Sequence[torch.Tensor]) -> None:
    """Refuse values that do not match the write list (count, dtype, element count): a bucket would carry
    another parameter's bytes."""
    if len(values) != len(pieces):
        raise PlaneError(f"{len(values)} value tensors for {len(pieces)} pieces")
    for (index, start, numel), v in zip(pieces, values):
        spec = layout.specs[index]
        if v.dtype != spec.dtype or v.numel() != numel:
            raise PlaneError(f"{spec.name} [{start}, {start + numel}): values are {v.dtype} x {v.numel()}, "
                             f"the layout says {spec.dtype} x {numel}")


def _check_buffer(buf: torch.Tensor, bucket: Bucket) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < bucket.nbytes:
        raise ValueError(f"a bucket buffer is 1-D uint8 of at least {bucket.nbytes} bytes, got {buf.dtype} "
                         f"{tuple(buf.shape)}")
