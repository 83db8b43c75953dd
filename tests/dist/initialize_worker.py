"""What initialize does with each config, on one rank under the `deepspeed` runner: every setup Fair
Cast cannot honour fails with a message naming it; align_rounding from the JSON is applied.
Writes $OUT_DIR/initialize.json."""
from __future__ import annotations

import copy
import os
import sys

import deepspeed
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ds_config, finish_and_exit, tiny_qwen3, train_step, write_json  # noqa: E402


def with_zero(**zero):
    cfg = ds_config("stochastic")
    cfg["zero_optimization"].update(zero)
    return cfg


def with_top(**keys):
    cfg = ds_config("stochastic")
    cfg.update(keys)
    return cfg


def fp16_instead_of_bf16():
    cfg = ds_config("stochastic")
    del cfg["bf16"]
    cfg["fp16"] = {"enabled": True}
    return cfg


def fp32_only():
    cfg = ds_config("stochastic")
    del cfg["bf16"]
    return cfg


def fair_cast(section):
    cfg = ds_config(None)
    cfg["fair_cast"] = section
    return cfg


CASES = {
    "zero_stage_0": with_zero(stage=0),
    "fp16": fp16_instead_of_bf16(),
    "no_bf16": fp32_only(),
    "nvme_param_offload": with_zero(offload_param={"device": "nvme", "nvme_path": "/tmp/faircast_nvme_unused"}),
    "quantized_weights": with_zero(zero_quantized_weights=True),
    "hpz": with_zero(zero_hpz_partition_size=2),
    "super_offload": with_zero(offload_optimizer={"device": "cpu", "super_offload": True}),
    "zenflow": with_zero(offload_optimizer={"device": "cpu"}, zenflow={"topk_ratio": 0.1}),
    "nvme_optimizer_offload": with_zero(offload_optimizer={"device": "nvme", "nvme_path": "/tmp/faircast_nvme_unused"}),
    "quantized_nontrainable_weights": with_zero(zero_quantized_nontrainable_weights=True),
    "torch_autocast": with_top(torch_autocast={"enabled": True}),
    "low_precision_masters": with_top(bf16={"enabled": True, "bf16_master_weights_and_grads": True}),
    "misspelled_key": fair_cast({"enabled": True, "moed": "stochastic"}),
    "wrong_type": fair_cast({"enabled": True, "seed": "1234"}),
    "unknown_mode": fair_cast({"mode": "stochastc"}),
    "not_an_object": fair_cast("stochastic"),
    "bad_align_engine": fair_cast({"align_rounding": {"engine": "sglng"}}),
    "bad_diagnostics": fair_cast({"diagnostics": {"evry": 5}}),
}


def attempt(cfg, *, version=None):
    model = tiny_qwen3()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    saved = deepspeed.__version__
    if version:
        deepspeed.__version__ = version
    try:
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=copy.deepcopy(cfg))
        from faircast_ds import get_fair_cast

        return {"ok": True, "attached": get_fair_cast(engine) is not None}, engine
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        return {"ok": False, "type": type(exc).__name__, "message": str(exc)}, None
    finally:
        deepspeed.__version__ = saved


def alignment_from_json():
    """align_rounding in the DeepSpeed JSON aligns the engine's module: its forward equals the engine
    profile's reference forward bit for bit (and differs from HF eager)."""
    from faircast_ds import get_fair_cast
    from faircast_ds.align import reference_logits
    from faircast_bench.builders import alignment_lm, token_ids

    model, ids = alignment_lm("qwen3"), token_ids()
    expected = reference_logits(model, ids, "sglang")
    eager = reference_logits(model, ids, "hf")
    cfg = ds_config(None)
    cfg["fair_cast"] = {"mode": "nearest", "align_rounding": {"engine": "sglang"}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    return {"ok": True, "aligned": get_fair_cast(engine).alignment is not None,
            "equals_engine_reference": bool(torch.equal(logits, expected)),
            "differs_from_hf_eager": not torch.equal(logits, eager)}


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    out = {name: attempt(cfg)[0] for name, cfg in CASES.items()}
    out["unverified_deepspeed"] = attempt(ds_config("stochastic"), version="0.99.0")[0]
    out["disabled"] = attempt(fair_cast({"enabled": False}))[0]
    out["absent"] = attempt(ds_config(None))[0]
    # a diverged master is named, not served
    result, engine = attempt(ds_config("stochastic"))
    from faircast_ds import get_fair_cast

    _, master, _, slices = next(get_fair_cast(engine).adapter.flat_groups())
    master.data[slices[1].offset + 5] = float("nan")
    try:
        train_step(engine, 1, 0)
        out["nonfinite"] = {"ok": True}
    except Exception as exc:  # noqa: BLE001
        out["nonfinite"] = {"ok": False, "type": type(exc).__name__, "message": str(exc), "param": slices[1].name}
    out["alignment"] = alignment_from_json()
    write_json(os.path.join(os.environ["OUT_DIR"], "initialize.json"), out)
    finish_and_exit()


if __name__ == "__main__":
    from common import freeze_the_imports

    freeze_the_imports()  # gc.collect() (DeepSpeed's and ours) then skips the imported modules
    main()
