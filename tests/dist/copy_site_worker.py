"""ZeRO-1/2 and BF16_Optimizer: the cast takes the place of DeepSpeed's own copy (tests/deepspeed_tests/test_copy_site.py).

On the runtime route (unpatched DeepSpeed), for each case and each of 3 optimizer steps, every rank
records:
- every write into its served bf16 partition and into DeepSpeed's pinned offload buffer during
  ``engine.step()``: the caster's casts (``ShardCaster.cast_flat``, whose fused kernel no dispatch mode
  sees) and every mutating aten op DeepSpeed runs (a TorchDispatchMode; collectives left out), each
  copy marked a no-op when it copies a tensor onto itself;
- the served bits, against the oracle (``faircast_ds.casting.reference.cast_reference``, element by element)
  and against the bits served before the step, for the change count the caster reported.
It also checks that a release whose ``step()`` no longer calls ``_optimizer_step`` (the copy site moved)
is stopped by the guard. One JSON file per rank in $OUT_DIR.
"""
from __future__ import annotations

import os
import sys
import types

import deepspeed
import deepspeed.comm as dist
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ds_config, finish_and_exit, train_step, tiny_qwen3, write_json  # noqa: E402

from faircast_ds.shard.adapter import UnsupportedSetupError  # noqa: E402
from faircast_ds.casting.reference import cast_reference  # noqa: E402

OUT = os.environ["OUT_DIR"]
STEPS = 3
SEED = 1234
CASES = [("zero2", "dither"), ("zero2+offload", "dither"), ("zero1", "dither"), ("bf16_optimizer", "dither"),
         ("zero2", "error_feedback")]


def build(stage: str, mode: str):
    model = tiny_qwen3(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(mode, stage=stage, seed=SEED))
    from faircast_ds import get_fair_cast

    return engine, get_fair_cast(engine)


def region(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def overlaps(t: torch.Tensor, r: tuple[int, int]) -> bool:
    lo, hi = region(t)
    return lo < r[1] and r[0] < hi


class Writes(TorchDispatchMode):
    """Every mutating aten op (collectives aside) that writes into one of ``regions`` (into the fp32
    masters: only copies of a tensor onto itself, the optimizer's update aside)."""

    def __init__(self, regions: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        self.regions = regions
        self.seen: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if not (name.startswith("c10d.") or "all_gather" in name or "allgather" in name):
            schema = func._schema.arguments
            for i, arg in enumerate(schema):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                t = args[i] if i < len(args) else kwargs.get(arg.name)
                if not isinstance(t, torch.Tensor):
                    continue
                for what, r in self.regions.items():
                    if overlaps(t, r):
                        src = args[1] if "copy_" in name and len(args) > 1 else None
                        noop = (isinstance(src, torch.Tensor) and src.data_ptr() == t.data_ptr()
                                and src.dtype == t.dtype and src.shape == t.shape and src.stride() == t.stride())
                        if what.startswith("master") and not noop:  # the optimizer's own update of it
                            continue
                        self.seen.append({"op": name, "into": what, "noop": noop,
                                          "from": next((w for w, rr in self.regions.items()
                                                        if isinstance(src, torch.Tensor) and overlaps(src, rr)), None)})
        return func(*args, **kwargs)


def oracle_mismatches(fc, mode: str, residuals: dict) -> int:
    """Served elements of this rank that differ from the oracle's cast of the master at this step."""
    bad = 0
    for key, master, served, slices in fc.adapter.flat_groups():
        got = served.detach().view(-1).view(torch.int16)
        for s in slices:
            if s.is_padding:
                continue
            res = residuals[key].narrow(0, s.offset, s.numel) if mode == "error_feedback" else None
            want = cast_reference(master.detach().view(-1).narrow(0, s.offset, s.numel), mode, seed=SEED,
                                  step=fc.caster.step, name=s.name, start=s.start, residual=res).view(torch.int16)
            bad += int((got.narrow(0, s.offset, s.numel) != want).sum())
    return bad


def case(stage: str, mode: str) -> dict:
    engine, fc = build(stage, mode)
    adapter, caster = fc.adapter, fc.caster
    staging = {k: adapter.staging(k) for k, _, _, _ in adapter.flat_groups()}
    residuals = {k: torch.zeros(m.numel()) for k, m, _, _ in adapter.flat_groups()}
    casts: list[dict] = []
    installed = caster.cast_flat

    def recorded(key, master, served, slices, *args, **kwargs):
        into = "staging" if staging.get(key) is not None and served.data_ptr() == staging[key].data_ptr() else (
            "served" if served.data_ptr() == adapter.served(key).data_ptr() else "other")
        casts.append({"key": key, "into": into})
        return installed(key, master, served, slices, *args, **kwargs)

    caster.cast_flat = recorded
    steps = []
    for step in range(1, STEPS + 1):
        before = {k: s.detach().view(-1).view(torch.int16).clone() for k, _, s, _ in adapter.flat_groups()}
        regions = {}
        for k, m, s, _ in adapter.flat_groups():
            regions[f"served{k}"] = region(s.detach().view(-1))
            regions[f"master{k}"] = region(m.detach().view(-1))
            if staging[k] is not None:
                regions[f"staging{k}"] = region(staging[k])
        casts.clear()
        writes = Writes(regions)
        from common import batch

        x = batch(step, engine.global_rank)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        with writes:
            engine.step()
        observed = 0
        for k, _, s, slices in adapter.flat_groups():
            now = s.detach().view(-1).view(torch.int16)
            for sl in (sl for sl in slices if not sl.is_padding):
                observed += int((now.narrow(0, sl.offset, sl.numel) != before[k].narrow(0, sl.offset, sl.numel)).sum())
        total = torch.tensor([float(observed)], dtype=torch.float64)
        dist.all_reduce(total)
        stats = fc.stats()
        steps.append({"step": caster.step, "casts": list(casts), "writes": writes.seen,
                      "oracle_mismatches": oracle_mismatches(fc, mode, residuals),
                      "stats_changed": stats["changed"], "observed_changed": float(total[0])})
    groups = [k for k, _, _, _ in adapter.flat_groups()]
    return {"optimizer": type(engine.optimizer).__name__, "groups": groups,
            "offload_staging": {str(k): v is not None for k, v in staging.items()},
            "guard_steps_checked": fc.extras["guard"].steps_checked, "steps": steps}


def moved_site() -> dict:
    """A release whose step() no longer reaches the copy site Fair Cast wraps: DeepSpeed's own
    ``_optimizer_step`` again, so its round-to-nearest copy serves. The guard must stop the step."""
    engine, fc = build("zero2", "dither")
    opt = engine.optimizer
    opt._optimizer_step = types.MethodType(type(opt)._optimizer_step, opt)
    try:
        train_step(engine, 1, engine.global_rank)
        return {"raised": False}
    except UnsupportedSetupError as exc:
        return {"raised": True, "message": str(exc)}


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    report = {"world": dist.get_world_size(), "cases": {}, "errors": {}}
    for stage, mode in CASES:
        try:
            report["cases"][f"{stage}/{mode}"] = case(stage, mode)
        except Exception as exc:  # noqa: BLE001 - the test names the case and shows the error
            import traceback

            report["errors"][f"{stage}/{mode}"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2500:]}"
    report["moved_site"] = moved_site()
    write_json(os.path.join(OUT, f"copy_site_rank{rank}.json"), report)
    finish_and_exit()


if __name__ == "__main__":
    from common import freeze_the_imports

    freeze_the_imports()  # gc.collect() (DeepSpeed's and ours) then skips the imported modules
    main()
