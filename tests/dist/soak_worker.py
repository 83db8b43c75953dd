"""One launch of the kill-anywhere soak (driven by tests/system/test_soak.py) under the `deepspeed` runner.

Each run (a ZeRO stage and a Fair Cast mode, its own checkpoint folder under --root) resumes from the
checkpoint `latest` names, if any, trains up to --steps and saves every --every steps, the runs in
lockstep. FAIRCAST_TEST_KILL_AT=<site>:<n>[:<rank>] SIGKILLs that rank the n-th time this process
reaches the site (rank 1 by default; the `latest` sites are rank 0's) and records the site it died at in
OUT_DIR/killed.json. The sites (tests/system/test_soak.py checks that its CI schedule kills at each one):

  save:before_state   inside save_checkpoint, before Fair Cast's state is written
  save:between        after our state, before DeepSpeed's model file (its _save_checkpoint)
  save:zero_file      half-way through writing this rank's ZeRO optimizer file (a torn file)
  save:latest         while `latest` is written (the new one written, not yet renamed over the old)
  save:after_latest   right after `latest` names the new tag, before the save's last barrier
  load:zero           inside load_checkpoint, in DeepSpeed's ZeRO optimizer-state load
  load:state          inside load_checkpoint, restoring Fair Cast's state
  step:cast           in the middle of a step, at the n-th flat shard cast

Before resuming, every tag folder newer than the one `latest` names (a save that was killed) is loaded
into a spare engine: it must be refused with an error naming what is incomplete, or load completely
(the test compares it with the reference). --reference (the last, unkilled launch) then also trains
the same runs from scratch without a checkpoint and records each run's state at every save step.
Everything is written under OUT_DIR as it happens, since a launch may be killed at any moment.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import sys

import deepspeed
import deepspeed.comm as dist
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_worker import build, save_rank0, snapshot  # noqa: E402
from common import finish, train_step, write_json  # noqa: E402

from faircast_ds.shard.state import FairCastStateError  # noqa: E402
from faircast_ds.deepspeed.checkpoint import IncompleteCheckpointError  # noqa: E402

KILL_ENV = "FAIRCAST_TEST_KILL_AT"
SITES = ("save:before_state", "save:between", "save:zero_file", "save:latest", "save:after_latest", "load:zero",
         "load:state", "step:cast")


class Killer:
    """Counts the visits of the named sites; SIGKILLs this process at the chosen one."""

    def __init__(self, spec: str | None) -> None:
        self.site, self.n, self.rank, self.count = None, 0, None, 0
        if spec:
            parts = spec.split(":")
            site = ":".join(parts[:2])
            if site not in SITES or len(parts) not in (3, 4):
                raise ValueError(f"{KILL_ENV}={spec!r}: expected <site>:<n>[:<rank>], sites: {', '.join(SITES)}")
            self.site, self.n = site, int(parts[2])
            self.rank = int(parts[3]) if len(parts) == 4 else (0 if site in ("save:latest", "save:after_latest") else 1)

    def visit(self, site: str) -> bool:
        """Count a visit; True when this is the moment to die (the caller dies, or tears a file first)."""
        if site != self.site or dist.get_rank() != self.rank:
            return False
        self.count += 1
        return self.count == self.n

    def die(self) -> None:
        """Record where this rank dies (OUT_DIR/killed.json: the test checks that every documented site
        was reached), then SIGKILL this process."""
        with open(os.path.join(os.environ["OUT_DIR"], "killed.json"), "w") as f:  # closed before the kill
            json.dump({"site": self.site, "n": self.n, "rank": dist.get_rank()}, f)
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def install_kill_points(killer: Killer) -> None:
    """Wrap what save_checkpoint / load_checkpoint call, process-wide, so every engine reaches the sites."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.engine import DeepSpeedEngine

    from faircast_ds.deepspeed import checkpoint as checkpointing
    from faircast_ds.shard.caster import ShardCaster

    def before(obj, name, site):
        original = getattr(obj, name)

        def wrapped(*args, **kwargs):
            if killer.visit(site):
                killer.die()
            return original(*args, **kwargs)

        setattr(obj, name, wrapped)

    before(checkpointing, "save_state", "save:before_state")
    before(DeepSpeedEngine, "_save_checkpoint", "save:between")
    before(DeepSpeedEngine, "_load_zero_checkpoint", "load:zero")
    before(checkpointing, "restore_state", "load:state")
    before(ShardCaster, "cast_flat", "step:cast")

    save = TorchCheckpointEngine.save

    def torn_save(self, state_dict, path, *args, **kwargs):
        if path.endswith("optim_states.pt") and killer.visit("save:zero_file"):
            buffer = io.BytesIO()
            torch.save(state_dict, buffer)
            with open(path, "wb") as f:  # what a process killed half-way through the write leaves
                f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            killer.die()
        return save(self, state_dict, path, *args, **kwargs)

    TorchCheckpointEngine.save = torn_save

    replace = os.replace

    def replace_then_maybe_die(src, dst, *args, **kwargs):
        latest = os.path.basename(str(dst)) == "latest"
        if latest and killer.visit("save:latest"):
            killer.die()  # the new `latest` is written (latest.tmp), the old one still in place
        result = replace(src, dst, *args, **kwargs)
        if latest and killer.visit("save:after_latest"):
            killer.die()
        return result

    os.replace = replace_then_maybe_die


