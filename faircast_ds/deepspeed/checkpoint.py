"""Fair Cast's state in a DeepSpeed engine's checkpoints: ``save_checkpoint`` writes it and
``load_checkpoint`` restores it, so that after any load the model serves the bits it served at save
time. The state file format is ``faircast_ds.shard.state``.

Saving: our state first, then DeepSpeed's files, then ``latest``, which we write ourselves, once every
rank's files are written, atomically (DeepSpeed 0.19.8 truncates and rewrites it in place, on rank 0,
without waiting for the other ranks: a kill at the wrong moment left an empty ``latest``, or one naming
a tag whose other ranks' files were still being written). A save after a cast that stopped on a
non-finite weight first completes that step's cast on every rank.

Loading: ``latest`` is read once (the same tag for DeepSpeed and for us); the tag folder is checked for
completeness on every rank before DeepSpeed reads anything (``IncompleteCheckpointError`` names each
missing or truncated file); then, by what the load restored:

- optimizer loads and universal loads restore the fp32 masters: our state is restored on top
  (``restore_state``), checked against DeepSpeed's step (a tag holding two saves is refused);
- module-only loads (``load_module_only`` or ``load_optimizer_states=False``) rebuild the masters from
  the model's bf16 weights: those weights must be the served ones. ZeRO-1/2's model file holds them;
  ZeRO-3's holds none, and DeepSpeed builds the module from the fp32 masters, rounding to nearest —
  here the module gets what the checkpoint served instead (``SavedCast``). The residual starts at zero
  (the masters now equal the served copy) and the noise step is the saved one;
- a checkpoint without our state: for every mode whose whole state is (mode, seed, step) that state is
  recovered from this run's config and the engine's step, with a log line; for ``error_feedback`` (the
  residual is lost) it is an error naming the conversion that keeps it, unless
  ``on_missing_state: reset``.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import inspect
import os
import re
import zipfile
from typing import Any

from faircast_ds._util import dist
from faircast_ds.shard.caster import NonFiniteWeightError
from faircast_ds.shard.handle import FairCast
from faircast_ds.shard.state import (
    FairCastStateError,
    MissingStateError,
    SavedCast,
    cast_mismatch,
    complete_step,
    publish_restored,
    read_records,
    reset_state,
    restore_state,
    save_state,
)

LATEST, LATEST_UNIVERSAL = "latest", "latest_universal"
CONVERT_HINT = ("if it was converted with DeepSpeed's ds_to_universal, convert the original tag folder with "
                "`faircast-ds to-universal <tag folder> <output folder>` instead, which carries fair_cast/ along")


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint tag folder lacks files a load needs, or holds a truncated one (a save that was killed
    before it finished); the message names each."""


def read_latest(path: str) -> str:
    """The tag a ``latest`` file names; an empty one (a save killed while writing it) is an error."""
    with open(path) as f:
        tag = f.read().strip()
    if not tag:
        raise IncompleteCheckpointError(f"{path} is empty (a save was killed while writing it); pass the tag to "
                                        "load_checkpoint explicitly")
    return tag


