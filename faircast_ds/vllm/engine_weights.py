"""The engine's kernels, from inside a vLLM worker: loading HF-named tensors into them, and reading back
the bits they compute with. Both engine setups (the colocated engine's worker extension and the ``faircast``
backend of ``vllm serve``) load and read back through this module.

Loading goes through vLLM's ``reload_weights(..., is_checkpoint_format=True)`` (the caller's), inside
:func:`quiet_reload`. Reading back asks the kernels themselves: a linear layer (and the LM head) is
applied to identity rows through its own ``quant_method`` (:func:`linear_readback`; on CPU the oneDNN
kernels repack their weights and leave ``.weight`` empty, and the LM head computes with a packed copy),
an embedding is looked up for every id, and only tensors a kernel reads directly (norm weights, biases)
are read as tensors. :func:`kernel_tensors` does it per vLLM parameter, :func:`read_back` per HF tensor
(a fused part cut out of its vLLM layer, :mod:`faircast_ds.vllm.fused`). When what comes back is not
what was served, both raise :class:`EngineWeightsMismatch`.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from faircast_ds.vllm import fused

_QUIET = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace")
_PROBE_ROWS = 1024  # identity rows per kernel call when reading a linear weight back
TIED_EMBEDDING = "model.embed_tokens.weight"  # what a load names when it carries a tied head's weight
TIED_HEAD = "lm_head.weight"  # the LM head's name, HF's and vLLM's; a tied head is checked under it too


class EngineWeightsMismatch(RuntimeError):
    """After a push the engine computes with bits other than the served ones (the message lists them)."""

    def __init__(self, message: str, mismatched: list[str]) -> None:
        super().__init__(message)
        self.mismatched = mismatched


@contextmanager
def quiet_reload() -> Iterator[None]:
    """A partial reload makes vLLM warn once per layer that got no tensor ("Failed to load weights"),
    which is what a delta update is; silence exactly those two loggers while it runs."""
    loggers = [logging.getLogger(n) for n in _QUIET]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def input_width(module: Any) -> int:
    """The input width of a vLLM linear layer (this rank's part) or LM head."""
    from vllm.model_executor.layers.linear import LinearBase

    return module.input_size_per_partition if isinstance(module, LinearBase) else module.embedding_dim


def linear_readback(module: Any, dtype: torch.dtype, columns: torch.Tensor | None = None) -> torch.Tensor:
    """The weight ``[out, in]`` a linear kernel computes with, read through the kernel (identity rows);
    with ``columns``, only those input columns (``[out, len(columns)]``)."""
    width = input_width(module)
    device = next((t.device for t in module.parameters()), torch.device("cpu"))
    if columns is not None:
        probe = torch.zeros(len(columns), width, dtype=dtype, device=device)
        probe[torch.arange(len(columns)), columns.to(device)] = 1
        return module.quant_method.apply(module, probe).t().contiguous()
    cols = []
    for start in range(0, width, _PROBE_ROWS):
        rows = min(_PROBE_ROWS, width - start)
        eye = torch.zeros(rows, width, dtype=dtype, device=device)
        eye[:, start:start + rows] = torch.eye(rows, dtype=dtype, device=device)
        cols.append(module.quant_method.apply(module, eye))  # [rows, out]: W^T's rows, no bias
    return torch.cat(cols).t().contiguous()


def tied_heads(model: torch.nn.Module, embedding: Any) -> list[tuple[str, Any]]:
    """(vLLM module path, module) of every LM head that computes its logits with ``embedding``'s weight
    (tied word embeddings). vLLM ties by handing the embedding's parameter to a separate
    ``ParallelLMHead``, whose kernel may compute from a copy of its own (on CPU, a packed one), so reading
    the embedding through its lookup says nothing about the logits. The model lists the shared parameter
    once, under the embedding's name, so the head has no parameter name of its own."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    weight = getattr(embedding, "weight", None)
    if weight is None:
        return []
    return [(path, m) for path, m in model.named_modules()
            if m is not embedding and isinstance(m, ParallelLMHead) and getattr(m, "weight", None) is weight]


def refresh_tied_heads(model: torch.nn.Module, names: Any) -> int:
    """After a load of HF tensors ``names`` (by vLLM's reload or written in place): make every LM head tied
    to a loaded embedding compute with the embedding's new bits. vLLM's reload rebuilds only the layers
    that received a tensor; a tied head receives none (the checkpoint names its weight once, as the
    embedding's), so a kernel that packed its own copy of the weight at start (vLLM's CPU GEMM on a CPU
    where oneDNN builds a bf16 matmul) keeps computing the logits with the start's bits. Running the head's
    ``process_weights_after_loading`` again packs the current bits (a no-op where the kernel reads the
    weight live). Returns how many heads were refreshed."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    refreshed = 0
    for name in names:
        try:
            module, attr, _ = resolve(model, name)
        except KeyError:
            continue
        if attr != "weight" or not isinstance(module, VocabParallelEmbedding) or isinstance(module, ParallelLMHead):
            continue
        for _, head in tied_heads(model, module):
            method = getattr(head, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(head)
                refreshed += 1
    return refreshed


def ties_head(model: torch.nn.Module) -> bool:
    """Whether an LM head of ``model`` computes its logits with the token embedding's weight."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    return any(tied_heads(model, m) for m in model.modules()
               if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead))


def kernel_tensors(model: torch.nn.Module, dtype: torch.dtype, columns: Callable[[str, int], Any] | None = None,
                   names: Any = None, *, rows: Callable[[str, int, int], Any] | None = None,
                   ) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """(vLLM parameter name, the tensor its kernel computes with, what was sampled: False when read whole,
    True when only some columns were, ``"rows"`` when only some embedding rows were) for every parameter of
    ``model``, and for a tied LM head (:func:`tied_heads`) the embedding as its logits kernel computes with
    it, under the head's own name (``lm_head.weight``) as an untied head would be. ``columns(vllm name,
    input width)``: the input columns to read of a matrix (a linear layer or the LM head), or None to read
    it whole (default: every matrix whole). ``rows(vllm name, rows, width)``: the ids to look up of the
    token embedding, or None for every id (default). ``names``: only these vLLM parameter names (default:
    every one)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    modules = dict(model.named_modules())
    with torch.inference_mode():
        for name, param in model.named_parameters():
            path, _, attr = name.rpartition(".")
            module = modules.get(path)
            if attr == "weight" and isinstance(module, VocabParallelEmbedding) \
                    and not isinstance(module, ParallelLMHead):
                for head_path, head in tied_heads(model, module):
                    head_name = f"{head_path}.weight"
                    if names is None or head_name in names:
                        yield _matrix_item(head_name, head, dtype, columns)
            if names is not None and name not in names:
                continue
            # an (unsharded) vocabulary the engine padded is cut back to the checkpoint's rows
            vocab = getattr(module, "org_vocab_size", None)
            if attr == "weight" and isinstance(module, (LinearBase, ParallelLMHead)):
                yield _matrix_item(name, module, dtype, columns)
            elif attr == "weight" and isinstance(module, VocabParallelEmbedding):
                count = vocab or param.shape[0]
                ids = rows(name, count, module.embedding_dim) if rows is not None else None
                if ids is None:
                    yield name, module(torch.arange(count, device=param.device)), False
                else:
                    yield name, module(ids.to(param.device)), "rows"
            else:
                t = param.detach()
                yield name, t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, False


def _matrix_item(name: str, module: Any, dtype: torch.dtype, columns: Callable[[str, int], Any] | None,
                 ) -> tuple[str, torch.Tensor, bool]:
    """:func:`kernel_tensors`' item of a linear layer or LM head: read through its kernel (the sampled columns,
    or whole), an LM head's padded vocabulary cut back (a linear layer has no ``org_vocab_size``)."""
    cols = columns(name, input_width(module)) if columns is not None else None
    t = linear_readback(module, dtype, cols)
    vocab = getattr(module, "org_vocab_size", None)
    return name, t[:vocab] if vocab else t, cols is not None


def resolve(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str, int | None]:
    """(vLLM module, attribute, index in its fused group or None) holding HF tensor ``name``."""
    path, _, attr = name.rpartition(".")
    try:
        return model.get_submodule(path), attr, None
    except AttributeError:
        pass
    packed = getattr(model, "packed_modules_mapping", None) or {}
    found = fused.part_of(name, packed)
    if found is not None:
        parent = fused.split(name)[0]
        try:
            return model.get_submodule(f"{parent}.{found[0]}" if parent else found[0]), attr, found[1]
        except AttributeError:
            pass
    raise KeyError(f"the vLLM model has no module for {name!r}")


def read_back(model: torch.nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """What the kernels compute with for the HF tensor ``name`` of ``shape`` (a fused part cut out of
    its layer; a vocabulary the engine padded cut back)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    module, attr, index = resolve(model, name)
    if attr == "weight" and isinstance(module, (LinearBase, ParallelLMHead)):
        full = linear_readback(module, dtype)
    elif attr == "weight" and isinstance(module, VocabParallelEmbedding):
        device = module.weight.device
        full = module(torch.arange(shape[0], device=device))
    else:
        full = getattr(module, attr).detach()
        if full.dtype != dtype and full.is_floating_point():
            full = full.to(dtype)  # e.g. a bias the CPU GEMM keeps in fp32 (exact for bf16 values)
    if index is not None:
        start, rows = _part(module, index, name)
        full = full.narrow(0, start, rows)
    if tuple(full.shape) != shape:
        if full.dim() == len(shape) and full.shape[0] >= shape[0] and tuple(full.shape[1:]) == shape[1:]:
            full = full[: shape[0]]  # a vocabulary padded by the engine
        else:
            raise ValueError(f"{name}: the engine holds {list(full.shape)}, the trainer serves {list(shape)}")
    return full


def _part(module: Any, index: int | None, name: str) -> tuple[int, int | None]:
    """(first row, rows) of HF tensor ``name``'s part in its fused layer; (0, None) when not fused."""
    if index is None:
        return 0, None
    sizes = list(getattr(module, "output_sizes", []))
    if len(sizes) <= index:
        raise KeyError(f"{name}: cannot locate shard {index} of {type(module).__name__}")
    return sum(sizes[:index]), sizes[index]


def inplace_target(model: torch.nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """The part of the engine's own parameter that holds HF tensor ``name`` (a fused part's rows, a padded
    vocabulary's first rows), as a contiguous view an update can be written into; None where there is no
    such view: an emptied weight (a kernel that repacked it), another dtype (a bias the CPU GEMM keeps in
    fp32), another shape. Whether the kernels read it is :func:`kernel_probes`' question."""
    try:
        module, attr, index = resolve(model, name)
        start, rows = _part(module, index, name)
    except KeyError:
        return None
    param = getattr(module, attr, None)
    if not isinstance(param, torch.Tensor) or param.dtype != dtype or param.numel() == 0:
        return None
    t = param.data
    if rows is not None:
        t = t.narrow(0, start, rows)
    if tuple(t.shape) != shape:
        if t.dim() == len(shape) and t.shape[0] >= shape[0] and tuple(t.shape[1:]) == shape[1:]:
            t = t[: shape[0]]
        else:
            return None
    return t if t.is_contiguous() else None


def kernel_probes(model: torch.nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                  ) -> tuple[list[Callable[[int], torch.Tensor]], list[Callable[[int], torch.Tensor]]]:
    """(row readers, column readers) of what the kernels compute with for HF tensor ``name``, over its own
    rows (:func:`faircast_ds.vllm.inplace.reads_live`): a linear layer or LM head is read through its
    ``quant_method`` one input column at a time; an embedding through its lookup, through its own
    ``quant_method`` and through the kernel of every LM head tied to it (:func:`tied_heads`); a vector is
    read by none (the kernel reads the tensor itself)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    module, attr, index = resolve(model, name)
    start, _ = _part(module, index, name)
    if attr != "weight" or len(shape) != 2:
        return [], []

    def column_of(kernel: Any) -> Callable[[int], torch.Tensor]:
        """One input column of what ``kernel`` computes with, cut to this tensor's rows."""
        return lambda i: linear_readback(kernel, dtype, torch.tensor([i]))[:, 0].narrow(0, start, shape[0])

    column = column_of(module)

    if isinstance(module, LinearBase):
        return [], [column]
    if isinstance(module, ParallelLMHead):  # its forward is the sampler's: read through its kernel only
        return [], [column]
    if isinstance(module, VocabParallelEmbedding):
        device = module.weight.device

        def row(i: int) -> torch.Tensor:
            return module(torch.tensor([i], device=device))[0]

        return [row], [column] + [column_of(h) for _, h in tied_heads(model, module)]
    return [], []
