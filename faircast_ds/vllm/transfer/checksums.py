"""Checksums of the bits an engine computes with, on both sides of vLLM's ``/weight_checker``.

Engine side (:func:`kernel_checksums`, installed over ``Worker.compute_weight_checksums`` by the
plugin, :func:`install_checksums`): vLLM hashes each parameter's storage, but on CPU the oneDNN
linear kernels repack their weights and leave ``.weight`` empty (every linear layer then hashes to
SHA-256 of no bytes), and the CPU LM head computes with a packed copy. So every parameter is hashed
from what its kernel computes with: a linear layer (and the LM head) is applied through its own
``quant_method`` to identity rows, an embedding is looked up for every id, and the rest (norm
weights, biases) are read as tensors; the bits are canonical (:mod:`faircast_ds.vllm.bits`: ±0 and
subnormals count as +0, what the kernels flush them to). The keys stay vLLM's
(``dp0:pp0:pcp0:tp0:`` + the vLLM parameter name) so ``action="compare"`` works unchanged.

Trainer side (:func:`served_checksums`): the same checksums from the served weights alone, with no
vLLM code — fused vLLM layers are the concatenation of their HF parts (``qkv_proj`` = q, k, v;
``gate_up_proj`` = gate, up) along the output dimension.

Column samples. Reading a linear layer back costs a GEMM of ``in`` identity rows (``2 x in x
params`` FLOPs: about 1.7 TFLOP for Qwen3-0.6B, seconds on a CPU and more than the push it checks).
A sampled checksum reads ``k`` input columns of every matrix instead (``k`` identity rows, exact
bits; :func:`sample_columns`): evenly spaced, from an offset hashed from the layer's name and the
weight version it was loaded at, so the columns move with every update of the layer. Its digest
is ``cols<k>@v<version>:<sha256>``, never equal to a whole tensor's. The embedding is sampled by rows
the same way (:func:`sample_rows`: the ids looked up, evenly spaced from a hashed offset, as many as make the
same share of its elements as ``k`` columns are of a matrix of its width; ``rows<n>@v<version>:<sha256>``).
Vectors (norms, biases) are always read whole. Sampled checks run inside the ``faircast``
backend's ``finish_weight_update`` (:func:`staging_check`, the loaded layers against the staging copy),
where both sides are in one process: there the sampled bits are compared directly (:class:`Reading`), not
hashed. ``/weight_checker`` always answers whole, in digests.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Iterable, Iterator, Mapping

import torch

from faircast_ds.vllm import fused
from faircast_ds.vllm.bits import bit_pattern, canonical
from faircast_ds.vllm.engine_weights import TIED_HEAD, kernel_tensors, ties_head

SAMPLE_COLUMNS = 64  # input columns per matrix in a sampled check


# the exponent field of the float dtypes whose canonical form is computed on their bits
_EXPONENT = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
             torch.float32: (torch.int32, 0x7F800000)}
_HASH_CHUNK = 1 << 24  # elements hashed at a time


def checksum(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's canonical bits (contiguous, little-endian), what both sides hash.

    For bf16, fp16 and fp32 the canonical form is taken on the bits (an element whose exponent field
    is zero — ±0 or a subnormal — hashes as +0), a chunk at a time and without a bytes copy; the
    digest is the same as hashing :func:`~faircast_ds.vllm.bits.canonical`'s bit pattern."""
    t = t.detach()
    if t.dtype not in _EXPONENT:
        return hashlib.sha256(bit_pattern(canonical(t)).numpy().tobytes()).hexdigest()
    itype, exponent = _EXPONENT[t.dtype]
    bits = t.contiguous().view(-1).cpu().view(itype)
    h = hashlib.sha256()
    for at in range(0, bits.numel(), _HASH_CHUNK):
        h.update(_flushed(bits.narrow(0, at, min(_HASH_CHUNK, bits.numel() - at)), exponent).numpy())
    return h.hexdigest()


def _flushed(bits: torch.Tensor, exponent: int) -> torch.Tensor:
    """Float bits (as integers) with every element whose ``exponent`` field is zero (±0, subnormals) set to +0."""
    return torch.where((bits & exponent) == 0, 0, bits)


