"""A training script that builds its DeepSpeed config dict in code, as OpenRLHF does, driving
OpenRLHF's own builders (``get_train_ds_config``, ``get_eval_ds_config``,
``get_optimizer_grouped_parameters`` from openrlhf/utils/deepspeed/deepspeed_utils.py) and calling
``deepspeed.initialize`` as its DeepspeedStrategy does. Nothing in it mentions Fair Cast: the launcher
sets FAIRCAST_DS_CONFIG (a path to a JSON file with the section).

The module is loaded from its file: importing the ``openrlhf.utils`` package pulls in OpenRLHF's
math grader, Ray and flash-attn, which a CPU machine does not have; the builder itself needs only
deepspeed, torch and packaging.

Per rank, in one launch:
1. env route: the actor engine (OpenRLHF's train config) and a reference engine (its eval config,
   ZeRO-3 without optimizer: DeepSpeedZeRoOffload), 3 steps; served bits, the banner's source, and
   DeepSpeed's fp32 masters with the served bits for the oracle (openrlhf_style.pt);
2. JSON route: FAIRCAST_DS_CONFIG removed, the same section put into the same dict, the same model
   and steps; served bits;
3. FAIRCAST_DS_CONFIG on rank 0 only: the ranks disagree, and initialize says so on every rank;
4. rank 1 builds its engine with DeepSpeed's own, unwrapped ``__init__`` (as on a node without
   faircast-ds): rank 0 names rank 1 after the bounded wait (the store's timeout, shortened to 5 s
   here) instead of hanging in a collective rank 1 never joins;
5. the same with ``enabled: false`` on rank 0: the engine builds, after at most that wait.
Rank 0 writes openrlhf_style.json.
"""
from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import finish, full_served_bits, tiny_qwen3, train_step, write_json  # noqa: E402
from served_record import snapshot  # noqa: E402


def openrlhf_builders():
    import openrlhf

    path = os.path.join(openrlhf.__path__[0], "utils", "deepspeed", "deepspeed_utils.py")
    spec = importlib.util.spec_from_file_location("openrlhf_deepspeed_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def train_config(builders):
    """What OpenRLHF's DeepspeedStrategy.get_ds_train_config produces for --zero_stage 3 (defaults
    otherwise: --ds.zpg 1), with an AdamW section as _ds_init_train_model writes it (torch's AdamW here:
    DeepSpeed's fused Adam needs a GPU build)."""
    cfg = builders.get_train_ds_config(offload=False, adam_offload=False, stage=3, zpg=1, max_norm=1.0,
                                       optim_config={"type": "AdamW", "params": {
                                           "lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0,
                                           "torch_adam": True}})
    cfg["train_micro_batch_size_per_gpu"] = 2
    cfg["train_batch_size"] = 2 * int(os.environ["WORLD_SIZE"])
    return cfg


def build_actor(builders, cfg):
    import deepspeed
    from transformers.trainer import get_scheduler

    model = tiny_qwen3(std=0.1)
    params = builders.get_optimizer_grouped_parameters(model, 0.0)
    sched = functools.partial(get_scheduler, "cosine_with_min_lr", num_warmup_steps=0, num_training_steps=10,
                              scheduler_specific_kwargs={"min_lr_rate": 0.1})
    engine, *_ = deepspeed.initialize(model=model, optimizer=None, model_parameters=params, lr_scheduler=sched,
                                      config=cfg, args={"local_rank": int(os.environ.get("LOCAL_RANK", "-1"))},
                                      dist_init_required=True)
    return engine


def run_steps(engine, rank):
    for step in range(3):
        train_step(engine, step, rank)
    return full_served_bits(engine)


def main() -> None:
    import deepspeed

    from faircast_ds import FairCastConfigError, get_fair_cast

    out = os.environ["OUT_DIR"]
    rank = int(os.environ["RANK"])
    builders, builder_path = openrlhf_builders()
    env_file = os.environ["FAIRCAST_DS_CONFIG"]
    result: dict = {"builder": builder_path, "world": int(os.environ["WORLD_SIZE"])}

    # 1. the env route, with a reference engine as OpenRLHF builds it
    cfg = train_config(builders)
    actor = build_actor(builders, copy.deepcopy(cfg))
    eval_cfg = builders.get_eval_ds_config(offload=False, stage=3)
    eval_cfg["train_micro_batch_size_per_gpu"] = 2
    eval_cfg["train_batch_size"] = cfg["train_batch_size"]
    ref, *_ = deepspeed.initialize(model=tiny_qwen3(std=0.1), config=eval_cfg,
                                   args={"local_rank": int(os.environ.get("LOCAL_RANK", "-1"))}, dist_init_required=True)
    fc = get_fair_cast(actor)
    result.update(origin=fc.origin, mode=fc.config.mode, optimizer=type(actor.optimizer).__name__,
                  ref_optimizer=type(ref.optimizer).__name__, ref_attached=get_fair_cast(ref) is not None,
                  config_has_section="fair_cast" in cfg)
    env_bits = run_steps(actor, rank)
    # DeepSpeed's fp32 masters and the gathered served bits, with DeepSpeed's step count, for the oracle
    env_snapshot = snapshot(actor.module, actor.global_steps)

    # 2. the JSON route: the same section inside the dict, the variable gone
    del os.environ["FAIRCAST_DS_CONFIG"]
    with open(env_file) as f:
        section = json.load(f)
    json_cfg = {**train_config(builders), "fair_cast": section}
    twin = build_actor(builders, json_cfg)
    result["json_origin"] = get_fair_cast(twin).origin
    json_bits = run_steps(twin, rank)
    result["params"] = len(env_bits)
    result["bits_differ"] = [n for n in env_bits if not torch.equal(env_bits[n], json_bits[n])]

    # 3. the variable set on rank 0 only
    if rank == 0:
        os.environ["FAIRCAST_DS_CONFIG"] = env_file
    try:
        build_actor(builders, train_config(builders))
        result["disagreement"] = None
    except FairCastConfigError as exc:
        result["disagreement"] = str(exc)
    if rank == 0:
        del os.environ["FAIRCAST_DS_CONFIG"]

    # 4. rank 1 without Fair Cast
    from datetime import timedelta

    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    store.set_timeout(timedelta(seconds=5))
    wrapped = DeepSpeedEngine.__init__
    if rank == 1:
        DeepSpeedEngine.__init__ = wrapped.__wrapped__
    started = time.monotonic()
    try:
        build_actor(builders, {**train_config(builders), "fair_cast": {"mode": "stochastic", "seed": 5}})
        result["missing_rank"] = None
    except FairCastConfigError as exc:
        result["missing_rank"] = str(exc)
    result["missing_rank_seconds"] = time.monotonic() - started
    # 5. the same, with the section switched off on rank 0: not ours to stop, whatever rank 1 lacks
    started = time.monotonic()
    try:
        disabled = build_actor(builders, {**train_config(builders), "fair_cast": {"enabled": False}})
        result["disabled"] = {"ok": True, "attached": get_fair_cast(disabled) is not None}
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        result["disabled"] = {"ok": False, "message": f"{type(exc).__name__}: {exc}"}
    result["disabled_seconds"] = time.monotonic() - started
    DeepSpeedEngine.__init__ = wrapped
    if rank == 0:
        torch.save(env_snapshot, os.path.join(out, "openrlhf_style.pt"))
        write_json(os.path.join(out, "openrlhf_style.json"), result)
    finish()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
