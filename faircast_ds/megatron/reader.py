"""Megatron-Core GPT parameters in Hugging Face names (Llama and Qwen3 families), as a served-weight reader.

:class:`MegatronHFReader` is a :class:`faircast_ds.export.source.ServedReader`: give it to
``ServedSource(reader=...)`` on every rank and every consumer of the one served-weight source (the vLLM
push, the HF export) reads a Megatron trainer's served bf16 bits under HF names:

- tensor parallel: a split parameter's slices are gathered over its tensor-parallel group and put back
  in full-parameter order from Megatron's ``partition_dim`` / ``partition_stride`` (rank ``r`` holds
  chunks ``r, r + tp, ...``; SwiGLU's ``linear_fc1`` has stride 2, ``[gate_r; up_r]``);
- pipeline parallel: every rank learns every stage's parameters (their global names, with global layer
  numbers, :func:`faircast_ds.megatron.layout.global_names`) once; a walk broadcasts each parameter
  from the first rank of the stage that holds it;
- fused layouts reassembled: ``linear_qkv`` (grouped by query group: per group ``heads / groups`` query
  heads, then one key and one value head) into ``q_proj`` / ``k_proj`` / ``v_proj``; ``linear_fc1``
  (``[gate; up]``) into ``gate_proj`` / ``up_proj``; Qwen3's ``q_layernorm`` / ``k_layernorm`` into
  ``q_norm`` / ``k_norm``; both the local spec's norm names (``input_layernorm``,
  ``pre_mlp_layernorm``) and Transformer Engine's fused ones (``linear_qkv.layer_norm_weight``,
  ``linear_fc1.layer_norm_weight``).

Every walk is dense (``local_slices`` raises: a rank's pieces are in Megatron's layout, not the HF
tensors'). Nothing here changes a served bit: the pieces are views and copies of the served tensors.

Megatron's attach hands it to export (:func:`provide`, under the optimizer and each model chunk), so
``ServedSource(model)`` / ``save_hf(model, ...)`` on a chunk read it without naming it.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from faircast_ds.export import source as export_source
from faircast_ds.export.served import LocalSlice, ParamSpec
from faircast_ds.megatron.layout import global_names, split_of, tp_group_of
from faircast_ds.shard.handle import get_fair_cast

FAMILIES = ("llama", "qwen3")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_PER_LAYER = {  # Megatron (local or TE spec) -> HF, for the parameters that are not fused
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
_TOP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight"}


@dataclass(frozen=True)
class Attention:
    """What the fused QKV split needs: query heads, query groups (key/value heads), head size."""

    heads: int
    groups: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.heads % self.groups:
            raise ValueError(f"{self.heads} attention heads do not divide into {self.groups} query groups")

    @classmethod
    def of(cls, config: Any) -> "Attention":
        """From a Megatron ``TransformerConfig``."""
        groups = config.num_query_groups or config.num_attention_heads
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        return cls(config.num_attention_heads, groups, head_dim)


def hf_names(name: str, family: str = "qwen3") -> list[str]:
    """The HF name(s) of Megatron's full parameter ``name`` (two or three for a fused one)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}: one of {', '.join(FAMILIES)}")
    if name in _TOP:
        return [_TOP[name]]
    m = _LAYER.match(name)
    if m is None:
        raise ValueError(f"{name}: not a Megatron GPT parameter Fair Cast maps to HF names")
    layer, rest = m.groups()
    prefix = f"model.layers.{layer}."
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        return [f"{prefix}self_attn.{p}_proj.{kind}" for p in ("q", "k", "v")]
    if rest in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
        kind = rest.rsplit(".", 1)[1]
        return [f"{prefix}mlp.{p}_proj.{kind}" for p in ("gate", "up")]
    if rest in _PER_LAYER:
        if family == "llama" and "_layernorm." in rest and rest.split(".")[1] in ("q_layernorm", "k_layernorm"):
            raise ValueError(f"{name}: Llama has no query/key norm (qk_layernorm is Qwen3's)")
        return [prefix + _PER_LAYER[rest]]
    raise ValueError(f"{name}: not a Megatron GPT parameter Fair Cast maps to HF names")