class Reading:
    """A reading kept as its bits instead of a digest, for a check whose two sides live in one process (the
    engine's :func:`staging_check`): equal to another when both read the same thing (``label``: whole, or
    what was sampled, how many and at which version) and their canonical bits are equal, compared directly
    (no hash: SHA-256 ran at ~0.6 GB/s on each side here). Raw bits are compared first; only when they differ
    are ±0 and subnormals flushed, as :func:`checksum` does. Stricter than a digest in one way: the dtype and
    shape must agree too (a digest sees only the bytes). The bits are a copy, never a view of the input."""

    __slots__ = ("label", "dtype", "bits")

    def __init__(self, label: str, t: torch.Tensor) -> None:
        source = t.detach()
        t = source.cpu().contiguous()
        if t.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
            t = t.clone()  # never a view of the caller's tensor: a walk may reuse it for the next one
        self.label, self.dtype = label, t.dtype
        self.bits = t.view(_EXPONENT[t.dtype][0]) if t.dtype in _EXPONENT else t

    def _canonical(self) -> torch.Tensor:
        if self.dtype in _EXPONENT:
            return _flushed(self.bits, _EXPONENT[self.dtype][1])
        return bit_pattern(canonical(self.bits))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Reading):
            return NotImplemented
        if self.label != other.label or self.dtype != other.dtype or self.bits.shape != other.bits.shape:
            return False
        return torch.equal(self.bits, other.bits) or torch.equal(self._canonical(), other._canonical())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Reading({self.label}, {self.bits.dtype}{list(self.bits.shape)})"


def whole_reading(t: torch.Tensor) -> Reading:
    return Reading("whole", t)


def sampled_reading(columns: torch.Tensor, k: int, version: int, what: str = "cols") -> Reading:
    """:func:`sampled_digest`'s reading: the sampled bits themselves, tagged the same way."""
    return Reading(f"{what}{int(k)}@v{int(version)}", columns)


def sample_columns(name: str, width: int, k: int, version: int) -> torch.Tensor:
    """The ``min(k, width)`` input columns a sampled check reads of the matrix vLLM calls ``name``
    (without the rank prefix) at weight ``version``: every ``width // k``-th column from an offset
    below that stride, hashed (SHA-256) from ``"<version>:<name>"``."""
    k = max(1, min(int(k), int(width)))
    stride = width // k
    offset = int.from_bytes(hashlib.sha256(f"{int(version)}:{name}".encode()).digest()[:8], "little") % stride
    return torch.arange(k, dtype=torch.long) * stride + offset


def sampled_digest(columns: torch.Tensor, k: int, version: int, what: str = "cols") -> str:
    """The digest of a matrix's sampled columns (``[out, k]``, as read; ``what="rows"``: an embedding's
    sampled rows, ``[n, width]``): tagged with what was sampled, how many and the version."""
    return f"{what}{int(k)}@v{int(version)}:" + checksum(columns)


