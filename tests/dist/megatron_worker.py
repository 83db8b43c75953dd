"""Megatron-Core's DistributedOptimizer (bf16 params, fp32 main params) with Fair Cast on CPU ranks over
gloo, launched by torchrun for tests/megatron_tests/test_megatron.py. ROUTE=runtime replaces the optimizer's copy at
runtime; ROUTE=hook runs on a patched Megatron-Core copy (put first on PYTHONPATH by the test).

Every case starts from the same model and deterministic fp32 main values and takes a few steps. Each
rank checks its own shards against ``faircast_ds.casting`` of its main shards; rank 0 checks the
all-gathered parameters against the cast of the full fp32 parameter (the bits do not depend on where
the shards were cut) and saves every parameter's served bits for the cross-route comparison.

On the runtime route it also checkpoints: 3 steps, ``dist_checkpointing.save`` of the model, the optimizer
and Fair Cast's entry (``faircast_ds.megatron.checkpoint``), 3 more steps; then fresh objects load the
checkpoint and take the same 3 steps, which must give the same served bits, main params and residual,
bit for bit (``checkpoint_rank<r>.json``).
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

from faircast_ds.casting.bits import bf16_bits
from faircast_ds.casting.rules import cast  # noqa: E402
from faircast_ds.casting.noise import name_id  # noqa: E402

OUT = os.environ["OUT_DIR"]
ROUTE = os.environ["ROUTE"]  # "runtime" or "hook"
STEPS = 3
CASES = ["megatron", "nearest", "stochastic", "dither", "error_feedback"]  # "megatron": no Fair Cast at all


class TinyBf16(torch.nn.Module):
    """A few bf16 layers whose sizes make the data-parallel cut fall inside a parameter. Alone, the
    checkpoint case's model: Megatron-Core 0.16.1's ``dp_reshardable`` optimizer format asserts on a
    bucket a rank owns nothing of ("empty bucket encountered", ``distrib_optimizer.py:1610``), which
    Tiny's 11-element fp32 buffer is for rank 1."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.up = torch.nn.Linear(40, 37, dtype=torch.bfloat16)
        self.down = torch.nn.Linear(37, 11, dtype=torch.bfloat16)
        self.norm = torch.nn.Parameter(torch.ones(37, dtype=torch.bfloat16))

    def forward(self, x):
        return self.down(torch.relu(self.up(x)) * self.norm).float()