def hf_shapes(name: str, shape: tuple[int, ...], attention: Attention) -> list[tuple[int, ...]]:
    """The HF pieces' shapes of Megatron's full parameter ``name`` of ``shape``."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        rest = tuple(shape[1:])
        a = attention
        return [(a.heads * a.head_dim,) + rest, (a.groups * a.head_dim,) + rest, (a.groups * a.head_dim,) + rest]
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return [(shape[0] // 2,) + tuple(shape[1:])] * 2
    return [tuple(shape)]


def to_hf(name: str, full: torch.Tensor, attention: Attention, family: str = "qwen3") -> list[tuple[str, torch.Tensor]]:
    """Megatron's full (TP-gathered) parameter as its HF pieces (views where the layout allows)."""
    names = hf_names(name, family)
    if len(names) == 3:  # [groups, heads/groups query heads + key + value, head_dim, ...]
        a = attention
        per = a.heads // a.groups
        grouped = full.reshape(a.groups, per + 2, a.head_dim, *full.shape[1:])
        q = grouped[:, :per].reshape(a.heads * a.head_dim, *full.shape[1:])
        k = grouped[:, per].reshape(a.groups * a.head_dim, *full.shape[1:])
        v = grouped[:, per + 1].reshape(a.groups * a.head_dim, *full.shape[1:])
        return list(zip(names, (q, k, v)))
    if len(names) == 2:  # SwiGLU: [gate; up]
        return list(zip(names, full.chunk(2, dim=0)))
    return [(names[0], full)]


