"""``faircast-ds predict``: how much round-to-nearest (RN) will hide of an AdamW run, from a checkpoint.

For every weight the prediction needs two numbers: its bf16 spacing ``s`` (from its value) and the size
``d`` of its typical AdamW step at the given learning rate. ``d`` comes from AdamW's moments when the
checkpoint holds them (a DeepSpeed ZeRO checkpoint: ``exp_avg``, ``exp_avg_sq`` and ``step`` give the
step AdamW would take next, element by element) and otherwise from the learning rate alone: Adam's
update ``m/sqrt(v)`` has magnitude about 1 while a gradient keeps its sign, so ``d = lr`` (plus the
decoupled weight decay's ``lr * wd * |w|``). The model (docs/predict.md derives it), per weight moving
at ``d`` per step from an on-grid start (a bf16 checkpoint; an fp32 master read from a checkpoint is
treated as if rounded to bf16 first):

- RN first changes it at step ``k = ceil(s / (2 d))``: until then the served copy sits still while the
  master drifts, so its lag along the drift is ``t`` steps at step ``t < k``; after that it is a
  sawtooth of mean 0;
- once moving it changes about ``min(1, d / s)`` of the steps;
- the lag along drift that the job's diagnostics measure (``lag_drift_steps``) weights each element by
  its drift squared, so the predicted lag at step ``t`` is ``L(t) = t * W(k > t)``, ``W`` the share of
  ``d**2`` held by weights not yet changed; the *predicted delay* is its peak over ``t``.

Files are read one tensor at a time (safetensors: each tensor's bytes; DeepSpeed: ``torch.load`` with
``mmap``, so a rank's flat state is mapped, not read, and each parameter's slices are touched in turn).
Nothing here imports DeepSpeed: its checkpoint files are unpickled with a restricted unpickler that
builds tensors and containers and stands in for DeepSpeed's own classes (an enum, a loss scaler).
"""
from __future__ import annotations

import glob
import json
import math
import os
import pickle
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from faircast_ds.casting.bits import bf16_spacing

# Steps at which the first-change histogram is cut: weights not changed by then count as "not yet".
HORIZON_CAP = 1 << 17
# Elements of one tensor taken at a time: the per-element model works in float64 with a handful of
# temporaries, so a whole 155M-element embedding (Qwen3's vocabulary x 1024) would need ~8 GB; the
# figures are sums and a histogram, so slices add up to the same answer.
CHUNK_ELEMENTS = 1 << 22
# Verdict thresholds on the predicted peak lag (steps): below the first RN tracks within a step or
# two; from the second the served copy is tens of steps behind (docs/predict.md).
MATTERS_BELOW = 2.0
MATTERS_FROM = 20.0


class PredictError(ValueError):
    """Bad input to ``faircast-ds predict``: the message names the path or the option."""


@dataclass(frozen=True)
class AdamSettings:
    """The AdamW a prediction assumes. ``betas``/``eps``/``weight_decay`` None: the checkpoint's own
    (when it has them), else AdamW's defaults."""

    lr: float
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise PredictError(f"--lr must be a finite number > 0, got {self.lr!r}")
        if self.betas is not None:
            if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and math.isfinite(b) and 0 <= b < 1
                                               for b in self.betas):
                raise PredictError(f"--betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.eps is not None and not (math.isfinite(self.eps) and self.eps > 0):
            raise PredictError(f"--eps must be a finite number > 0, got {self.eps!r}")
        if self.weight_decay is not None and not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise PredictError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay!r}")


def parse_betas(text: str) -> tuple[float, float]:
    """``"0.9,0.999"`` -> (0.9, 0.999); anything else is a :class:`PredictError` naming it."""
    parts = [p.strip() for p in text.split(",")]
    try:
        betas = tuple(float(p) for p in parts)
    except ValueError:
        raise PredictError(f"--betas must be B1,B2 (two numbers), got {text!r}") from None
    if len(betas) != 2:
        raise PredictError(f"--betas must be B1,B2 (two numbers), got {text!r}")
    AdamSettings(lr=1.0, betas=betas)  # range check
    return betas  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------------
# The per-element model


