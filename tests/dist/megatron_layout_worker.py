"""Megatron-Core GPT model (local spec: GQA fused QKV, SwiGLU, biases, untied embeddings) with Fair Cast on
CPU ranks over gloo, under several (tensor, pipeline, data) parallel layouts in one launch, for
tests/megatron_tests/test_megatron_layouts.py. ``LAYOUTS`` (env): ``tp,pp`` pairs separated by ``;``, data parallel the rest
of the world; Megatron's parallel state is torn down and built again between them.

For every layout and mode the fp32 main params are set from FULL masters the worker defines per full
parameter name (its own mapping: stage-local layer ``i`` of stage ``p`` is global layer ``i + p * layers
per stage``), split per layout by the worker's own ``torch.chunk`` (SwiGLU's fc1 as ``[gate_r; up_r]``),
then Megatron's main->model copy (Fair Cast's route: ``ROUTE`` runtime, or hook on a patched copy) and its
param all-gather serve them. Rank 0
reassembles every full parameter from all ranks' local served tensors with ``torch.cat`` and compares it
with ``faircast_ds.casting.reference.cast_reference`` of the full master keyed by the full name (error feedback:
the reference's residual carried per full parameter), and writes the full served bits for the
cross-layout comparison (``bits_<tp>x<pp>x<dp>.pt``) and a report (``layouts.json``). Nothing of Fair
Cast's own mapping (``faircast_ds.megatron.layout``) is used here.
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_cpu  # noqa: E402

megatron_cpu.enable()

from common import deterministic_master  # noqa: E402

from faircast_ds.casting.bits import bf16_bits  # noqa: E402
from faircast_ds.casting.noise import name_id  # noqa: E402
from faircast_ds.casting.reference import cast_reference  # noqa: E402

OUT = os.environ["OUT_DIR"]
# "tp,pp" or "tp,pp,vp" (vp: virtual pipeline stages, model chunks per rank)
LAYOUTS = [tuple(int(x) for x in part.split(",")) for part in os.environ.get("LAYOUTS", "").split(";") if part]
MODES = [m for m in os.environ.get("MODES", "nearest,stochastic,dither,error_feedback").split(",") if m]
STEPS = int(os.environ.get("STEPS", "2"))
SEED = 77
ROUTE = os.environ.get("ROUTE", "runtime")  # "hook": a patched Megatron-Core copy is first on PYTHONPATH
NUM_LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, SEQ = 4, 16, 4, 2, 32, 64, 8

# how the worker itself splits a full parameter (the oracle's layout knowledge, written apart from the product's)
COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")
GATE_UP = ("linear_fc1.weight", "linear_fc1.bias")
ROW = ("linear_proj.weight", "linear_fc2.weight")


def kind_of(name: str) -> str:
    for kind, suffixes in (("column", COLUMN), ("gate_up", GATE_UP), ("row", ROW)):
        if name.endswith(suffixes):
            return kind
    return "whole"


def full_name(local: str, pp_rank: int) -> str:
    """``vp<v>|`` prefixes a virtual-pipeline chunk's names: chunk ``v`` of stage ``p`` holds layers
    ``(v * pp + p) * per_chunk + i`` (Megatron's interleaved assignment, written here from its definition)."""
    vp_stage, _, local = local.rpartition("|")
    v = int(vp_stage[2:]) if vp_stage else 0
    parts = local.split(".")
    if "layers" in parts:
        i = parts.index("layers") + 1
        per_chunk = NUM_LAYERS // (PP_SIZE[0] * VP_SIZE[0])
        parts[i] = str(int(parts[i]) + (v * PP_SIZE[0] + pp_rank) * per_chunk)
    return ".".join(parts)


PP_SIZE = [1]
VP_SIZE = [1]


class Chunks(list):
    """A virtual-pipeline rank's model chunks, seen by the worker as one model (names prefixed ``vp<v>|``)."""

    def named_parameters(self):
        for v, chunk in enumerate(self):
            for name, param in chunk.named_parameters():
                yield f"vp{v}|{name}", param

    def zero_grad_buffer(self):
        for chunk in self:
            chunk.zero_grad_buffer()


def full_shape(local_shape: tuple, kind: str, tp: int) -> tuple:
    shape = list(local_shape)
    if kind in ("column", "gate_up"):
        shape[0] *= tp
    elif kind == "row":
        shape[1] *= tp
    return tuple(shape)


def split(full: torch.Tensor, kind: str, tp: int, rank: int) -> torch.Tensor:
    if kind == "column":
        return torch.chunk(full, tp, 0)[rank]
    if kind == "row":
        return torch.chunk(full, tp, 1)[rank]
    if kind == "gate_up":
        gate, up = torch.chunk(full, 2, 0)
        return torch.cat([torch.chunk(gate, tp, 0)[rank], torch.chunk(up, tp, 0)[rank]], 0)
    return full


def join(pieces: list[torch.Tensor], kind: str) -> torch.Tensor:
    """Pieces in tensor-parallel rank order -> the full parameter."""
    if kind == "column":
        return torch.cat(pieces, 0)
    if kind == "row":
        return torch.cat(pieces, 1)
    if kind == "gate_up":
        halves = [torch.chunk(p, 2, 0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    assert all(torch.equal(p, pieces[0]) for p in pieces), "a replicated parameter differs across TP ranks"
    return pieces[0]


def full_master(name: str, shape: tuple, step: int) -> torch.Tensor:
    numel = 1
    for d in shape:
        numel *= d
    values = deterministic_master(name_id(f"{name}@{step}"), 0, numel)
    # spread over a few binades and off the bf16 grid, so that noise decides many elements
    scale = torch.linspace(0.5, 3.0, numel)
    return (values * scale + 1e-3 * step).reshape(shape)


def build(mode: str | None, tp: int, pp: int, vp: int = 1):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from faircast_ds.megatron import attach

    config = TransformerConfig(num_layers=NUM_LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, ffn_hidden_size=FFN, gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu, add_bias_linear=True, bf16=True,
                               params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                               use_cpu_initialization=True, tensor_model_parallel_size=tp,
                               attention_dropout=0.0, hidden_dropout=0.0,
                               pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vp if vp > 1 else None)
    torch.manual_seed(0)
    chunks = []
    for vp_stage in range(vp):
        first = ps.is_pipeline_first_stage(ignore_virtual=vp == 1, vp_stage=vp_stage if vp > 1 else None)
        last = ps.is_pipeline_last_stage(ignore_virtual=vp == 1, vp_stage=vp_stage if vp > 1 else None)
        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                         pre_process=first, post_process=last, share_embeddings_and_output_weights=False,
                         vp_stage=vp_stage if vp > 1 else None)
        model = Float16Module(config, model)  # as megatron.training's get_model wraps it: every parameter bf16
        chunks.append(DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                                     grad_reduce_in_fp32=True), model))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, clip_grad=0.0,
                                                       use_distributed_optimizer=True), chunks)
    model = chunks[0] if vp == 1 else Chunks(chunks)
    config.finalize_model_grads_func = finalize_model_grads  # the DP reduce-scatter, TP/PP grad all-reduces
    fc = attach(optimizer, {"mode": mode, "seed": SEED}, route=ROUTE) if mode else None
    return model, optimizer, fc