def embedding_rows(count: int, width: int, k: int) -> int:
    """How many of an embedding's ``count`` rows of ``width`` a sampled check reads for ``k`` columns per
    matrix: the same share of its elements as ``k`` columns are of a matrix ``width`` wide (at least one)."""
    return max(1, min(int(count), -(-int(k) * int(count) // max(1, int(width)))))


def sample_rows(name: str, count: int, width: int, k: int, version: int) -> torch.Tensor:
    """The rows (ids) of the embedding vLLM calls ``name`` that a sampled check at ``k`` columns per matrix
    looks up at weight ``version``: :func:`sample_columns` over the rows, :func:`embedding_rows` of them."""
    return sample_columns(name, count, embedding_rows(count, width, k), version)


def with_lines(sampled: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
    """The sampled columns (or rows) with ``extra`` ones added: sorted, each once; the sample as it is when
    there are none."""
    if extra is None or extra.numel() == 0:
        return sampled
    return torch.unique(torch.cat([sampled.to(torch.long), extra.to(torch.long)]))


def take_columns(t: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``t.index_select(1, columns)``; evenly spaced columns inside the matrix (a sample with nothing added)
    are taken through a strided view instead (1.6–3× faster on a wide row-major matrix here). Out-of-range
    columns go to ``index_select``, which refuses them. May return ``t`` itself when every column is taken."""
    n = columns.numel()
    if n > 1:
        first, step = int(columns[0]), int(columns[1] - columns[0])
        if step > 0 and first >= 0 and first + step * (n - 1) < t.shape[1] \
                and bool((columns == first + step * torch.arange(n)).all()):
            return t[:, first:first + step * (n - 1) + 1:step].contiguous()
    return t.index_select(1, columns)


def touched_lines(staged: Iterable[tuple[str, torch.Tensor]], touched: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                  k: int, version: int, *, tied: bool = False) -> dict[str, torch.Tensor]:
    """What a sampled check at ``k`` columns per matrix adds for an update that changed the elements
    ``touched`` names (HF name -> (rows, columns) holding one, :func:`faircast_ds.export.delta.touched_lines`):
    per vLLM name, the matrix columns (a fused layer's parts' together) or the embedding rows holding a
    changed element. Bounded like the sample itself: up to ``k`` columns per matrix and
    :func:`embedding_rows` rows of the embedding; an update that touched more gets that many of them,
    evenly spaced from an offset hashed from the version (:func:`sample_columns` over the touched lines).
    ``tied``: the engine's LM head computes with the embedding, so the embedding's touched columns are
    ``lm_head.weight``'s too."""
    lines: dict[str, list[torch.Tensor]] = {}
    limits: dict[str, int] = {}
    for name, t in staged:
        found = touched.get(name)
        if found is None:
            continue
        key = fused.vllm_name(name)
        if is_matrix(key, t):
            lines.setdefault(key, []).append(found[1])
            limits[key] = int(k)
        elif is_embedding(key, t):
            lines.setdefault(key, []).append(found[0])
            limits[key] = embedding_rows(t.shape[0], t.shape[1], k)
            if tied:
                lines.setdefault(TIED_HEAD, []).append(found[1])
                limits[TIED_HEAD] = int(k)
    out = {}
    for key, parts in lines.items():
        every = torch.unique(torch.cat([p.to(torch.long) for p in parts]))
        if every.numel() > limits[key]:
            every = every[sample_columns("touched:" + key, every.numel(), limits[key], version)]
        if every.numel():
            out[key] = every
    return out


def is_embedding(vllm_name: str, tensor: torch.Tensor) -> bool:
    """Whether the trainer side samples this tensor by rows: the token embedding (what the engine looks up)."""
    return tensor.dim() == 2 and vllm_name.endswith("embed_tokens.weight")


def is_matrix(vllm_name: str, tensor: torch.Tensor) -> bool:
    """Whether the trainer side samples this tensor: a linear layer's (or the LM head's) 2-D weight,
    what the engine reads through a kernel (the embedding is looked up whole)."""
    return tensor.dim() == 2 and vllm_name.endswith(("proj.weight", "lm_head.weight"))


class ChecksumCollector:
    """vLLM-named checksums of served HF-named tensors, added one at a time (a ZeRO-3 walk: each tensor
    valid only until the next): whole (``whole=True``) and/or sampled at ``sample=(k, version)``.
    Fused parts are kept until their group is complete — whole copies for whole checksums, only the
    sampled columns otherwise. ``tied``: whether the engine's LM head computes with the embedding (True: a
    served ``lm_head.weight`` is not counted), has a weight of its own (False), or, by default (None),
    whether no ``lm_head.weight`` was served (right for a whole walk, which serves a head when the model has
    one). A tied head is counted as the engine reports it (:func:`faircast_ds.vllm.engine_weights.kernel_tensors`):
    the embedding a second time, under ``lm_head.weight``, as a matrix (whole, or sampled by columns)."""

    def __init__(self, prefix: str = "dp0:pp0:pcp0:tp0:", *, whole: bool = True,
                 sample: tuple[int, int] | None = None, tied: bool | None = None,
                 extra: Mapping[str, torch.Tensor] | None = None, readings: bool = False) -> None:
        if not whole and sample is None:
            raise ValueError("ChecksumCollector needs whole=True or a sample")
        self.prefix, self.whole, self.sample, self.tied = prefix, whole, sample, tied
        # readings=True: :class:`Reading` values (the bits, compared in process) instead of SHA-256 digests
        self._whole_of, self._sampled_of = (whole_reading, sampled_reading) if readings else (checksum, sampled_digest)
        self.extra = extra or {}  # vLLM name -> columns (rows of the embedding) the sample also reads
        self.full: dict[str, Any] = {}  # digests (str), or Reading values with readings=True
        self.sampled: dict[str, Any] = {}
        self._waiting: dict[str, dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]] = {}
        self._head: tuple[Any, Any] | None = None  # the embedding counted as a tied head
        self._has_head = False

    def _cols(self, key: str, t: torch.Tensor) -> torch.Tensor:
        k, version = self.sample  # type: ignore[misc]
        return take_columns(t, with_lines(sample_columns(key, t.shape[1], k, version), self.extra.get(key)))

    def _finish(self, key: str, whole: torch.Tensor | None, cols: torch.Tensor | None, matrix: bool) -> None:
        if whole is not None and self.whole:
            self.full[self.prefix + key] = self._whole_of(whole)
        if self.sample is not None:
            t = whole if whole is not None else cols
            if matrix:
                self.sampled[self.prefix + key] = self._sampled_of(cols, *self.sample)
            elif is_embedding(key, t):
                k, version = self.sample
                rows = with_lines(sample_rows(key, t.shape[0], t.shape[1], k, version), self.extra.get(key))
                self.sampled[self.prefix + key] = self._sampled_of(t.index_select(0, rows), len(rows), version, "rows")
            else:
                self.sampled[self.prefix + key] = self._whole_of(t)
        if whole is not None and is_embedding(key, whole):
            # the embedding as a tied head's logits kernel computes with it, kept until done() knows whether
            # a head of its own was served; whole, the same tensor, so the same digest
            self._head = (self.full[self.prefix + key] if self.whole else None,
                          self._sampled_of(self._cols(TIED_HEAD, whole), *self.sample) if self.sample is not None
                          else None)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().cpu()
        part = fused.part_of(name)
        key = fused.vllm_name(name)
        matrix = is_matrix(key, t)
        if part is None:
            if name == TIED_HEAD and self.tied is not True:
                self._has_head = True
            if not (self.tied is True and name == TIED_HEAD):
                sampled = self._cols(key, t) if (self.sample is not None and matrix) else None
                self._finish(key, t if (self.whole or not matrix) else None, sampled, matrix)
            return
        keep_whole = self.whole or not matrix
        layer, index = part
        parts = self._waiting.setdefault(key, {})
        parts[index] = (t.clone() if keep_whole else None,
                        self._cols(key, t).clone() if (self.sample is not None and matrix) else None)
        if len(parts) == len(fused.FUSED[layer]):
            order = [parts[i] for i in range(len(parts))]
            whole = torch.cat([w for w, _ in order], dim=0) if keep_whole else None
            cols = torch.cat([c for _, c in order], dim=0) if order[0][1] is not None else None
            self._finish(key, whole, cols, matrix)
            del self._waiting[key]

    def done(self) -> None:
        if self._waiting:
            raise ValueError(f"fused layers with missing parts: {sorted(self._waiting)[:5]}")
        tied = self.tied if self.tied is not None else not self._has_head
        if tied and self._head is not None:
            full, sampled = self._head
            if full is not None:
                self.full[self.prefix + TIED_HEAD] = full
            if sampled is not None:
                self.sampled[self.prefix + TIED_HEAD] = sampled


# ------------------------------------------------------------------------------ trainer side

def served_checksums(served: Iterable[tuple[str, torch.Tensor]], prefix: str = "dp0:pp0:pcp0:tp0:",
                     *, tied: bool | None = None, sample: tuple[int, int] | None = None,
                     extra: Mapping[str, torch.Tensor] | None = None, readings: bool = False,
                     ) -> dict[str, Any]:
    """vLLM-named checksums of served HF-named tensors (bf16 bits as the trainer serves them): whole,
    or (``sample=(k, version)``) sampled for the matrices, with ``extra`` columns (embedding rows) per
    vLLM name added to the sample. ``served`` may be a ZeRO-3 walk. ``tied``: whether the engine's LM head
    computes with the embedding (:class:`ChecksumCollector`; by default, whether no head was served).
    ``readings``: :class:`Reading` values instead of digests (both sides in one process)."""
    collector = ChecksumCollector(prefix, whole=sample is None, sample=sample, tied=tied, extra=extra,
                                  readings=readings)
    for name, tensor in served:
        collector.add(name, tensor)
    collector.done()
    return collector.sampled if sample is not None else collector.full


def compare(engine: Mapping[str, Any], served: Mapping[str, Any]) -> list[str]:
    """Names whose checksums (or :class:`Reading` values) differ or that only one side has."""
    return sorted(k for k in engine.keys() | served.keys() if engine.get(k) != served.get(k))


# ------------------------------------------------------------------------------ engine side

def kernel_items(model: torch.nn.Module, dtype: torch.dtype, sample: Any = None,
                 names: Any = None, extra: Mapping[str, torch.Tensor] | None = None, readings: bool = False,
                 ) -> Iterator[tuple[str, torch.Tensor | str | Reading]]:
    """(vLLM parameter name, the tensor its kernel computes with) for every parameter of ``model``
    (:func:`faircast_ds.vllm.engine_weights.kernel_tensors`); with ``sample`` (``(k, version_of)``: columns per
    matrix and each vLLM name's loaded version, or None where unknown), a matrix's item is its sampled
    digest instead (:func:`sample_columns`), and so is the embedding's (:func:`sample_rows`). ``names``: only
    these vLLM parameter names. ``extra``: columns (embedding rows) per vLLM name a sample also reads.
    ``readings``: a sampled item is its :class:`Reading` instead of its digest."""
    extra = extra or {}
    sampled_of = sampled_reading if readings else sampled_digest

    def columns(name: str, width: int) -> torch.Tensor | None:
        version = sample[1](name) if sample is not None else None
        return None if version is None else with_lines(sample_columns(name, width, sample[0], version), extra.get(name))

    def rows(name: str, count: int, width: int) -> torch.Tensor | None:
        version = sample[1](name) if sample is not None else None
        return None if version is None else with_lines(sample_rows(name, count, width, sample[0], version),
                                                       extra.get(name))

    for name, t, sampled in kernel_tensors(model, dtype, columns if sample is not None else None, names,
                                           rows=rows if sample is not None else None):
        if sampled == "rows":
            yield name, sampled_of(t, t.shape[0], sample[1](name), "rows")
        else:
            yield name, sampled_of(t, sample[0], sample[1](name)) if sampled else t


def kernel_checksums(worker: Any) -> dict[str, str]:
    """``Worker.compute_weight_checksums`` as the kernels compute: vLLM's keys, canonical kernel bits
    of every element."""
    prefix = worker._weight_checksum_prefix()
    model = worker.model_runner.get_model()
    dtype = worker.model_config.dtype
    return {prefix + name: t if isinstance(t, str) else checksum(t.cpu()) for name, t in kernel_items(model, dtype)}


def install_checksums() -> None:
    """Make vLLM's worker answer ``compute_weight_checksums`` (``/weight_checker``) with
    :func:`kernel_checksums`. Idempotent (vLLM loads its plugins once per process, possibly more)."""
    from vllm.v1.worker.gpu_worker import Worker

    if getattr(Worker.compute_weight_checksums, "_faircast", False):
        return

    def compute_weight_checksums(self: Any) -> dict[str, str]:
        return kernel_checksums(self)

    compute_weight_checksums._faircast = True  # type: ignore[attr-defined]
    compute_weight_checksums.__doc__ = kernel_checksums.__doc__
    Worker.compute_weight_checksums = compute_weight_checksums


def staging_check(model: torch.nn.Module, dtype: torch.dtype, staged: list[tuple[str, torch.Tensor]], columns: int,
                version: int, extra: Mapping[str, torch.Tensor] | None = None, *, tied: bool | None = None,
                times: dict[str, float] | None = None) -> list[str]:
    """After a load from the staging copy (either plane): the vLLM names among the loaded layers whose
    kernels compute with other bits than ``staged`` (HF-named staging tensors, whole fused groups).
    ``columns`` > 0 reads that many input columns of each matrix (at ``version``'s sample), plus the
    ``extra`` ones per vLLM name (:func:`touched_lines`: those an update changed), 0 reads every element;
    the embedding is read at its sampled rows (plus its ``extra`` rows; every row for 0); vectors whole.
    ``tied``: whether the model's LM head computes with the embedding (asked of the model when None).
    ``times``: gets the seconds of each side, ``staged_seconds`` (the staging copy's readings) and
    ``kernels_seconds`` (reading the kernels back and comparing).

    Both sides are in this process, so a sampled check compares the read bits directly (:class:`Reading`),
    each kernel's reading as soon as it is taken; a whole check (``columns`` 0) hashes each side instead,
    so it never holds a second copy of the fused layers."""
    if tied is None:
        tied = ties_head(model)
    sample = (columns, int(version)) if columns else None
    extra = extra if columns else None
    readings = bool(columns)
    began = time.perf_counter()
    expected = served_checksums(staged, prefix="", sample=sample, extra=extra, tied=tied, readings=readings)
    staged_at = time.perf_counter()
    bad, seen = [], set()
    for name, t in kernel_items(model, dtype, (columns, lambda _n: int(version)) if columns else None,
                                names=set(expected), extra=extra, readings=readings):
        if isinstance(t, torch.Tensor):
            t = whole_reading(t) if readings else checksum(t.cpu())
        seen.add(name)
        if name not in expected or expected[name] != t:
            bad.append(name)
    bad.extend(name for name in expected if name not in seen)
    if times is not None:
        times.update(staged_seconds=staged_at - began, kernels_seconds=time.perf_counter() - staged_at)
    return sorted(set(bad))