class Tiny(TinyBf16):
    """TinyBf16 and one fp32 parameter (registered last, as before)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.scale = torch.nn.Parameter(torch.full((11,), 0.5))  # kept in fp32: copied, never rounded

    def forward(self, x):
        return super().forward(x) * self.scale


def build(mode: str, module_cls=None):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    from faircast_ds.megatron import attach
    from faircast_ds.megatron.adapters import distributed_optimizers, parameter_names
    from faircast_ds.megatron.shards import low_precision_shards

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, bf16=True,
                               params_dtype=torch.bfloat16, use_cpu_initialization=True)
    torch.manual_seed(0)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                          grad_reduce_in_fp32=True),
                                    (module_cls or Tiny)(config))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-5, bf16=True,
                                                       use_distributed_optimizer=True), [model])
    fc = None
    if mode != "megatron":
        fc = attach(optimizer, {"mode": mode, "seed": 77}, route=ROUTE)
    for opt in distributed_optimizers(optimizer):
        for shard, main, _ in low_precision_shards(opt, parameter_names(opt)):
            main.data.copy_(deterministic_master(name_id(shard.name), shard.start, shard.numel))
    return model, optimizer, fc


def train_step(model, optimizer, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 40, generator=g).to(torch.bfloat16)
    optimizer.zero_grad()
    model.zero_grad_buffer()
    loss = model(x).pow(2).mean()
    loss.backward()
    model.finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok
    return float(loss)


def run_case(mode: str, hook_calls: list) -> dict:
    model, optimizer, fc = build(mode)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    replay = {}
    report = {"exact_replay": True, "full_is_cast_of_full_master": True, "split_param": False,
              "caster_step": None, "hook_calls": 0, "losses": [], "changed": []}
    names = dict(model.named_parameters())
    calls_before = len(hook_calls)
    bits, masters = [], []
    for step in range(1, STEPS + 1):
        report["losses"].append(train_step(model, optimizer, step, rank))
        served_full = {n.removeprefix("module."): bf16_bits(p.detach().reshape(-1)).clone()
                       for n, p in names.items() if p.dtype == torch.bfloat16}
        bits.append(served_full)
        if fc is None:
            continue
        pieces = []
        for adapter in fc.adapters:
            for key, main, served, slices in adapter.flat_groups():
                (s,) = slices
                res = replay.setdefault(key, torch.zeros(s.numel)) if mode == "error_feedback" else None
                want = cast(main.detach().clone(), mode, seed=77, step=step, name=s.name, start=s.start, residual=res)
                report["exact_replay"] &= bool(torch.equal(bf16_bits(served), bf16_bits(want)))
                report["split_param"] |= s.start > 0
                pieces.append((s.name, s.start, main.detach().clone()))
        everyone = [None] * world
        torch.distributed.all_gather_object(everyone, pieces)
        if rank == 0:
            full = {n: torch.full((bits[-1][n].numel(),), float("nan")) for n in bits[-1]}
            for rank_pieces in everyone:
                for name, start, main in rank_pieces:
                    full[name][start:start + main.numel()] = main
            masters.append(full)  # for tests/megatron_tests/test_megatron_releases.py's reference casts
            for name, master in full.items():
                if mode == "error_feedback":  # its residual is per element: replayed above
                    break
                assert not torch.isnan(master).any(), f"{name}: no rank owns some elements"
                want = bf16_bits(cast(master, mode, seed=77, step=step, name=name, start=0))
                report["full_is_cast_of_full_master"] &= bool(torch.equal(want, served_full[name]))
        report["changed"].append(fc.stats()["changed_fraction"])
    if fc is not None:
        report["caster_step"] = fc.adapters[0].caster.step
        report["route"] = fc.route.removeprefix("megatron-")  # "megatron-runtime" -> "runtime"
        report["replaced_at_runtime"] = any("_copy_main_params_to_model_params" in vars(a.optimizer)
                                            for a in fc.adapters)
    report["hook_calls"] = len(hook_calls) - calls_before
    if fc is not None:
        from faircast_ds.megatron import guard

        report["guard_steps_checked"] = [g.steps_checked for g in guard.guards(fc)]
    return report, bits, masters


REFUSED_FIELDS = {"ddp": {"use_megatron_fsdp": True, "use_custom_fsdp": True, "fp8_param_gather": True,
                          "fp4_param_gather": True},
                  "optimizer": {"fp8_recipe": "delayed", "reuse_grad_buf_for_mxfp8_param_ag": True}}


def refusals() -> dict:
    """For each setting above that this release's config dataclasses have (read here with dataclasses, not
    through compat), whether attach's checks refuse a real DistributedOptimizer with it turned on."""
    import copy
    import dataclasses

    from faircast_ds.shard.adapter import UnsupportedSetupError
    from faircast_ds.megatron.adapters import distributed_optimizers
    from faircast_ds.megatron.support import check_supported

    _, optimizer, _ = build("megatron")
    (opt,) = distributed_optimizers(optimizer)
    out = {}
    for which, settings in REFUSED_FIELDS.items():
        attr = "ddp_config" if which == "ddp" else "config"
        present = {f.name for f in dataclasses.fields(getattr(opt, attr))}
        for field, value in settings.items():
            if field not in present:
                continue
            original = getattr(opt, attr)
            changed = copy.copy(original)
            object.__setattr__(changed, field, value)
            setattr(opt, attr, changed)
            try:
                check_supported(opt)
                out[field] = None
            except UnsupportedSetupError as exc:
                out[field] = str(exc)
            finally:
                setattr(opt, attr, original)
    return out


