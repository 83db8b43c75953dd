"""``faircast-ds check [CONFIG.json]``: the pre-flight a user runs before a long job.

It reports the interpreter-start hook, the installed DeepSpeed release and whether it is supported,
whether the fused kernel builds, where the ``fair_cast`` section would come from (the config file,
``FAIRCAST_DS_CONFIG``, neither), and every error the section or the DeepSpeed setup around it would raise
at initialize (read through DeepSpeed's own config parser), without launching anything.
"""
from __future__ import annotations

import os
import sys


class _Checklist:
    """The pre-flight's lines: ``ok``, ``note`` (worth knowing, not a failure) and ``ERROR`` (initialize would
    raise, or Fair Cast would not start)."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def line(self, kind: str, text: str) -> None:
        first, *rest = text.splitlines() or [""]
        print(f"  {kind:<6} {first}")
        for more in rest:
            print(f"         {more}")
        if kind == "ERROR":
            self.errors.append(first)

    def ok(self, text: str) -> None:
        self.line("ok", text)

    def note(self, text: str) -> None:
        self.line("note", text)

    def error(self, text: str) -> None:
        self.line("ERROR", text)


def _check_hook(out: _Checklist) -> None:
    from faircast_ds.deepspeed import autoload as _autoload

    if any(isinstance(f, _autoload._EngineWatcher) for f in sys.meta_path):
        out.ok("faircast-ds autoload hook: active (engines with a section attach as they are built)")
    elif os.environ.get("FAIRCAST_DS_AUTOLOAD", "1") == "0":
        out.note("faircast-ds autoload hook: NOT active (FAIRCAST_DS_AUTOLOAD=0): call faircast_ds.install() "
                 "before the engine is built, or faircast_ds.attach(engine)")
    else:
        out.error("faircast-ds autoload hook: NOT active: faircast-ds.pth is not installed in this environment "
                  "(reinstall with `pip install -e .` or `pip install faircast-ds`)")


def _check_deepspeed(out: _Checklist) -> bool:
    try:
        import deepspeed
    except Exception as exc:  # not installed, or broken for this torch
        out.error(f"DeepSpeed does not import: {type(exc).__name__}: {exc}")
        return False
    version = deepspeed.__version__
    from faircast_ds.deepspeed import (
        compat,  # the release rules: a supported range and the releases CI runs
    )

    problem, tested = compat.release_problem(version), tuple(compat.TESTED)
    where = f"supported range deepspeed{compat.SUPPORTED_RANGE}"
    if problem is not None:
        out.error(f"{problem} (initialize would raise UnsupportedSetupError)")
    elif version.split("+")[0] in tested:
        out.ok(f"DeepSpeed {version}: supported ({where}; this release is tested: {', '.join(tested)})")
    else:
        out.ok(f"DeepSpeed {version}: supported ({where}; tested releases: {', '.join(tested)}, not this one)")
    return True


def _check_kernels(out: _Checklist) -> None:
    from faircast_ds.casting import kernels

    devices = ["cpu"]
    try:
        import torch

        if torch.cuda.is_available():
            devices.append("cuda")
    except Exception:  # torch missing is reported by the DeepSpeed line already
        return
    for device in devices:
        native = "cpp" if device == "cpu" else "triton"
        try:
            backend = kernels.prepare(device)
        except (ValueError, RuntimeError) as exc:  # FAIRCAST_DS_KERNELS asks for one that cannot run here
            out.error(f"fused cast kernel on {device}: {exc}")
            continue
        if backend == native:
            out.ok(f"fused cast kernel on {device}: {backend} builds and runs")
        elif backend == "eager" and kernels.requested_backend() == "eager":
            out.note(f"fused cast kernel on {device}: off ({kernels.ENV_VAR}=eager): the eager torch path, same bits")
        else:
            why = kernels._usable(native)[1]
            out.note(f"fused cast kernel on {device}: {native} unavailable ({why}); the eager torch path is used "
                     "(same bits, slower)")


def _load_config_file(path: str, out: _Checklist) -> dict | None:
    import json

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        out.error(f"{path}: cannot read: {exc.strerror or exc}")
        return None
    except json.JSONDecodeError as exc:
        out.error(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}")
        return None
    if not isinstance(data, dict):
        out.error(f"{path}: expected a JSON object (a DeepSpeed config), got {type(data).__name__}")
        return None
    return data


def _section(path: str | None, data: dict | None, out: _Checklist):
    from faircast_ds.config import origin as config_origin
    from faircast_ds.config.section import FairCastConfigError

    env = os.environ.get(config_origin.ENV)
    where = f"{config_origin.ENV}={env!r}" if env is not None else f"{config_origin.ENV} unset"
    try:
        resolved = config_origin.resolve(data)
    except FairCastConfigError as exc:
        out.error(f"fair_cast section ({path or 'no config file'}; {where}): initialize would raise "
                  f"FairCastConfigError:\n{exc}")
        return None
    if resolved is None:
        text = (f"fair_cast section: neither {path} nor {config_origin.ENV} has one: Fair Cast stays off "
                f"(round-to-nearest) for engines built from this config" if path else
                f"fair_cast section: {config_origin.ENV} is unset (name a DeepSpeed config to check its section)")
        (out.error if path else out.note)(text)
        return None
    cfg = resolved.config
    detail = (f"mode={cfg.mode} seed={cfg.seed} on_nonfinite={cfg.on_nonfinite} "
              f"diagnostics.every={cfg.diagnostics.every}" + (f" align_rounding={cfg.align_rounding.engine}"
                                                             if cfg.align_rounding else ""))
    if not cfg.enabled:
        out.note(f"fair_cast section: {config_origin.describe(resolved)}: enabled=false, DeepSpeed keeps "
                 "round-to-nearest (rank 0 will say so)")
    else:
        out.ok(f"fair_cast section: {config_origin.describe(resolved)} (banner: origin={resolved.origin}): {detail}")
    return resolved


_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _without_auto(data: dict) -> tuple[dict, list[str]]:
    """The config with HF Trainer's ``"auto"`` placeholders removed (DeepSpeed's defaults stand in)
    and the batch sizes set for one rank (they depend on the world size, checked at initialize)."""
    dropped: list[str] = []

    def clean(obj: dict, prefix: str) -> dict:
        kept = {}
        for key, value in obj.items():
            if value == "auto":
                dropped.append(prefix + key)
            elif isinstance(value, dict):
                kept[key] = clean(value, f"{prefix}{key}.")
            else:
                kept[key] = value
        return kept

    cleaned = clean(data, "")
    for key in _BATCH:
        cleaned.pop(key, None)
    cleaned["train_micro_batch_size_per_gpu"] = 1
    cleaned["gradient_accumulation_steps"] = 1
    return cleaned, dropped


def _predicted_optimizer(parsed) -> str:
    """The optimizer class DeepSpeed wraps a training optimizer in for this config (its
    ``_do_optimizer_sanity_check`` and ``_configure_*_optimizer``), bf16 assumed, for a client torch
    optimizer where the config names none (tests/deepspeed_tests/test_cli_check.py compares it with built engines)."""
    import torch

    from faircast_ds.deepspeed import compat

    stage = int(parsed.zero_optimization_stage)
    accum = getattr(getattr(parsed, "grad_accum_dtype", None), "value", getattr(parsed, "grad_accum_dtype", None))
    fp32_accum = accum in (torch.float32, "fp32", "float32", "torch.float32")
    offload = compat.offload_device(getattr(parsed.zero_config, "offload_optimizer", None))
    if stage == 3 and (getattr(parsed, "mics_shard_size", -1) or -1) > 0:
        return "MiCS_Optimizer"  # releases before 0.19.8 (from 0.19.8 DeepSpeed's own parser refuses the key)
    if stage == 0:  # bf16 without ZeRO: FP16_Optimizer around a fused optimizer, else FP16_UnfusedOptimizer
        return "BF16_Optimizer" if fp32_accum else "FP16_Optimizer" if parsed.optimizer_name else "FP16_UnfusedOptimizer"
    if stage == 1 and fp32_accum and offload in ("none", "None"):
        return "BF16_Optimizer"
    return "DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer"


def _check_setup(path: str, data: dict, out: _Checklist) -> None:
    from faircast_ds.deepspeed.adapters import registry
    from faircast_ds.deepspeed.support import check_supported
    from faircast_ds.shard.adapter import UnsupportedSetupError

    cleaned, dropped = _without_auto(data)
    if dropped:
        out.note(f"{path}: \"auto\" values ({', '.join(dropped)}) are filled by HF Trainer/Accelerate at launch; "
                 "checked here with DeepSpeed's defaults")
    try:
        from deepspeed.runtime.config import DeepSpeedConfig

        parsed = DeepSpeedConfig(cleaned)
    except Exception as exc:  # DeepSpeed's own validation: initialize would raise it too
        out.error(f"{path}: DeepSpeed refuses this config: {type(exc).__name__}: {exc}")
        return
    try:
        check_supported(parsed)
    except UnsupportedSetupError as exc:
        out.error(f"initialize would raise UnsupportedSetupError:\n{exc}")
        return
    name = _predicted_optimizer(parsed)
    supported = {cls.__name__ for cls in registry._adapters()}
    stage = parsed.zero_optimization_stage
    if name in supported:
        out.ok(f"DeepSpeed setup: ZeRO stage {stage}, bf16: a training engine's optimizer is {name}, cast by Fair Cast")
    else:
        hint = registry._HINTS.get(name, "")
        out.error(f"DeepSpeed setup: ZeRO stage {stage}: a training engine's optimizer would be {name}, which Fair "
                  f"Cast does not route (initialize would raise UnsupportedSetupError){': ' + hint if hint else ''}")
    if parsed.optimizer_name:
        out.ok(f"the config names an optimizer ({parsed.optimizer_name}): engines built from it train")
    else:
        out.note("the config names no optimizer: an engine built from it with a client optimizer trains and is cast; "
                 "one without (a reference or evaluation copy) is left as DeepSpeed builds it, and rank 0 says so")


def run(path: str | None) -> int:
    """``faircast-ds check [CONFIG.json]``: everything that would stop Fair Cast at initialize, found without
    launching anything. Exit status 0 when nothing would, 1 otherwise."""
    print("faircast-ds check" + (f" {path}" if path else "") + ": pre-flight")
    out = _Checklist()
    _check_hook(out)
    has_deepspeed = _check_deepspeed(out)
    _check_kernels(out)
    data = _load_config_file(path, out) if path else None
    if path and data is None:
        resolved = None
    else:
        resolved = _section(path, data, out)
    if path and data is not None and has_deepspeed and (resolved is None or resolved.config.enabled):
        _check_setup(path, data, out)
    if out.errors:
        print(f"NOT READY: {len(out.errors)} problem{'s' if len(out.errors) > 1 else ''} above (exit 1)")
        return 1
    print("ready: nothing found that would stop Fair Cast at initialize (exit 0)")
    return 0