def write_latest(save_dir: str, tag: str, name: str = LATEST) -> None:
    """Point ``save_dir/name`` at ``tag``: the old file or the new one, never a torn one, also after a
    power loss."""
    path = os.path.join(save_dir, name)
    with open(path + ".tmp", "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fd = os.open(save_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unreadable(path: str) -> str | None:
    """Why a checkpoint file cannot be read, if it cannot (empty, or a torch zip cut short)."""
    try:
        if os.path.getsize(path) == 0:
            return "empty"
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"
        if zipped:
            with zipfile.ZipFile(path):
                pass
    except (OSError, zipfile.BadZipFile) as exc:
        return f"truncated or unreadable ({exc})"
    return None


def incomplete(tag_dir: str, *, world: int | None, zero_stage: int | None) -> list[str]:
    """What a regular (not universal) DeepSpeed checkpoint tag folder lacks: its model-states file(s), one
    ZeRO optimizer-states file per saved data-parallel rank (``world``, from our state when it is there,
    else the ranks found), and every file that is empty or cut short. Empty when complete."""
    if not os.path.isdir(tag_dir):
        return [f"{tag_dir} does not exist"]
    problems = []
    names = os.listdir(tag_dir)
    optim = {int(m.group(1)) for n in names if (m := re.search(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$", n))}
    if world is None:
        world = max(optim) + 1 if optim else None
    if not any(n.endswith("_model_states.pt") for n in names):
        problems.append("no *_model_states.pt (DeepSpeed's model file)")
    if world is not None and (optim or (zero_stage or 0) > 0):
        problems += [f"no *zero_pp_rank_{r}_mp_rank_*_optim_states.pt (rank {r}'s ZeRO file)"
                     for r in range(world) if r not in optim]
        if zero_stage == 3:
            model = {int(m.group(1)) for n in names
                     if (m := re.fullmatch(r"zero_pp_rank_(\d+)_mp_rank_\d+_model_states\.pt", n))}
            problems += [f"no zero_pp_rank_{r}_mp_rank_*_model_states.pt (rank {r}'s model file)"
                         for r in range(world) if r not in model]
    for path in sorted(glob.glob(os.path.join(tag_dir, "*.pt"))):
        why = _unreadable(path)
        if why:
            problems.append(f"{os.path.basename(path)} is {why}")
    return problems


_LOADING: dict[str, str] = {}  # load folder -> the tag a load in progress is reading


def _route_fp32_reads_to_the_loaded_tag() -> None:
    """DeepSpeed 0.19.8's ZeRO-3 module load (``load_optimizer_states=False``) reads the fp32 masters with
    ``get_fp32_state_dict_from_zero_checkpoint(load_dir)``, i.e. from the tag ``latest`` names, whatever tag
    was asked for: model weights of one step with the counters of another. During our loads it reads
    the tag being loaded. Installed once; outside our loads it changes nothing."""
    from deepspeed.runtime import engine as engine_module

    original = engine_module.get_fp32_state_dict_from_zero_checkpoint
    if getattr(original, "_faircast_wrapped", False):
        return

    @functools.wraps(original)
    def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: Any = None, *args: Any, **kwargs: Any):
        if tag is None:
            tag = _LOADING.get(os.path.abspath(checkpoint_dir))
        return original(checkpoint_dir, tag, *args, **kwargs)

    get_fp32_state_dict_from_zero_checkpoint._faircast_wrapped = True  # type: ignore[attr-defined]
    engine_module.get_fp32_state_dict_from_zero_checkpoint = get_fp32_state_dict_from_zero_checkpoint


def register(engine: Any, fair_cast: FairCast, hooks: Any) -> None:
    """Save Fair Cast's state with every engine checkpoint, restore it with every load: around hooks on
    ``save_checkpoint``, ``load_checkpoint`` and ``load_module_state_dict`` in the engine's
    :class:`faircast_ds.deepspeed.engine_hooks.EngineHooks`."""
    save_sig, load_sig, module_sig = (inspect.signature(hooks.original(m)) for m in
                                      ("save_checkpoint", "load_checkpoint", "load_module_state_dict"))
    served_cast: dict[str, SavedCast] = {}  # during a ZeRO-3 module-only load: what the checkpoint served
    _route_fp32_reads_to_the_loaded_tag()

    def save_checkpoint(save: Any, save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        given = save_sig.bind(save_dir, tag, *args, **kwargs)
        given.apply_defaults()
        tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"  # DeepSpeed's default
        given.arguments["tag"] = tag
        _complete_failed_step(fair_cast)
        rank, world = dist.rank_world()
        # ours first, then DeepSpeed's files (its save ends with a barrier), then `latest`, by us
        save_state(fair_cast.adapter, fair_cast.caster, os.path.join(save_dir, tag), rank=rank, world=world,
                   engine_step=engine.global_steps)
        commit = bool(given.arguments.get("save_latest", True)) and not _decoupled(engine)
        if commit:
            given.arguments["save_latest"] = False
        result = save(*given.args, **given.kwargs)
        if commit:
            if rank == 0:
                write_latest(save_dir, tag)
            _barrier()
        return result

    def load_module_state_dict(load_module: Any, checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
        given = module_sig.bind(checkpoint, *args, **kwargs)
        given.apply_defaults()
        saved = served_cast.get("cast")
        if saved is not None and given.arguments.get("fetch_z3_params"):
            _served_module(engine, checkpoint, saved)
        return load_module(*given.args, **given.kwargs)

    def load_checkpoint(load: Any, load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        given = load_sig.bind(load_dir, tag, *args, **kwargs)
        given.apply_defaults()
        cfg = fair_cast.config
        universal = bool(engine.load_universal_checkpoint())
        latest = os.path.join(load_dir, LATEST_UNIVERSAL if universal else LATEST)
        if tag is None and os.path.isfile(latest):
            tag = read_latest(latest)  # once: DeepSpeed and we load the same tag
        if tag is None:
            return load(*given.args, **given.kwargs)  # DeepSpeed says there is nothing to load
        tag = given.arguments["tag"] = str(tag)
        tag_dir = os.path.join(load_dir, tag)
        module_only = bool(given.arguments["load_module_only"])
        zero3 = fair_cast.adapter.zero_stage == 3
        # what DeepSpeed restores the fp32 masters from: the checkpoint's fp32 values, or the model's bf16
        # weights (module-only loads), which must then be the served copy
        masters_exact = restores_exact_masters(load_optimizer_states=bool(given.arguments["load_optimizer_states"]),
                                               module_only=module_only, zero3=zero3, universal=universal,
                                               from_fp32=bool(engine.zero_load_from_fp32_weights()))
        served_from_state = zero3 and not masters_exact and not universal  # ZeRO-3's model file has no weights
        records, error, missing = _read_state(tag_dir, universal)
        if records is not None and masters_exact:
            mismatch = cast_mismatch(records[0][1], cfg, f"checkpoint {tag_dir}")
            if error is None and mismatch is not None:
                error, records = mismatch, None
        needs_state = masters_exact or served_from_state
        if error is not None and needs_state and cfg.on_missing_state == "error":  # refused before loading anything
            if not missing:
                raise FairCastStateError(f"{error}. Set fair_cast.on_missing_state to 'reset' to start the residual "
                                         "at zero instead.")
            if cfg.spec.residual:
                raise FairCastStateError(f"{error}. mode=error_feedback keeps its residual and served bits there, "
                                         f"which this checkpoint lacks; {CONVERT_HINT}; or set "
                                         "fair_cast.on_missing_state to 'reset' to start the residual at zero.")
        if zero3 and not universal and module_only and given.arguments["load_optimizer_states"]:
            # DeepSpeed 0.19.8 loads no weights on this path (ZeRO-3's model file holds none); its
            # load_optimizer_states=False path builds them from the fp32 masters, which we then serve
            given.arguments["load_optimizer_states"] = False
            dist.log_rank0(f"[fair_cast] {tag_dir}: ZeRO-3 load_module_only: the weights come from the fp32 masters "
                           "(DeepSpeed's load_optimizer_states=False path; its own loads none here)")
        if served_from_state:
            served_cast["cast"] = (SavedCast(records, cfg) if records is not None
                                   else _config_cast(cfg, tag_dir, missing, error))
        _LOADING[os.path.abspath(load_dir)] = tag
        # a load reproduces the saved served copy as it was, non-finite weights (a save after a failed
        # step) included: the next step's cast raises on them again
        guard = fair_cast.extras.get("guard")
        fair_cast.served_rewritten()  # whatever the load writes, the next delta push is dense
        with fair_cast.caster.unchecked() as caster:
            try:
                # the restore below casts (or restores) every flat group: DeepSpeed's load sites leave their
                # round-to-nearest refresh for it to replace (ZeRO-3), or cast at the old step unrecorded
                with guard.superseded() if guard is not None else contextlib.nullcontext(), \
                        fair_cast.adapter.deferring_load_casts():
                    result = load(*given.args, **given.kwargs)
            finally:
                _LOADING.pop(os.path.abspath(load_dir), None)
                served_cast.pop("cast", None)
            if result is None or result[0] is None:
                return result  # nothing was loaded
            _after_load(engine, fair_cast, tag_dir, records, error, missing, masters_exact, module_only, result)
        if caster.suppressed is not None:
            dist.log_rank0(f"[fair_cast] WARNING {tag_dir}: the restored served copy holds non-finite weights "
                           f"({caster.suppressed}); the next step's cast raises again unless the masters are repaired")
        return result

    hooks.around("save_checkpoint", "checkpoint state", "ours first, then DeepSpeed's files, then `latest`",
                 save_checkpoint)
    hooks.around("load_checkpoint", "checkpoint state", "one `latest` read, the tag checked, our state restored",
                 load_checkpoint)
    hooks.around("load_module_state_dict", "checkpoint state",
                 "a ZeRO-3 module-only load gets the served copy, not round-to-nearest", load_module_state_dict)


def restores_exact_masters(*, load_optimizer_states: bool, module_only: bool, zero3: bool, universal: bool,
                           from_fp32: bool) -> bool:
    """Whether DeepSpeed's load restores the fp32 masters bit for bit (then Fair Cast's state goes on top of
    them) rather than rebuilding them from the model's bf16 weights. An optimizer load does, except under
    ZeRO-1/2 told ``load_from_fp32_weights: false`` (``from_fp32``), which rebuilds them from the bf16
    weights (ZeRO-3's own load always reads the fp32 partitions); a universal load does with its optimizer
    states, or where it reads the fp32 weights (ZeRO-1/2 always; ZeRO-3 when told to). Error feedback's
    state files check the masters they rebuild the served bits from, so a load this says is exact and is
    not is refused by name (``shard/state.py``)."""
    optimizer_load = load_optimizer_states and not module_only
    if universal:
        return optimizer_load or not zero3 or from_fp32
    return optimizer_load and (zero3 or from_fp32)


def _after_load(engine: Any, fair_cast: FairCast, tag_dir: str, records: list | None, error: str | None,
                missing: bool, masters_exact: bool, module_only: bool, result: tuple) -> None:
    """Our state on top of what DeepSpeed loaded."""
    if masters_exact:
        _restore(engine, fair_cast, tag_dir, error, missing, engine_step=None if module_only else engine.global_steps)
        return
    step = int(records[0][1]["step"]) if records is not None else _engine_step(engine, result, module_only)
    reset_state(fair_cast.adapter, fair_cast.caster, step)
    source = "the checkpoint's Fair Cast state" if records is not None else "the engine (no Fair Cast state)"
    dist.log_rank0(f"[fair_cast] {tag_dir}: module-only load: the model weights are the served copy as saved, "
                   f"the masters are rebuilt from them, residual starts at zero, noise step {step} (from {source})")


def _barrier() -> None:
    if dist.initialized():
        import torch.distributed

        torch.distributed.barrier()


def _decoupled(engine: Any) -> bool:
    """A decoupled checkpoint engine commits (and writes ``latest``) later, by itself."""
    ckpt_engine = getattr(engine, "checkpoint_engine", None)
    return bool(getattr(ckpt_engine, "is_decoupled", lambda: False)())


def _complete_failed_step(fair_cast: FairCast) -> None:
    """Before a save: if any rank's last cast stopped on a non-finite weight, every rank casts the flat
    shards that step did not reach and publishes, so the checkpoint (DeepSpeed's model file included)
    holds one step's served copy. A collective."""
    caster = fair_cast.caster

    def failed() -> None:
        if caster.failed is not None:
            raise caster.failed

    message = dist.first_failure(failed, NonFiniteWeightError)
    if message is None:
        return
    complete_step(fair_cast.adapter, caster)
    fair_cast.adapter.publish()
    dist.log_rank0(f"[fair_cast] saving after a cast that stopped on a non-finite weight ({message}); the rest of "
                   f"step {caster.step}'s cast is done first, so the checkpoint holds that one step")


def _read_state(tag_dir: str, universal: bool) -> tuple[list | None, str | None, bool]:
    """Check the tag folder (DeepSpeed's files: regular layout only) and read our state's rank files, agreed
    on every rank before anything is loaded. Returns (records or None, the first failing rank's error or
    None, whether the state is missing on some rank); raises IncompleteCheckpointError."""
    found: dict[str, Any] = {}

    def local() -> None:
        try:
            found["records"] = read_records(tag_dir)
        except FairCastStateError as exc:
            found["error"] = exc
        first = found["records"][0][1] if "records" in found else {}
        if not universal:
            problems = incomplete(tag_dir, world=first.get("world_size"), zero_stage=first.get("zero_stage"))
            if problems:
                raise IncompleteCheckpointError(f"checkpoint {tag_dir} is incomplete: " + "; ".join(problems))

    problem = dist.first_failure(local, IncompleteCheckpointError)
    if problem is not None:
        raise IncompleteCheckpointError(problem)
    error = found.get("error")
    message = dist.first_failure(lambda: _reraise(error), FairCastStateError)
    missing = dist.first_failure(lambda: _reraise(error if isinstance(error, MissingStateError) else None),
                                 MissingStateError) is not None
    return (found["records"] if message is None else None), message, missing


def _reraise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def _engine_step(engine: Any, result: tuple, module_only: bool) -> int:
    """The optimizer steps the checkpoint's engine took (skipped steps cast nothing)."""
    if module_only:  # DeepSpeed does not restore its counters then; they are in the client state
        client = result[1] or {}
        return int(client.get("global_steps", 0)) - int(client.get("skipped_steps", 0))
    return int(engine.global_steps) - int(engine.skipped_steps)


def _config_cast(cfg: Any, tag_dir: str, missing: bool, error: str | None) -> SavedCast:
    """For a ZeRO-3 module-only load of a checkpoint without (usable) Fair Cast state: this run's cast at
    the checkpoint's step (its step is filled in from DeepSpeed's file during the load)."""
    what = "no Fair Cast state" if missing else f"unusable Fair Cast state ({error})"
    if cfg.spec.residual:
        dist.log_rank0(f"[fair_cast] WARNING {tag_dir}: {what}; on_missing_state=reset: the model gets "
                       "round-to-nearest of the masters (a zero residual)")
    else:
        dist.log_rank0(f"[fair_cast] {tag_dir}: {what}; mode={cfg.mode} keeps nothing beyond (mode, seed, step): "
                       "the model gets this run's cast of the masters at the checkpoint's step")
    return SavedCast(None, cfg, step=-1)


def _restore(engine: Any, fair_cast: FairCast, tag_dir: str, state_error: str | None, missing: bool,
             engine_step: int | None) -> None:
    """After a load that restored the fp32 masters: put our state back on top."""
    adapter, caster = fair_cast.adapter, fair_cast.caster
    if state_error is None:
        error = dist.first_failure(lambda: restore_state(adapter, caster, tag_dir, engine_step=engine_step),
                                   FairCastStateError)
        if error is None:
            publish_restored(adapter, caster)
            dist.log_rank0(f"[fair_cast] restored state from {tag_dir}: mode={fair_cast.config.mode} step={caster.step}")
            return
        if fair_cast.config.on_missing_state == "error":
            raise FairCastStateError(f"{error}. Set fair_cast.on_missing_state to 'reset' to start the residual "
                                     "at zero instead.")
        state_error = error
    step = int(engine.global_steps) - int(engine.skipped_steps)
    reset_state(adapter, caster, step)
    cfg = fair_cast.config
    if missing and not cfg.spec.residual:
        dist.log_rank0(f"[fair_cast] {tag_dir}: {state_error}; mode={cfg.mode} keeps nothing beyond (mode, seed, "
                       f"step): mode and seed={cfg.seed} taken from this run's config, noise step {step} from the "
                       f"engine (global_steps {engine.global_steps} - skipped_steps {engine.skipped_steps})")
    else:
        dist.log_rank0(f"[fair_cast] WARNING {state_error}; on_missing_state=reset: residual starts at zero, noise "
                       f"step {step}")


def _served_module(engine: Any, checkpoint: dict, saved: SavedCast) -> None:
    """Inside DeepSpeed's ZeRO-3 module load from the fp32 masters: replace each parameter's fp32 values
    with what the checkpoint served, so the model (and the masters DeepSpeed then rebuilds from it) hold
    the served copy, not round-to-nearest of the masters."""
    if saved.records is None:  # this run's cast, at the step of the checkpoint's engine
        saved.step = int(checkpoint.get("global_steps", 0)) - int(checkpoint.get("skipped_steps", 0))
    names = set(engine.param_names.values())
    replaced: dict[int, Any] = {}
    out = {}
    for key, value in checkpoint["module"].items():
        if id(value) in replaced:  # a tied parameter listed twice
            out[key] = replaced[id(value)]
        elif key in names:
            out[key] = replaced[id(value)] = saved.served(key, value)
        else:
            out[key] = value
    checkpoint["module"] = out
    dist.log_rank0(f"[fair_cast] ZeRO-3 module load: the model gets the bits the checkpoint served "
                   f"(mode={saved.mode}, step {saved.step}), not round-to-nearest of the fp32 masters")