def gather_tensor_parallel(param: torch.Tensor, split: Any, group: Any) -> torch.Tensor:
    """The full parameter from this rank's slice ``param`` and its TP group's (a collective of ``group``):
    local chunk ``j`` of rank ``r`` is full chunk ``j * size + r`` along ``split.dim``."""
    pieces = [torch.empty_like(param) for _ in range(split.size)]
    dist.all_gather(pieces, param.contiguous(), group=group)
    chunks = [p.chunk(split.stride, dim=split.dim) for p in pieces]
    order = [chunks[k % split.size][k // split.size] for k in range(split.stride * split.size)]
    return torch.cat(order, dim=split.dim)


def _order(name: str) -> tuple:
    m = _LAYER.match(name)
    if name.startswith("embedding."):
        return (0, 0, name)
    if m is not None:
        return (1, int(m.group(1)), m.group(2))
    return (2, 0 if "final_layernorm" in name else 1, name)


class MegatronHFReader:
    """A Megatron GPT model's served parameters under HF names, every stage's, on every rank (see the
    module docstring). ``chunks``: this rank's model chunks (the DDP-wrapped modules); ``config``: its
    ``TransformerConfig``. Construct on every rank (one ``all_gather_object`` of the stages' names).
    ``fair_cast``: the handle attached to the chunks' optimizer, for what an export records."""

    group = None  # the walk's own collectives: the default group (every rank takes part in every parameter)

    def __init__(self, chunks: Iterable[torch.nn.Module], config: Any, family: str = "qwen3", *,
                 fair_cast: Any = None) -> None:
        self.fair_cast = fair_cast
        if family not in FAMILIES:
            raise ValueError(f"unknown model family {family!r}: one of {', '.join(FAMILIES)}")
        from megatron.core import parallel_state as ps

        self.family, self.attention = family, Attention.of(config)
        self._tp_group = ps.get_tensor_model_parallel_group() if ps.model_parallel_is_initialized() else None
        local: dict[str, torch.nn.Parameter] = {}
        for param, name in global_names(list(chunks)).items():
            local.setdefault(name, param)  # a tied copy on the last stage: the embedding stage serves it
        rank = dist.get_rank()
        mine = [(name, tuple((split_of(p).full_shape if split_of(p) is not None else p.shape)), str(p.dtype))
                for name, p in local.items()]
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (rank, mine))
        owners: dict[str, tuple[int, tuple[int, ...], str]] = {}
        for owner, names in sorted(everyone):
            for name, shape, dtype in names:
                owners.setdefault(name, (owner, shape, dtype))  # the lowest rank holding it broadcasts it
        self._local = local
        self._megatron: list[tuple[str, int, tuple[int, ...]]] = []  # (Megatron name, owner rank, full shape)
        self.specs: list[ParamSpec] = []
        self._piece: list[tuple[int, int]] = []  # spec index -> (Megatron parameter index, piece)
        for name in sorted(owners, key=_order):
            owner, shape, dtype = owners[name]
            self._megatron.append((name, owner, shape))
            names = hf_names(name, family)
            for j, (hf, hf_shape) in enumerate(zip(names, hf_shapes(name, shape, self.attention))):
                self.specs.append(ParamSpec(hf, hf_shape, getattr(torch, dtype.removeprefix("torch."))))
                self._piece.append((len(self._megatron) - 1, j))
        self._cached: tuple[int, list[tuple[str, torch.Tensor]]] | None = None

    def local_slices(self) -> list[LocalSlice]:
        raise ValueError("Megatron's HF-named reader walks dense only: a rank's pieces are in Megatron's layout")

    def is_gathered(self, index: int) -> bool:
        return True

    def _full_megatron(self, i: int) -> torch.Tensor:
        """Megatron parameter ``i`` in full on every rank (collectives of every rank, in the same order)."""
        name, owner, shape = self._megatron[i]
        param = self._local.get(name)
        if param is not None:  # this stage holds it: gather the TP slices (every stage rank holds the same)
            split = split_of(param)
            full = param.detach() if split is None else gather_tensor_parallel(param.detach(), split,
                                                                              self._group_of(param))
        else:
            full = torch.empty(shape, dtype=self.specs[self._first_spec(i)].dtype)
        full = full.contiguous()
        dist.broadcast(full, src=owner)  # from the stage that holds it, to every rank
        return full

    def _group_of(self, param: torch.Tensor) -> Any:
        size, _ = tp_group_of(param)
        if getattr(param, "allreduce", True) is False:
            raise ValueError("expert parameters are not mapped to HF names")
        return self._tp_group if size > 1 else None

    def _first_spec(self, i: int) -> int:
        return next(k for k, (m, _) in enumerate(self._piece) if m == i)

    @contextlib.contextmanager
    def full(self, index: int) -> Iterator[torch.Tensor]:
        i, j = self._piece[index]
        if self._cached is None or self._cached[0] != i:  # q, k and v (gate and up) share one gather
            full = self._full_megatron(i)
            self._cached = (i, to_hf(self._megatron[i][0], full, self.attention, self.family))
        yield self._cached[1][j][1]
        if j == len(self._cached[1]) - 1:
            self._cached = None

    def fair_cast_summary(self) -> dict[str, Any] | None:
        """The Fair Cast settings an export records (None: built without the handle)."""
        return self.fair_cast.summary() if self.fair_cast is not None else None


def family_of(config: Any) -> str:
    """The HF family a ``TransformerConfig`` reads as: Qwen3 with query/key norms, else Llama."""
    return "qwen3" if getattr(config, "qk_layernorm", False) else "llama"


def provide(optimizer: Any, chunks: Iterable[torch.nn.Module], *, family: str | None = None) -> None:
    """Hand export the reader of ``chunks`` (this rank's model chunks) under ``optimizer`` and under each
    chunk (what a consumer holds): a :class:`MegatronHFReader` made when a source asks (a collective:
    every rank asks alike), with the Fair Cast attached to ``optimizer`` then, if any. ``family``:
    default from the chunks' config (:func:`family_of`)."""
    chunks = list(chunks)
    if family is not None and family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}: one of {', '.join(FAMILIES)}")

    def make(_model: Any) -> MegatronHFReader:
        config = chunks[0].config
        return MegatronHFReader(chunks, config, family or family_of(config), fair_cast=get_fair_cast(optimizer))

    for owner in (optimizer, *chunks):
        export_source.provide(owner, make)
