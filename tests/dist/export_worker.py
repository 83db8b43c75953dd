"""Export and weight-sync checks under the real `deepspeed` runner, one launch on 2 CPU ranks
(driven by tests/export/test_export_zero.py).

  served   ZeRO-3 and ZeRO-2: served_weights() against the bits the forward used, what it gathers
           and holds; save_hf() and logits of the loaded export against the engine's eval forward
  inspect  a ZeRO-3 error_feedback checkpoint and an export at the same step, with the statistics
           `faircast-ds inspect` should print, computed here from the live engine
  sync     one session per cast mode (ZeRO-3) and one under ZeRO-2 with the receiver process the
           test started: dense first, then deltas after each step; bytes per update, digests of
           the served weights after each sync, greedy tokens at the end

Writes JSON per rank into $OUT_DIR.
"""
from __future__ import annotations

import argparse
import os
import sys

import deepspeed
import deepspeed.comm as dist
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import batch, ds_config, finish_and_exit, full_served_bits, tensors_in, train_step, write_json  # noqa: E402
from export_common import bits_digest, greedy  # noqa: E402
from faircast_bench.builders import tiny_qwen3  # noqa: E402  (as from_pretrained(dtype=bfloat16) builds it)

import faircast_ds  # noqa: E402
from faircast_ds.casting.bits import bf16_bits, fp32_bits
from faircast_ds.casting.modes import MODES  # noqa: E402
from faircast_ds.export import WeightSender, save_hf, served_specs, served_weights  # noqa: E402

OUT = os.environ["OUT_DIR"]


def build(stage: str, mode: str, lr: float):
    faircast_ds.install()  # the interpreter-start hook does this too; explicit, to not depend on it here
    model = tiny_qwen3(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(mode, stage=stage))
    return engine, faircast_ds.get_fair_cast(engine)


class CollectiveTracer(TorchDispatchMode):
    """Records the dtypes of every collective dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d.") or "gather" in name:
            dtypes = sorted({str(t.dtype) for t in tensors_in((args, kwargs))})
            self.collectives.append(f"{name}:{','.join(dtypes)}")
        return func(*args, **(kwargs or {}))


def forward_used_bits(engine) -> dict[str, torch.Tensor]:
    """The bits of every parameter as the forward read them (captured by pre-hooks that run after
    DeepSpeed's own gathering hooks)."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for prefix, module in engine.module.named_modules():
        def hook(mod, args, prefix=prefix):
            for n, p in mod.named_parameters(recurse=False):
                seen[f"{prefix}.{n}" if prefix else n] = bf16_bits(p.data.reshape(-1)).clone()
        handles.append(module.register_forward_pre_hook(hook))
    engine.eval()
    with torch.no_grad():
        engine(input_ids=batch(99, 0))
    for h in handles:
        h.remove()
    return seen


def served_checks(stage: str, root: str) -> dict:
    engine, fc = build(stage, "stochastic", lr=1e-5)
    for step in (1, 2):
        train_step(engine, step, engine.global_rank)
    used = forward_used_bits(engine)
    params = dict(engine.module.named_parameters())
    tracer = CollectiveTracer()
    names, equal_to_forward, dtypes, shapes_ok, zero_copy = [], True, set(), True, True
    max_available, others_held = 0, []
    if stage == "zero3":
        engine.empty_partition_cache()  # the eval forward leaves parameters gathered for reuse; release them
    specs = {s.name: s for s in served_specs(engine)}
    with tracer:
        for name, t in served_weights(engine):
            names.append(name)
            dtypes.add(str(t.dtype))
            shapes_ok &= tuple(t.shape) == specs[name].shape
            equal_to_forward &= bool(torch.equal(bf16_bits(t.reshape(-1)), used[name]))
            if stage == "zero3":  # full (non-persistent) parameters held right now
                from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

                held = [n for n, p in params.items()
                        if p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_persist]
                max_available = max(max_available, len(held))
                others_held += [n for n in held if n != name]
            else:
                zero_copy &= t.data_ptr() == params[name].data_ptr()
    res = {"names": names, "param_names": list(params), "forward_used": sorted(used),
           "equal_to_forward": equal_to_forward, "dtypes": sorted(dtypes), "shapes_ok": shapes_ok,
           "zero_copy": zero_copy, "max_full_params_held": max_available, "others_held": others_held,
           "collectives": sorted(set(tracer.collectives)), "n_collectives": len(tracer.collectives),
           "persistent": sorted(n for n, p in params.items() if getattr(p, "ds_persist", False))}
    # the export, and the logits of the model transformers loads from it
    target = os.path.join(root, f"{stage}_export")
    result = save_hf(engine, target, max_shard_bytes=20_000 if stage == "zero3" else 5 * 2**30)
    x = batch(7, 0)
    with torch.no_grad():
        trainer_logits = engine(input_ids=x).logits.detach().clone()
    served_digest = bits_digest(full_served_bits(engine))
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.bfloat16).eval()
        with torch.no_grad():
            loaded_logits = loaded(input_ids=x).logits
        from export_common import digest

        res["export"] = {
            "files": sorted(result.files), "version": result.version, "global_steps": engine.global_steps,
            "loaded_dtype": str(loaded.dtype), "logits_dtype": str(trainer_logits.dtype),
            "logits_equal": bool(torch.equal(trainer_logits.view(torch.int16), loaded_logits.view(torch.int16))),
            "logits_max_abs_diff": float((trainer_logits.float() - loaded_logits.float()).abs().max()),
            "weights_equal": digest(loaded.named_parameters()) == served_digest,
            "buffers": {n: str(b.dtype) for n, b in loaded.named_buffers()},
        }
    engine.train()
    return res