def local_params(model) -> dict[str, torch.nn.Parameter]:
    """The model's parameters by Megatron's name, the wrappers' (DDP, Float16Module) ``module.`` removed."""
    out = {}
    for name, param in model.named_parameters():
        chunk, bar, name = name.rpartition("|")
        while name.startswith("module."):
            name = name[len("module."):]
        out[chunk + bar + name] = param
    return out


def set_masters(model, optimizer, step: int, tp: int, tp_rank: int, pp_rank: int) -> None:
    """Every main shard from the worker's full masters: split by the worker, cut by Megatron's own range."""
    from faircast_ds.megatron.adapters import distributed_optimizers

    names = {p: n for n, p in local_params(model).items()}
    for opt in distributed_optimizers(optimizer):
        for group, mains in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups):
            for param, main in zip(group, mains):
                local = names[param]
                kind = kind_of(local)
                name = full_name(local, pp_rank)
                master = full_master(name, full_shape(tuple(param.shape), kind, tp), step)
                piece = split(master, kind, tp, tp_rank).reshape(-1)
                where = opt._get_model_param_range_map(param)["param"]
                main.data.copy_(piece[where.start:where.end])


def serve(optimizer) -> None:
    """Megatron's main->model copy (Fair Cast's, where attached) and its param all-gather."""
    from faircast_ds.megatron.adapters import distributed_optimizers

    for opt in distributed_optimizers(optimizer):
        opt._copy_main_params_to_model_params()
        for chunk in opt.model_chunks:
            chunk.start_param_sync(force_sync=True)