def bypassed_cases() -> dict:
    """The guard on the runtime route, each case on fresh objects: Megatron's own round-to-nearest copy
    run again after Fair Cast's cast ("step"), Megatron's copy instead of Fair Cast's ("never_cast"), one
    served element flipped before Fair Cast's checkpoint load ("load"); "load_clean" is the control."""
    from faircast_ds.shard.adapter import UnsupportedSetupError
    from faircast_ds.megatron import checkpoint as fair_cast_checkpoint
    from faircast_ds.megatron.adapters import distributed_optimizers

    rank = torch.distributed.get_rank()
    out = {}
    for case in ("step", "never_cast", "load", "load_clean"):
        model, optimizer, fc = build("stochastic")
        (opt,) = distributed_optimizers(optimizer)
        ours = opt._copy_main_params_to_model_params
        megatrons = type(opt)._copy_main_params_to_model_params.__get__(opt)
        if case == "step":
            def twice(ours=ours, megatrons=megatrons):
                ours()
                megatrons()
            opt._copy_main_params_to_model_params = twice
        elif case == "never_cast":
            opt._copy_main_params_to_model_params = megatrons
        try:
            for step in (1, 2):
                train_step(model, optimizer, step, rank)
            if case.startswith("load"):
                state = fair_cast_checkpoint.sharded_state_dict(fc)  # stochastic: (format, mode, seed, step)
                if case == "load" and rank == 1:
                    _, _, served, _ = next(iter(fc.adapters[0].flat_groups()))
                    served.view(torch.int16)[0] ^= 1  # the last mantissa bit of this rank's first element
                fair_cast_checkpoint.load_state_dict(fc, state)
            out[case] = {"raised": False}
        except UnsupportedSetupError as exc:
            out[case] = {"raised": True, "type": type(exc).__name__, "message": str(exc)}
    return out


def count_hook_calls(hook_calls: list) -> None:
    """Wrap the cast hook (after ours is installed) to count the refreshes it took."""
    from megatron.core.optimizer import param_cast

    inner = param_cast.get_main_param_cast_hook()

    def counting(optimizer, shards):
        took = inner(optimizer, shards)
        if took:
            hook_calls.append(len(shards))
        return took

    param_cast.set_main_param_cast_hook(counting)


CHECKPOINT_MODES = ["stochastic", "error_feedback"]