def tag_step(tag: str) -> int:
    m = re.fullmatch(r"global_step(\d+)", tag)
    return int(m.group(1)) if m else -1


def probe_partial(run_dir: str, stage: str, mode: str, latest_step: int, out: str, name: str) -> list:
    """Load every tag folder newer than `latest` into a spare engine: refused (and why), or loaded (its
    snapshot is written for the test to compare with the reference)."""
    found = []
    tags = sorted((t for t in os.listdir(run_dir) if tag_step(t) > latest_step), key=tag_step) \
        if os.path.isdir(run_dir) else []
    for tag in tags:
        engine, fc = build(stage, mode)
        try:
            engine.load_checkpoint(run_dir, tag=tag)
            save_rank0(snapshot(engine, fc), os.path.join(out, f"probe_{name}_{tag}.pt"))
            found.append({"tag": tag, "loaded": True})
        except (IncompleteCheckpointError, FairCastStateError) as exc:  # any other error fails the launch
            found.append({"tag": tag, "loaded": False, "type": type(exc).__name__, "message": str(exc)})
        del engine
    return found


def reference(runs: list, names: list, steps: int, every: int, out: str) -> None:
    """The runs that never stopped: from scratch, no checkpoint; their state at every save step."""
    engines = [build(stage, mode) for stage, mode in runs]
    for step in range(1, steps + 1):
        for engine, _ in engines:
            train_step(engine, step, engine.global_rank)
        if step % every == 0 or step == steps:
            for name, (engine, fc) in zip(names, engines):
                save_rank0(snapshot(engine, fc), os.path.join(out, f"reference_{name}_{step}.pt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--runs", required=True, help="comma-separated stage/mode, e.g. zero3/error_feedback")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    out = os.environ["OUT_DIR"]
    runs = [tuple(r.split("/")) for r in args.runs.split(",")]
    names = [f"{stage}-{mode}" for stage, mode in runs]
    killer = Killer(os.environ.get(KILL_ENV))
    install_kill_points(killer)
    report: dict = {"kill_at": os.environ.get(KILL_ENV), "runs": {}}
    engines = []
    for (stage, mode), name in zip(runs, names):
        run_dir = os.path.join(args.root, name)
        latest = os.path.join(run_dir, "latest")
        latest_tag = open(latest).read().strip() if os.path.isfile(latest) else None
        entry = report["runs"][name] = {"latest": latest_tag,
                                        "probes": probe_partial(run_dir, stage, mode, tag_step(latest_tag or "-"),
                                                                out, name)}
        if dist.get_rank() == 0:
            write_json(os.path.join(out, "report.json"), report)
        engine, fc = build(stage, mode)
        if latest_tag is not None:
            try:
                engine.load_checkpoint(run_dir)
            except (IncompleteCheckpointError, FairCastStateError) as exc:  # a refusal; the test reads it
                entry["refused"] = {"type": type(exc).__name__, "message": str(exc)}
                if dist.get_rank() == 0:
                    write_json(os.path.join(out, "report.json"), report)
                raise
            entry["resumed_at"] = engine.global_steps
            save_rank0(snapshot(engine, fc), os.path.join(out, f"loaded_{name}.pt"))
        else:
            entry["resumed_at"] = 0
        engines.append((engine, fc))
        if dist.get_rank() == 0:
            write_json(os.path.join(out, "report.json"), report)
    resumed = [engine.global_steps for engine, _ in engines]  # runs may resume at different steps
    for step in range(min(resumed) + 1, args.steps + 1):
        for (engine, _), at in zip(engines, resumed):
            if at < step:
                train_step(engine, step, engine.global_rank)
        if step % args.every == 0 or step == args.steps:
            for name, (engine, _), at in zip(names, engines, resumed):
                if at < step:  # a run's own checkpoints are never rewritten
                    engine.save_checkpoint(os.path.join(args.root, name))
    for name, (engine, fc) in zip(names, engines):
        save_rank0(snapshot(engine, fc), os.path.join(out, f"final_{name}.pt"))
    report["completed"] = True
    if dist.get_rank() == 0:
        write_json(os.path.join(out, "report.json"), report)
    if args.reference:
        reference(runs, names, args.steps, args.every, out)
    finish()
    os._exit(0)


if __name__ == "__main__":
    from common import freeze_the_imports

    freeze_the_imports()  # gc.collect() (DeepSpeed's and ours) then skips the imported modules
    main()