def schedule_stand_ins() -> None:
    """Two more CUDA-only calls, on the training schedule's path (not the cast's), stood in on a CPU-only torch:
    Megatron forks its model-parallel CUDA RNG around attention dropout (``tensor_parallel/random.py``,
    ``CudaRNGStatesTracker.fork``: "cuda rng state model-parallel-rng is not added", the CUDA RNG cannot be
    seeded; dropout is 0 here, so the fork is a no-op), and the pipeline's p2p exchange ends with
    ``torch.cuda.synchronize()`` (``pipeline_parallel/p2p_communication.py:398``; gloo's waits are synchronous)."""
    import contextlib

    from megatron.core.tensor_parallel import random

    if not torch.cuda.is_available():
        random.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()
        torch.cuda.synchronize = lambda *args, **kwargs: None


def train_step(model, optimizer, step: int) -> bool:
    """One real step through Megatron's schedule (pipelined under PP: p2p over gloo) and its optimizer."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    positions = torch.arange(SEQ).unsqueeze(0).expand(2, -1)

    def forward_step(data_iterator, chunk):
        output = chunk(tokens, positions, None, labels=tokens)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    optimizer.zero_grad()
    model.zero_grad_buffer()
    chunks = list(model) if isinstance(model, Chunks) else [model]
    micro = 2 if len(chunks) > 1 else 1  # the interleaved schedule takes a multiple of the pipeline size
    iterators = [iter([None] * micro) for _ in chunks] if len(chunks) > 1 else iter([None])
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iterators, model=chunks,
                                num_microbatches=micro, seq_length=SEQ, micro_batch_size=2, forward_only=False)
    ok, _, _ = optimizer.step()
    return bool(ok)


def main_pieces(model, optimizer, tp_rank: int, pp_rank: int) -> list:
    """This rank's fp32 main shards: (full name, kind, tp rank, start in the local flattened slice, local
    shape, values), read from Megatron's own range map."""
    from faircast_ds.megatron.adapters import distributed_optimizers

    names = {p: n for n, p in local_params(model).items()}
    out = []
    for opt in distributed_optimizers(optimizer):
        for group, mains in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups):
            for param, main in zip(group, mains):
                where = opt._get_model_param_range_map(param)["param"]
                out.append((full_name(names[param], pp_rank), kind_of(names[param]), tp_rank, int(where.start),
                            tuple(param.shape), main.detach().clone()))
    return out


def full_masters(everyone: list, tp: int) -> dict[str, torch.Tensor]:
    """Every full fp32 master from all ranks' main shards: each TP slice filled from its DP pieces, then
    the slices joined as the worker splits them."""
    slices: dict = {}
    for rank_items in everyone:
        for name, kind, t, start, shape, values in rank_items:
            entry = slices.setdefault(name, {"kind": kind, "by_tp": {}})
            flat = entry["by_tp"].setdefault(t, torch.full((torch.Size(shape).numel(),), float("nan")))
            flat[start:start + values.numel()] = values
            entry["shape"] = shape
    out = {}
    for name, entry in slices.items():
        pieces = [entry["by_tp"][t].reshape(entry["shape"]) for t in range(tp)]
        full = join(pieces, entry["kind"]) if entry["kind"] != "whole" else pieces[0]
        assert not torch.isnan(full).any(), f"{name}: no rank owns some main elements"
        out[name] = full
    return out