def checkpoint_state(model, optimizer, fc, loading: bool) -> dict:
    from megatron.core.transformer.utils import sharded_state_dict_default

    from faircast_ds.megatron import checkpoint as fair_cast_checkpoint

    model_sd = sharded_state_dict_default(model.module, "", (), None)
    optim_sd = optimizer.sharded_state_dict(model_sd, is_loading=loading,
                                            metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    return {"model": model_sd, "optimizer": optim_sd, "fair_cast": fair_cast_checkpoint.sharded_state_dict(fc)}


def state_of(model, fc) -> dict:
    """This rank's view: every served parameter (gathered) and its own main and residual pieces."""
    out = {f"served/{n}": bf16_bits(p.detach().reshape(-1)).clone() for n, p in model.named_parameters()}
    for adapter in fc.adapters:
        for key, main, _, _ in adapter.flat_groups():
            out[f"main/{key}"] = main.detach().clone().view(torch.int32)
            res = adapter.caster.residuals.get(key)
            if res is not None:
                out[f"residual/{key}"] = res.clone().view(torch.int32)
    out["step"] = fc.adapters[0].caster.step
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def checkpoint_case(mode: str, ckpt_dir: str) -> dict:
    """Save after step 3, run to step 6; fresh objects load and run to step 6: bitwise the same."""
    from megatron.core import dist_checkpointing

    from faircast_ds.shard.state import MissingStateError
    from faircast_ds.megatron import checkpoint as fair_cast_checkpoint
    from faircast_ds.megatron.adapters import distributed_optimizers

    rank = torch.distributed.get_rank()
    if rank == 0:
        os.makedirs(ckpt_dir)
    torch.distributed.barrier()
    model, optimizer, fc = build(mode, TinyBf16)
    for step in range(1, 4):
        train_step(model, optimizer, step, rank)
    dist_checkpointing.save(checkpoint_state(model, optimizer, fc, loading=False), ckpt_dir)
    saved, straight = state_of(model, fc), []
    for step in range(4, 7):
        train_step(model, optimizer, step, rank)
        straight.append(state_of(model, fc))

    def fresh():
        model, optimizer, fc = build(mode, TinyBf16)
        for opt in distributed_optimizers(optimizer):  # a fresh torch Adam has no state to load into yet
            opt._init_optimizer_states_with_dummy_values()
        loaded = dist_checkpointing.load(checkpoint_state(model, optimizer, fc, loading=True), ckpt_dir)
        model.module.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        # Megatron-Core 0.16.1 without Apex/TE: after a dp_reshardable load every parameter's torch Adam
        # state holds one shared step tensor with the dummy initialization's value, 1 (the checkpoint's
        # step is only in the param groups), so Adam's bias correction would differ from the run that never
        # stopped whatever Fair Cast does; put the saved step back, one tensor per parameter
        for opt in distributed_optimizers(optimizer):
            for group in opt.optimizer.param_groups:
                for param in group["params"]:
                    opt.optimizer.state[param]["step"] = torch.tensor(float(group["step"]))
        return model, optimizer, fc, loaded

    model, optimizer, fc, loaded = fresh()
    fair_cast_checkpoint.load_state_dict(fc, loaded["fair_cast"])
    report = {"restored_equal_saved": same(state_of(model, fc), saved), "continued_equal": []}
    for i, step in enumerate(range(4, 7)):
        train_step(model, optimizer, step, rank)
        report["continued_equal"].append(same(state_of(model, fc), straight[i]))
    report["residual_nonzero"] = sum(int((v != 0).sum()) for k, v in saved.items() if k.startswith("residual/"))
    # the same checkpoint read as if it had no Fair Cast entry
    model, optimizer, fc, _ = fresh()
    try:
        fair_cast_checkpoint.load_state_dict(fc, None, step=3)
        train_step(model, optimizer, 4, rank)
        report["without_entry"] = {"ok": True, "continued_equal": same(state_of(model, fc), straight[0])}
    except MissingStateError as exc:
        report["without_entry"] = {"ok": False, "message": str(exc)}
    # the control: what a resume did before Fair Cast's entry existed (step kept, residual back at zero)
    model, optimizer, fc, _ = fresh()
    for adapter in fc.adapters:  # (the load fills the residual buffers in place: empty them)
        adapter.caster.step = 3
        adapter.caster.residuals.clear()
    train_step(model, optimizer, 4, rank)
    report["zero_residual_continued_equal"] = same(state_of(model, fc), straight[0])
    return report


def main() -> None:
    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state
    import megatron.core

    parallel_state.initialize_model_parallel()
    rank = torch.distributed.get_rank()
    hook_calls: list = []
    result = {"route": ROUTE, "megatron_file": megatron.core.__file__, "world": torch.distributed.get_world_size(),
              "cases": {}}
    if ROUTE == "hook":
        from faircast_ds.megatron import hook

        result["has_hook"] = hook.megatron_has_cast_hook()
        build("stochastic")  # installs our hook; count from here on
        count_hook_calls(hook_calls)
    all_bits, all_masters = {}, {}
    for mode in CASES:
        result["cases"][mode], all_bits[mode], all_masters[mode] = run_case(mode, hook_calls)
    if ROUTE == "runtime":
        result["bypassed"] = bypassed_cases()
        result["refusals"] = refusals()
    from faircast_ds.megatron import compat

    result["release"], result["range_problem"] = compat.release(), compat.release_problem()
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"report_rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    if ROUTE == "runtime" and os.environ.get("CHECKPOINT", "1") == "1":  # (0: a release without dp_reshardable)
        if not torch.cuda.is_available():  # the async writer's staging sync (filesystem_async.py:230), a no-op on CPU
            torch.cuda.synchronize = lambda *args, **kwargs: None
        checkpoints = {mode: checkpoint_case(mode, os.path.join(OUT, f"ckpt_{mode}")) for mode in CHECKPOINT_MODES}
        with open(os.path.join(OUT, f"checkpoint_rank{rank}.json"), "w") as f:
            json.dump(checkpoints, f, indent=1)
    if rank == 0:
        torch.save(all_bits, os.path.join(OUT, "bits.pt"))
        torch.save(all_masters, os.path.join(OUT, "masters.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