def spacing(bits_fp32: torch.Tensor) -> torch.Tensor:
    """bf16 spacing in the binade of an fp32 bit pattern (int64)."""
    exponent = ((bits_fp32 >> 23) & 0xFF).clamp(min=1)
    return torch.ldexp(torch.ones(bits_fp32.shape, dtype=torch.float64), exponent - 127 - 7)


def inspect_case(root: str) -> dict:
    """A checkpoint and an export of the same step, and the statistics computed from the live engine."""
    engine, fc = build("zero3", "error_feedback", lr=1e-4)
    for step in (1, 2, 3):
        train_step(engine, step, engine.global_rank)
    engine.save_checkpoint(os.path.join(root, "ckpt"), tag="step3")
    save_hf(engine, os.path.join(root, "ef_export"))
    sums = torch.zeros(5, dtype=torch.float64)  # elements, sum|res|/sp(served), sum|master-served|/sp(master)
    for key, master, served, slices in fc.adapter.flat_groups():
        res = fc.caster.residuals[key]
        for s in (s for s in slices if not s.is_padding):
            m = master.detach()[s.offset:s.offset + s.numel]
            v = served.detach()[s.offset:s.offset + s.numel].float()
            r = res[s.offset:s.offset + s.numel]
            sums[0] += s.numel
            sums[1] += float((r.double().abs() / spacing(fp32_bits(v))).sum())
            sums[2] += float(((m.double() - v.double()).abs() / spacing(fp32_bits(m))).sum())
            sums[3] += float((r != 0).sum())
            sums[4] += float((m != v).sum())
    dist.all_reduce(sums)
    n = sums[0].item()
    return {"elements": n, "mean_abs_residual_spacings": sums[1].item() / n,
            "mean_abs_master_minus_served_spacings": sums[2].item() / n,
            "nonzero_residual": sums[3].item(), "master_differs": sums[4].item(), "step": fc.caster.step}


def bf16_gathers(collectives: list[str]) -> int:
    """How many full-parameter gathers a traced stretch made: all-gathers of bf16 tensors (ZeRO-3's own
    gather of one parameter; the source's other collectives carry int64 counts and uint8 bitmaps)."""
    return sum(1 for c in collectives if "allgather" in c.split(":")[0].replace("_", "") and c.endswith(":torch.bfloat16"))


def sync_session(stage: str, mode: str, port: int, steps: int, lr: float) -> dict:
    engine, fc = build(stage, mode, lr=lr)
    sender = WeightSender(engine, host="127.0.0.1", port=port, timeout=120)
    params = dict(engine.module.named_parameters())
    gathered = {n for n, p in params.items() if hasattr(p, "ds_id") and not getattr(p, "ds_persist", False)}
    gathered_ever = {n for n, p in params.items() if hasattr(p, "ds_id")}
    updates = []
    previous: dict[str, torch.Tensor] = {}

    def push():
        nonlocal previous
        walked: list[tuple[str, int]] = []
        # what ZeRO-3 must gather to read: its parameters not held in full right now (DeepSpeed's own status;
        # persistent ones are held once a forward gathered them)
        absent = {n for n in gathered_ever if str(getattr(params[n], "ds_status", "")).endswith("NOT_AVAILABLE")}
        tracer = CollectiveTracer()
        with tracer:
            report = sender.sync(on_param=lambda item: walked.append((item.name, item.changed)))
        stats = fc.stats() if engine.global_steps else None
        now = full_served_bits(engine)  # DeepSpeed's own gather, outside the traced sync
        # the changed set from consecutive served snapshots, compared here element by element
        oracle = {n: int((now[n] != previous[n]).sum()) for n in now} if previous else None
        previous = now
        updates.append({"version": report.version, "kind": report.kind, "bytes": report.bytes,
                        "changed": report.changed, "elements": report.elements, "params": report.params,
                        "numel": report.numel, "gathers": report.gathers,
                        "tracking": report.tracking, "tracking_bytes": report.tracking_bytes,
                        "seconds": report.seconds, "digest": bits_digest(now),
                        "cast_changed": stats["changed"] if stats else None,
                        "walked": walked, "oracle_changed": oracle,
                        "traced_gathers": bf16_gathers(tracer.collectives),
                        "traced_collectives": len(tracer.collectives),
                        "expected_gathers": sum(1 for n, _ in walked if n in absent)})

    push()  # dense, version 0
    for step in range(1, steps + 1):
        train_step(engine, step, engine.global_rank)
        push()
    engine.eval()
    tokens = greedy(engine.module)  # all ranks: ZeRO-3 gathers inside every forward
    sender.close()
    return {"updates": updates, "tokens": tokens, "can_delta": sender.can_delta, "names": list(params),
            "gathered": sorted(gathered)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--receiver-port", type=int, required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    report = {"served": {}, "sync": {}}
    for stage in ("zero3", "zero2"):
        report["served"][stage] = served_checks(stage, args.root)
    report["inspect"] = inspect_case(args.root)
    for mode in MODES:
        report["sync"][f"zero3/{mode}"] = sync_session("zero3", mode, args.receiver_port, args.steps, args.lr)
    report["sync"]["zero2/stochastic"] = sync_session("zero2", "stochastic", args.receiver_port, 2, args.lr)
    write_json(os.path.join(OUT, f"export_rank{rank}.json"), report)
    finish_and_exit()


if __name__ == "__main__":
    from common import freeze_the_imports

    freeze_the_imports()  # gc.collect() (DeepSpeed's and ours) then skips the imported modules
    main()