def run_layout(tp: int, pp: int, world: int, vp: int = 1) -> dict:
    from megatron.core import parallel_state as ps

    init_layout(tp, pp, vp)
    rank = torch.distributed.get_rank()
    tp_rank, pp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), \
        ps.get_data_parallel_rank()
    label = f"{tp}x{pp}x{world // (tp * pp)}" + (f"v{vp}" if vp > 1 else "")
    report = {"layout": label, "modes": {}}
    bits: dict = {}
    for mode in MODES:
        model, optimizer, fc = build(mode, tp, pp, vp)
        residual: dict[str, torch.Tensor] = {}
        case = {"equal_reference": True, "mismatches": [], "names": None, "indexed_slices": 0, "plain_slices": 0}
        if fc is not None:
            for adapter in fc.adapters:
                for _, _, _, slices in adapter.flat_groups():
                    case["indexed_slices"] += sum(s.runs is not None for s in slices)
                    case["plain_slices"] += sum(s.runs is None for s in slices)
        bits[mode] = []
        for step in range(1, STEPS + 1):
            set_masters(model, optimizer, step, tp, tp_rank, pp_rank)
            serve(optimizer)
            mine = [(full_name(n, pp_rank), kind_of(n), tp_rank, dp_rank, p.detach().clone())
                    for n, p in local_params(model).items() if p.dtype == torch.bfloat16]
            case["fp32_params"] = sorted(n for n, p in local_params(model).items() if p.dtype != torch.bfloat16)
            everyone = [None] * world
            torch.distributed.all_gather_object(everyone, mine)
            if rank != 0:
                continue
            pieces: dict[str, dict] = {}
            for rank_items in everyone:
                for name, kind, t, d, tensor in rank_items:
                    entry = pieces.setdefault(name, {"kind": kind, "by_tp": {}})
                    seen = entry["by_tp"].get(t)
                    if seen is not None:  # a data-parallel replica: the all-gather gave it the same bits
                        assert torch.equal(bf16_bits(seen), bf16_bits(tensor)), f"{name}: DP replicas differ"
                    entry["by_tp"][t] = tensor
            full_bits = {}
            for name, entry in sorted(pieces.items()):
                served = join([entry["by_tp"][t] for t in range(tp)], entry["kind"])
                master = full_master(name, tuple(served.shape), step).reshape(-1)
                res = residual.setdefault(name, torch.zeros(master.numel())) if mode == "error_feedback" else None
                want = cast_reference(master, mode, seed=SEED, step=step, name=name, residual=res)
                got = bf16_bits(served.reshape(-1))
                full_bits[name] = got
                if not torch.equal(got, bf16_bits(want)):
                    case["equal_reference"] = False
                    case["mismatches"].append(f"step {step} {name}: {int((got != bf16_bits(want)).sum())} elements")
            case["names"] = sorted(full_bits)
            bits[mode].append(full_bits)
        # one real step (forward, backward, Megatron's optimizer step and its refresh: the cast), then the
        # served bits against the reference cast of the masters that step produced, gathered from the ranks
        case["train_step_ok"] = train_step(model, optimizer, STEPS + 1)
        mains = [None] * world
        torch.distributed.all_gather_object(mains, main_pieces(model, optimizer, tp_rank, pp_rank))
        served_now = [None] * world
        torch.distributed.all_gather_object(served_now, [(full_name(n, pp_rank), kind_of(n), tp_rank, p.detach().clone())
                                                         for n, p in local_params(model).items()])
        if rank == 0:
            masters = full_masters(mains, tp)
            case["after_train_equal_reference"] = True
            case["masters_moved"] = sum(int((m != full_master(n, tuple(m.shape), STEPS)).sum())
                                        for n, m in masters.items())
            by_name: dict = {}
            for rank_items in served_now:
                for name, kind, t, tensor in rank_items:
                    by_name.setdefault(name, (kind, {}))[1][t] = tensor
            for name, (kind, by_tp) in sorted(by_name.items()):
                served = join([by_tp[t] for t in range(tp)], kind)
                res = residual.get(name) if mode == "error_feedback" else None
                want = cast_reference(masters[name].reshape(-1), mode, seed=SEED, step=STEPS + 1, name=name,
                                      residual=res)
                if not torch.equal(bf16_bits(served.reshape(-1)), bf16_bits(want)):
                    case["after_train_equal_reference"] = False
                    case["mismatches"].append(f"after the real step {name}")
        if fc is not None:
            case["caster_step"] = fc.adapters[0].caster.step
            case["route"] = fc.route
        report["modes"][mode] = case
        del model, optimizer, fc
    if rank == 0:
        torch.save(bits, os.path.join(OUT, f"bits_{label}.pt"))
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, {m: {k: report["modes"][m][k] for k in
                                                       ("indexed_slices", "plain_slices")} for m in MODES})
    report["slices_per_rank"] = gathered
    return report