def first_change_step(spacing: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``ceil(s / (2 d))`` as float64, the step at which RN first moves an on-grid weight that drifts ``d``
    per step; ``inf`` where ``d == 0``."""
    s, d = spacing.double(), step.double()
    k = torch.where(d > 0, torch.ceil(s / (2 * d).clamp_min(1e-300)), torch.full_like(s, math.inf))
    return k.clamp_min(1.0)


def changes_in(steps: int, spacing: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """How many of ``steps`` steps RN changes each on-grid weight drifting ``d`` per step: none before its
    first change at ``k``, then one each time the master crosses another midpoint (every ``s/d`` steps),
    at most one per step."""
    s, d = spacing.double(), step.double()
    travelled = steps * d
    crossings = torch.where(travelled >= s / 2, torch.floor((travelled - s / 2) / s) + 1, torch.zeros_like(s))
    return torch.minimum(crossings, torch.full_like(s, float(steps)))


def lag_curve(hist: torch.Tensor) -> torch.Tensor:
    """``L(t) = t * W(k > t)`` for t = 0 .. len(hist) - 1, from ``hist[k]`` = the drift-squared weight of
    elements first changed at step k (the last bin: at or after it)."""
    total = float(hist.sum())
    if total <= 0:
        return torch.zeros_like(hist)
    # W(k > t): weight in bins t+1 .. end
    suffix = torch.flip(torch.cumsum(torch.flip(hist, [0]), 0), [0])
    later = torch.cat([suffix[1:], torch.zeros(1, dtype=hist.dtype)])
    t = torch.arange(hist.numel(), dtype=hist.dtype)
    return t * later / total


@dataclass
class Tally:
    """Running sums for one tensor or for all of them."""

    numel: int = 0
    nonfinite: int = 0
    frozen: int = 0  # elements whose step is 0 (no gradient, or a zero moment)
    below_half: int = 0
    changed_sum: float = 0.0
    run_changes: float = 0.0
    d2_sum: float = 0.0
    hist: torch.Tensor = field(default_factory=lambda: torch.zeros(HORIZON_CAP + 1, dtype=torch.float64))

    def add(self, spacing: torch.Tensor, step: torch.Tensor, steps: int | None) -> None:
        self.numel += spacing.numel()
        self.frozen += int((step == 0).sum())
        self.below_half += int((step < spacing / 2).sum())
        self.changed_sum += float(torch.clamp(step.double() / spacing.double(), max=1.0).sum())
        if steps:
            self.run_changes += float(changes_in(steps, spacing, step).sum())
        k = first_change_step(spacing, step).clamp(max=HORIZON_CAP).long()
        d2 = step.double() ** 2
        self.d2_sum += float(d2.sum())
        self.hist += torch.bincount(k, weights=d2, minlength=HORIZON_CAP + 1)

    def merge(self, other: "Tally") -> None:
        self.numel += other.numel
        self.nonfinite += other.nonfinite
        self.frozen += other.frozen
        self.below_half += other.below_half
        self.changed_sum += other.changed_sum
        self.run_changes += other.run_changes
        self.d2_sum += other.d2_sum
        self.hist += other.hist

    def figures(self, steps: int | None) -> dict[str, Any]:
        n = max(self.numel, 1)
        curve = lag_curve(self.hist)
        peak_step = int(torch.argmax(curve)) if self.numel else 0
        out: dict[str, Any] = {
            "numel": self.numel, "nonfinite": self.nonfinite, "frozen_share": self.frozen / n,
            "share_below_half_spacing": self.below_half / n,
            "predicted_changed_fraction": self.changed_sum / n,
            "predicted_delay_steps": float(curve[peak_step]) if self.numel else 0.0,
            "predicted_delay_peak_step": peak_step,
            "median_first_change_step": _weighted_median(self.hist),
        }
        if peak_step >= HORIZON_CAP - 1:
            out["predicted_delay_note"] = f"still growing at the {HORIZON_CAP}-step cut"
        if steps:
            t = min(steps, HORIZON_CAP)
            out["steps"] = steps
            out["predicted_lag_at_end_steps"] = float(curve[t])
            out["predicted_mean_lag_steps"] = float(curve[1:t + 1].mean())
            out["predicted_changed_fraction_over_run"] = self.run_changes / (n * steps)
        return out


def _weighted_median(hist: torch.Tensor) -> float | None:
    """The drift-squared-weighted median first-change step (None when nothing moves)."""
    total = float(hist.sum())
    if total <= 0:
        return None
    idx = int(torch.searchsorted(torch.cumsum(hist, 0), torch.tensor([total / 2], dtype=hist.dtype)))
    return float(min(idx, HORIZON_CAP))


# ---------------------------------------------------------------------------------------------------
# Reading checkpoints one tensor at a time


@dataclass
class TensorState:
    """One parameter as a prediction needs it: values and, when known, AdamW's moments and step count."""

    name: str
    values: torch.Tensor
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    step: float | None = None


FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


def safetensors_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def read_safetensors(files: Sequence[str]) -> Iterator[TensorState]:
    """Every floating-point tensor of the files, one at a time (integer tensors are not weights)."""
    from faircast_ds.export.safetensors_stream import read_header, read_tensor

    for path in files:
        try:
            start, header = read_header(path)
        except (OSError, ValueError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PredictError(f"{path}: not a safetensors file ({exc})") from None
        for name, entry in header.items():
            if name == "__metadata__" or not isinstance(entry, dict) or entry.get("dtype") not in FLOAT_DTYPES:
                continue
            yield TensorState(name, read_tensor(path, start, entry))


class _Foreign:
    """Stands in for a class a checkpoint pickled from a library this reader does not import."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


_SAFE_BUILTINS = {"set", "frozenset", "slice", "complex", "bytearray", "range", "tuple", "list", "dict", "int",
                  "float", "bool", "str", "bytes", "object"}


class _RestrictedUnpickler(pickle.Unpickler):
    """Builds tensors, containers and plain values; DeepSpeed's classes become :class:`_Foreign`; any other
    global (os.system and the like) is refused, so reading a checkpoint runs none of its code."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        if module == "collections" and name in ("OrderedDict", "defaultdict"):
            return super().find_class(module, name)
        if module in ("torch._utils", "torch._tensor") and name.startswith("_rebuild"):
            return super().find_class(module, name)
        if module == "torch" and (name.endswith("Storage") or name in ("Tensor", "Size", "device", "dtype") or
                                  isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        if module == "torch.storage" and name in ("UntypedStorage", "TypedStorage"):
            return super().find_class(module, name)
        if module == "torch.nn.parameter" and name == "Parameter":
            return super().find_class(module, name)
        if module.split(".")[0] == "deepspeed" or module == "enum":
            return _Foreign
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


class _RestrictedPickle:
    """The ``pickle_module`` torch.load is handed."""

    Unpickler = _RestrictedUnpickler
    load = staticmethod(pickle.load)
    __name__ = "faircast_ds.tools.predict._RestrictedPickle"


def load_state(path: str) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False, pickle_module=_RestrictedPickle)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as exc:
        raise PredictError(f"{path}: cannot read it as a DeepSpeed checkpoint file ({exc})") from None


_RANK = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def deepspeed_tag_dir(path: str) -> str | None:
    """The tag folder of a DeepSpeed checkpoint at ``path`` (the tag folder itself, or a save_dir with a
    ``latest`` file), or None if ``path`` is not one."""
    if glob.glob(os.path.join(path, "*zero_pp_rank_*_optim_states.pt")):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            tag = f.read().strip()
        tagged = os.path.join(path, tag)
        if not os.path.isdir(tagged):
            raise PredictError(f"{latest} names tag {tag!r}, but {tagged} does not exist")
        return deepspeed_tag_dir(tagged) or _not_zero(tagged)
    tags = sorted(d for d in glob.glob(os.path.join(path, "*")) if glob.glob(os.path.join(d, "*_optim_states.pt")))
    if tags:
        raise PredictError(f"{path} holds DeepSpeed tags {[os.path.basename(t) for t in tags]} but no 'latest' "
                           f"file: name one tag folder")
    return None


def _not_zero(tag: str) -> str:
    raise PredictError(f"{tag}: no ZeRO optimizer state files (*zero_pp_rank_*_optim_states.pt) in it")


class _Flat:
    """A virtual concatenation of 1-D tensors, sliced without copying more than a slice."""

    def __init__(self, parts: Sequence[torch.Tensor]) -> None:
        self.parts = list(parts)
        self.starts = [0]
        for p in self.parts:
            self.starts.append(self.starts[-1] + p.numel())

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def slice(self, lo: int, hi: int) -> torch.Tensor:
        pieces = []
        for part, a, b in zip(self.parts, self.starts, self.starts[1:]):
            if b <= lo or a >= hi:
                continue
            pieces.append(part[max(lo, a) - a:min(hi, b) - a])
        if not pieces:
            return torch.zeros(0)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def read_deepspeed(tag: str) -> tuple[Iterator[TensorState], dict[str, Any]]:
    """Each parameter's fp32 master (and AdamW moments, if the optimizer kept them) from a ZeRO-1/2/3
    tag folder, one parameter at a time; and what the checkpoint says about its optimizer."""
    files: dict[int, str] = {}
    for p in glob.glob(os.path.join(tag, "*zero_pp_rank_*_optim_states.pt")):
        m = _RANK.search(os.path.basename(p))
        if m is None:
            continue
        if int(m.group(2)) != 0:
            raise PredictError(f"{tag}: model-parallel checkpoints (mp_rank > 0) are not supported")
        files[int(m.group(1))] = p
    world = len(files)
    if world == 0 or sorted(files) != list(range(world)):
        raise PredictError(f"{tag}: ZeRO optimizer state files for ranks {sorted(files)}, expected 0 .. {world - 1}")
    states = [load_state(files[r]) for r in range(world)]
    osd = [s.get("optimizer_state_dict") for s in states]
    if not all(isinstance(o, dict) for o in osd):
        raise PredictError(f"{tag}: the optimizer state files have no optimizer_state_dict")
    stage3 = "fp32_flat_groups" in osd[0]
    flat_key = "fp32_flat_groups" if stage3 else "single_partition_of_fp32_groups"
    if flat_key not in osd[0]:
        raise PredictError(f"{tag}: neither fp32_flat_groups (ZeRO-3) nor single_partition_of_fp32_groups "
                           f"(ZeRO-1/2) in the optimizer state")
    inner = osd[0].get("optimizer_state_dict", {})
    groups = inner.get("param_groups", [{}])
    meta = {k: groups[0].get(k) for k in ("lr", "betas", "eps", "weight_decay") if k in groups[0]}
    meta.update({"format": "deepspeed_zero3" if stage3 else "deepspeed_zero1/2", "world_size": world})
    shapes = _param_shapes(tag, stage3)

    def moment(rank: int, key: str) -> list[torch.Tensor] | None:
        st = osd[rank].get("optimizer_state_dict", {}).get("state", {})
        parts = [st[i].get(key) for i in sorted(st)] if st else []
        return parts if parts and all(isinstance(p, torch.Tensor) for p in parts) else None

    def step_of(rank: int) -> float | None:
        st = osd[rank].get("optimizer_state_dict", {}).get("state", {})
        for i in sorted(st):
            if "step" in st[i]:
                return float(st[i]["step"])
        return None

    has_moments = all(moment(r, "exp_avg") is not None and moment(r, "exp_avg_sq") is not None for r in range(world))
    meta["moments"] = has_moments
    step = step_of(0)
    meta["optimizer_step"] = step

    def gen() -> Iterator[TensorState]:
        if stage3:
            # every rank holds ceil(numel / world) of each parameter, parameters back to back
            flats = [_Flat(osd[r][flat_key]) for r in range(world)]
            avgs = [_Flat(moment(r, "exp_avg")) for r in range(world)] if has_moments else None
            sqs = [_Flat(moment(r, "exp_avg_sq")) for r in range(world)] if has_moments else None
            offset = 0
            for name, shape in ((n, s) for group in shapes for n, s in group.items()):
                numel = math.prod(shape)
                part = -(-numel // world)

                def gather(views: list[_Flat]) -> torch.Tensor:
                    return torch.cat([v.slice(offset, offset + part) for v in views])[:numel]

                values = gather(flats)
                if values.numel() != numel:
                    raise PredictError(f"{tag}: the flat state is shorter than the parameters it lists ({name})")
                yield TensorState(name, values.view(shape),
                                  gather(avgs).view(shape) if avgs else None,
                                  gather(sqs).view(shape) if sqs else None, step)
                offset += part
        else:
            # each parameter group is one flat vector split evenly across ranks, parameters back to back
            for g, group in enumerate(shapes):
                flat = _Flat([osd[r][flat_key][g] for r in range(world)])
                avg = _Flat([moment(r, "exp_avg")[g] for r in range(world)]) if has_moments else None
                sq = _Flat([moment(r, "exp_avg_sq")[g] for r in range(world)]) if has_moments else None
                offset = 0
                for name, shape in group.items():
                    numel = math.prod(shape)
                    if offset + numel > flat.numel:
                        raise PredictError(f"{tag}: the flat state is shorter than the parameters it lists ({name})")
                    yield TensorState(name, flat.slice(offset, offset + numel).view(shape),
                                      avg.slice(offset, offset + numel).view(shape) if avg else None,
                                      sq.slice(offset, offset + numel).view(shape) if sq else None, step)
                    offset += numel

    return gen(), meta


def _param_shapes(tag: str, stage3: bool) -> list[dict[str, tuple[int, ...]]]:
    pattern = "*zero_pp_rank_0_mp_rank_00_model_states.pt" if stage3 else "*mp_rank_00_model_states.pt"
    found = sorted(glob.glob(os.path.join(tag, pattern)))
    if not found:
        raise PredictError(f"{tag}: no model states file ({pattern}) to name the parameters")
    shapes = load_state(found[0]).get("param_shapes")
    if isinstance(shapes, dict):
        shapes = [shapes]
    if not isinstance(shapes, list) or not shapes:
        raise PredictError(f"{found[0]}: no param_shapes")
    return [{n: tuple(int(x) for x in s) for n, s in g.items()} for g in shapes]


# ---------------------------------------------------------------------------------------------------
# The prediction


def adam_step(t: TensorState, values: torch.Tensor, lr: float, betas: tuple[float, float], eps: float,
              weight_decay: float) -> torch.Tensor:
    """|the step AdamW takes next| per element: from the moments when present (bias-corrected with the
    checkpoint's step count), else ``lr`` (a sign-consistent gradient's normalized update is 1)."""
    decay = lr * weight_decay * values
    if t.exp_avg is not None and t.exp_avg_sq is not None and t.step:
        b1, b2 = betas
        m = t.exp_avg.double() / (1 - b1 ** t.step)
        v = t.exp_avg_sq.double() / (1 - b2 ** t.step)
        return (lr * m / (v.sqrt() + eps) + decay).abs()
    # no moments: the update's direction is unknown, so the decay is taken as adding to it (an upper bound)
    return lr + decay.abs()


def _slices(t: TensorState) -> Iterator[TensorState]:
    """``t`` flattened into consecutive slices of at most :data:`CHUNK_ELEMENTS` (views, no copies)."""
    flat = t.values.reshape(-1)
    avg = t.exp_avg.reshape(-1) if t.exp_avg is not None else None
    sq = t.exp_avg_sq.reshape(-1) if t.exp_avg_sq is not None else None
    for lo in range(0, flat.numel(), CHUNK_ELEMENTS):
        hi = lo + CHUNK_ELEMENTS
        yield TensorState(t.name, flat[lo:hi], avg[lo:hi] if avg is not None else None,
                          sq[lo:hi] if sq is not None else None, t.step)


def predict(path: str, settings: AdamSettings, steps: int | None = None) -> dict[str, Any]:
    """The prediction for the checkpoint at ``path`` (see the module docstring); ``steps``: also the
    figures over a run of that many steps."""
    if steps is not None and steps <= 0:
        raise PredictError(f"--steps must be > 0, got {steps}")
    if not os.path.exists(path):
        raise PredictError(f"{path}: no such file or directory")
    meta: dict[str, Any]
    tag = deepspeed_tag_dir(path) if os.path.isdir(path) else None
    if tag is not None:
        tensors, meta = read_deepspeed(tag)
    else:
        files = safetensors_files(path)
        if not files or (os.path.isfile(path) and not path.endswith(".safetensors")):
            raise PredictError(f"{path}: not a checkpoint (no *.safetensors, no DeepSpeed ZeRO tag folder or "
                               f"'latest' file)")
        tensors, meta = read_safetensors(files), {"format": "safetensors", "moments": False}
    betas = settings.betas or tuple(meta.get("betas") or (0.9, 0.999))
    eps = settings.eps if settings.eps is not None else float(meta.get("eps") or 1e-8)
    wd = settings.weight_decay if settings.weight_decay is not None else float(meta.get("weight_decay") or 0.0)
    total = Tally()
    per_tensor = []
    for t in tensors:
        tally = Tally()
        for part in _slices(t):
            values = part.values.detach().float()
            moments = part.exp_avg is not None and part.exp_avg_sq is not None
            finite = torch.isfinite(values)
            if moments:
                finite &= torch.isfinite(part.exp_avg) & torch.isfinite(part.exp_avg_sq)
            tally.nonfinite += int((~finite).sum())
            values = values[finite]
            if moments:
                part = TensorState(t.name, values, part.exp_avg.detach()[finite], part.exp_avg_sq.detach()[finite],
                                   t.step)
            if values.numel():
                spacing = bf16_spacing(values.bfloat16()).double()
                tally.add(spacing, adam_step(part, values.double(), settings.lr, betas, eps, wd), steps)
        per_tensor.append({"name": t.name, **tally.figures(steps)})
        total.merge(tally)
    if not per_tensor:
        raise PredictError(f"{path}: no floating-point weights in it")
    out = {
        "checkpoint": path, "format": meta["format"],
        "model": "adam_moments" if meta.get("moments") else "lr_only",
        "lr": settings.lr, "betas": list(betas), "eps": eps, "weight_decay": wd,
        **total.figures(steps),
    }
    if meta.get("moments"):
        out["optimizer_step"] = meta.get("optimizer_step")
    out["verdict"] = verdict(out)
    out["tensors"] = per_tensor
    return out


def verdict(fig: dict[str, Any]) -> str:
    """One line: will Fair Cast matter for a run like this?"""
    delay, peak = fig["predicted_delay_steps"], fig["predicted_delay_peak_step"]
    share = 100 * fig["share_below_half_spacing"]
    if fig["numel"] == fig.get("nonfinite", 0):
        return "no finite weights: nothing to predict"
    if delay >= MATTERS_FROM:
        return (f"Fair Cast will matter: {share:.1f}% of weights step less than half a bf16 spacing, and RN's "
                f"served copy is predicted to trail the master by up to {delay:.0f} steps (around step {peak}); "
                f"an unbiased cast (dither keeps RN's sparsity) removes that lag")
    if delay >= MATTERS_BELOW:
        return (f"Fair Cast may matter: RN's served copy is predicted to trail by up to {delay:.1f} steps "
                f"(around step {peak}); worth it if a few steps of delay matter to the run")
    return (f"Fair Cast is unlikely to matter: a typical AdamW step already moves most weights across half a "
            f"bf16 spacing (RN predicted to trail by at most {delay:.1f} steps)")


def format_report(report: dict[str, Any], top: int | None = None) -> str:
    """The text ``faircast-ds predict`` prints."""
    lines = [f"{report['checkpoint']} ({report['format']}): model {report['model']}, lr {report['lr']:g}, "
             f"betas {tuple(report['betas'])}, eps {report['eps']:g}, weight decay {report['weight_decay']:g}"]
    if report["model"] == "lr_only":
        lines.append("  no AdamW moments in the checkpoint: |step| = lr per element (a sign-consistent gradient's "
                     "normalized update), the fastest a weight drifts; noisy gradients drift slower")
    else:
        lines.append("  |step| per element from the checkpoint's AdamW moments (bias-corrected), the step it takes next")
    head = f"  {'tensor':<48} {'numel':>10} {'below s/2':>9} {'RN chg/step':>11} {'delay':>7} {'@step':>6} {'nonfinite':>9}"
    lines.append(head)
    rows = report["tensors"] if top is None else report["tensors"][:top]
    for t in rows:
        lines.append(f"  {t['name'][-48:]:<48} {t['numel']:>10} {100 * t['share_below_half_spacing']:>8.2f}% "
                     f"{100 * t['predicted_changed_fraction']:>10.3f}% {t['predicted_delay_steps']:>7.1f} "
                     f"{t['predicted_delay_peak_step']:>6} {t['nonfinite']:>9}")
    lines.append(f"  {'all':<48} {report['numel']:>10} {100 * report['share_below_half_spacing']:>8.2f}% "
                 f"{100 * report['predicted_changed_fraction']:>10.3f}% {report['predicted_delay_steps']:>7.1f} "
                 f"{report['predicted_delay_peak_step']:>6} {report['nonfinite']:>9}")
    if report["nonfinite"]:
        lines.append(f"  warning: {report['nonfinite']} non-finite weights (or moments) left out of every figure")
    if "steps" in report:
        lines.append(f"  over {report['steps']} steps: mean lag {report['predicted_mean_lag_steps']:.1f} steps, "
                     f"lag at the end {report['predicted_lag_at_end_steps']:.1f}, RN changed "
                     f"{100 * report['predicted_changed_fraction_over_run']:.3f}% per step on average")
    lines.append("  delay: the peak over steps of the predicted lag along the drift from an on-grid (bf16) start; "
                 "see docs/predict.md")
    lines.append(f"verdict: {report['verdict']}")
    return "\n".join(lines)


def main(path: str, settings: AdamSettings, as_json: bool, steps: int | None = None) -> int:
    try:
        report = predict(path, settings, steps)
    except PredictError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if as_json else format_report(report))
    return 0