def init_layout(tp: int, pp: int, vp: int = 1) -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vp if vp > 1 else None)
    PP_SIZE[0], VP_SIZE[0] = pp, vp
    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()


def residual_pieces(model, optimizer, fc, tp_rank: int, pp_rank: int) -> list:
    """main_pieces' layout, with each main shard's error-feedback residual instead of its values."""
    residuals = {}
    for adapter in fc.adapters:
        for key, main, _, _ in adapter.flat_groups():
            residuals[key] = adapter.caster.residual_for(key, main).clone()
    out = []
    for name, kind, t, start, shape, values in main_pieces(model, optimizer, tp_rank, pp_rank):
        out.append((name, kind, t, start, shape, residuals[(name, start)]))
    return out


def full_state(model, optimizer, fc, tp: int, tp_rank: int, pp_rank: int) -> dict | None:
    """Rank 0: every full parameter's served bits, fp32 master and residual (error feedback), reassembled."""
    world = torch.distributed.get_world_size()
    gathered = {}
    for what, items in (("main", main_pieces(model, optimizer, tp_rank, pp_rank)),
                        ("served", [(full_name(n, pp_rank), kind_of(n), tp_rank, 0, tuple(p.shape),
                                     bf16_bits(p.detach().reshape(-1)).clone()) for n, p in local_params(model).items()]),
                        ("residual", residual_pieces(model, optimizer, fc, tp_rank, pp_rank)
                         if fc.config.mode == "error_feedback" else [])):
        everyone = [None] * world
        torch.distributed.all_gather_object(everyone, items)
        gathered[what] = everyone
    if torch.distributed.get_rank() != 0:
        return None
    out = {"main": full_masters(gathered["main"], tp)}
    served = [[(n, k, t, 0, s, v.double()) for n, k, t, _, s, v in items] for items in gathered["served"]]
    out["served"] = {n: v.to(torch.int64) for n, v in full_masters(served, tp).items()}
    if gathered["residual"][0]:
        out["residual"] = full_masters(gathered["residual"], tp)
    return out


def same_state(a: dict, b: dict) -> list[str]:
    return [f"{what}/{n}" for what in a for n in a[what] if not torch.equal(a[what][n], b[what].get(n, torch.empty(0)))]


def lenient_step_load() -> None:
    """Megatron-Core 0.16.1 without Apex/TE: the fully_reshardable load copies every key of torch Adam's per-
    parameter state, "step" included, which the checkpoint keeps only in the param groups (KeyError: 'step',
    ``distrib_optimizer.py:940``); the step tensor is left as it is (no Adam step follows the load here)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None) if "step" not in tensors else None
        inner(self, model_param, tensors)
        if step is not None:
            state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def checkpoint_across_layouts(save: tuple, load: tuple, ckpt_root: str) -> dict:
    """Save on layout ``save`` (two set-master refreshes, a real step, so the residual is not zero), refresh once
    more; load on layout ``load``: the same served bits, masters and residual, and the next refresh the same
    bits. The optimizer in ``fully_reshardable``, Fair Cast's entry with the model's sharded state dict."""
    from megatron.core import dist_checkpointing

    from faircast_ds.megatron import checkpoint as fair_cast_checkpoint
    from faircast_ds.megatron.adapters import distributed_optimizers

    if not torch.cuda.is_available():
        # the async writer's staging sync (filesystem_async.py:230), a no-op on CPU; the fully_reshardable gather
        # moves its buffers with ``.cuda()`` (distrib_optimizer.py:1089 ``get_parameter_state_dp_zero``): stay put
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
    lenient_step_load()
    meta = {"distrib_optim_sharding_type": "fully_reshardable"}  # (0.16.1 refuses flattened_range: not fs_model_space)
    report = {}
    for mode in ("stochastic", "error_feedback"):
        ckpt = os.path.join(ckpt_root, f"ckpt_{mode}")
        if torch.distributed.get_rank() == 0:
            os.makedirs(ckpt)
        tp_rank, pp_rank = init_layout(*save)
        model, optimizer, fc = build(mode, *save)
        for step in (1, 2):
            set_masters(model, optimizer, step, save[0], tp_rank, pp_rank)
            serve(optimizer)
        train_step(model, optimizer, 3)
        model_sd = model.module.sharded_state_dict()
        dist_checkpointing.save({"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, metadata=meta),
                                 "fair_cast": fair_cast_checkpoint.sharded_state_dict(fc, model_sd)}, ckpt)
        saved = full_state(model, optimizer, fc, save[0], tp_rank, pp_rank)
        serve(optimizer)  # step 4: a refresh of the same masters (error feedback: the residual moves it)
        continued = full_state(model, optimizer, fc, save[0], tp_rank, pp_rank)
        del model, optimizer, fc

        tp_rank, pp_rank = init_layout(*load)
        model, optimizer, fc = build(mode, *load)
        for opt in distributed_optimizers(optimizer):  # a fresh torch Adam has no state to load into yet
            opt._init_optimizer_states_with_dummy_values()
        model_sd = model.module.sharded_state_dict()
        loaded = dist_checkpointing.load({"model": model_sd, "optimizer": optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata=meta), "fair_cast": fair_cast_checkpoint.sharded_state_dict(fc, model_sd)},
            ckpt)
        model.module.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        fair_cast_checkpoint.load_state_dict(fc, loaded["fair_cast"])
        restored = full_state(model, optimizer, fc, load[0], tp_rank, pp_rank)
        serve(optimizer)
        resumed = full_state(model, optimizer, fc, load[0], tp_rank, pp_rank)
        if torch.distributed.get_rank() == 0:
            report[mode] = {"restored_differs": same_state(saved, restored), "resumed_differs": same_state(continued, resumed),
                            "step_changed": sum(int((continued["served"][n] != saved["served"][n]).sum())
                                                for n in saved["served"]),
                            "residual_nonzero": sum(int((r != 0).sum()) for r in saved.get("residual", {}).values()),
                            "caster_step": fc.adapters[0].caster.step}
        del model, optimizer, fc
    return report


def expert_parallel_refusal() -> str:
    """attach under expert_model_parallel_size 2 (a dense model: the check is on the layout): the message."""
    from megatron.core import parallel_state as ps

    from faircast_ds.shard.adapter import UnsupportedSetupError

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        build("stochastic", 1, 1)
    except UnsupportedSetupError as exc:
        return str(exc)
    return ""


def main() -> None:
    torch.distributed.init_process_group("gloo")
    schedule_stand_ins()
    world = torch.distributed.get_world_size()
    reports = [run_layout(layout[0], layout[1], world, *layout[2:]) for layout in LAYOUTS]
    refusal = expert_parallel_refusal() if os.environ.get("EXPERT_CHECK") == "1" else None
    checkpoint = None
    if os.environ.get("CHECKPOINT_LAYOUTS"):  # "tp,pp>tp,pp": save on the first, load on the second
        save, load = (tuple(int(x) for x in side.split(",")) for side in os.environ["CHECKPOINT_LAYOUTS"].split(">"))
        checkpoint = checkpoint_across_layouts(save, load, OUT)
    if torch.distributed.get_rank() == 0:
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "layouts.json"), "w") as f:
            json.dump({"layouts": reports, "expert_parallel_refusal": refusal, "checkpoint": checkpoint}, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
