"""``faircast-ds predict`` on small checkpoints whose answers are known by construction.

The expected figures are computed here from the weights' chosen bf16 values (their spacings are set by
their binades: 2**(e - 7) for a value in [2**e, 2**(e+1))) and the chosen AdamW steps, with this file's
own arithmetic; the model's per-element rules (first change at ceil(s / 2d), one change per s/d steps)
are checked against bf16 round-to-nearest itself (torch's ``.bfloat16()``).
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

from faircast_ds.tools import predict as P
from faircast_ds.tools.cli import main as cli_main

LR = 2.0 ** -16


def binade_values(e: int, n: int, seed: int, top: int = 128) -> torch.Tensor:
    """n distinct-ish bf16 values in [2**e, 2**(e+1)) (mantissas below ``top``/128) with random signs:
    spacing 2**(e-7) for all."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.randint(0, top, (n,), generator=g).double()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    v = sign * (2.0 ** e) * (1 + mant / 128)
    assert torch.equal(v.bfloat16().double(), v)  # exactly on the bf16 grid
    return v


def expected(groups: list[tuple[float, float, int]], steps: int | None = None) -> dict[str, float]:
    """The model's figures from (spacing, |step|, count) groups, computed directly."""
    n = sum(c for _, _, c in groups)
    below = sum(c for s, d, c in groups if d < s / 2) / n
    changed = sum(c * min(1.0, d / s) for s, d, c in groups) / n
    ks = [(math.ceil(s / (2 * d)) if d > 0 else math.inf, d * d * c) for s, d, c in groups]
    total = sum(w for _, w in ks)
    best, best_t = 0.0, 0
    for t in range(1, 5000):
        lag = t * sum(w for k, w in ks if k > t) / total
        if lag > best:
            best, best_t = lag, t
    out = {"share_below_half_spacing": below, "predicted_changed_fraction": changed,
           "predicted_delay_steps": best, "predicted_delay_peak_step": best_t}
    if steps:
        mean = sum(t * sum(w for k, w in ks if k > t) / total for t in range(1, steps + 1)) / steps
        out["predicted_mean_lag_steps"] = mean
    return out


def check(fig: dict, want: dict) -> None:
    for key, value in want.items():
        assert fig[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


# ---------------------------------------------------------------------------------------------------
# The per-element rules against bf16 round-to-nearest


@pytest.mark.parametrize("ratio", [0.013, 0.3, 0.49, 0.77, 2.6])
def test_first_change_and_change_count_match_round_to_nearest(ratio: float) -> None:
    """A master on the bf16 grid drifting d = ratio * spacing per step: RN's served copy first changes
    at step ceil(s / 2d) and changes as often as the model counts."""
    w0 = binade_values(-3, 64, seed=1, top=64)  # room for 64 spacings of drift inside the binade
    s = 2.0 ** (-3 - 7)
    d = ratio * s
    steps = min(400, int(60 * s / d))
    served_prev = w0.float().bfloat16()
    first = torch.full_like(w0, math.inf)
    changes = torch.zeros_like(w0)
    for t in range(1, steps + 1):
        master = (w0 + torch.sign(w0) * t * d).float()  # drift away from zero: the spacing stays put
        served = master.bfloat16()
        moved = served != served_prev
        changes += moved.double()
        first = torch.where(moved & torch.isinf(first), torch.full_like(first, float(t)), first)
        served_prev = served
    spacing, step = torch.full_like(w0, s), torch.full_like(w0, d)
    assert torch.isfinite(first).all()
    assert torch.equal(first, P.first_change_step(spacing, step))
    assert torch.equal(changes, P.changes_in(steps, spacing, step))


# ---------------------------------------------------------------------------------------------------
# Hugging Face safetensors


def make_hf(tmp_path, nonfinite: int = 0) -> tuple[str, list[tuple[float, float, int]]]:
    big = binade_values(0, 300, seed=2)  # [1, 2): spacing 2**-7, d = 2**-16 -> below half, k = 256
    small = binade_values(-10, 100, seed=3)  # spacing 2**-17: d / s = 2 -> one change per step, k = 1
    mid = binade_values(-8, 50, seed=4)  # spacing 2**-15: d / s = 1/2 = exactly half -> not below, k = 1
    big_t = big.bfloat16().view(20, 15)
    if nonfinite:
        flat = big_t.view(-1)
        flat[:nonfinite] = float("nan")
        flat[nonfinite:2 * nonfinite] = float("inf")
    path = str(tmp_path / "ckpt")
    os.makedirs(path)
    save_file({"big.weight": big_t, "small.weight": small.float().view(10, 10)},
              os.path.join(path, "model-00001-of-00002.safetensors"))
    save_file({"mid.weight": mid.bfloat16(), "position_ids": torch.arange(7)},
              os.path.join(path, "model-00002-of-00002.safetensors"))
    groups = [(2.0 ** -7, LR, 300 - 2 * nonfinite), (2.0 ** -17, LR, 100), (2.0 ** -15, LR, 50)]
    return path, groups


def test_hf_safetensors_known_by_construction(tmp_path) -> None:
    path, groups = make_hf(tmp_path)
    rep = P.predict(path, P.AdamSettings(lr=LR), steps=300)
    assert rep["format"] == "safetensors" and rep["model"] == "lr_only"
    assert rep["numel"] == 450  # the integer position_ids are not weights
    want = expected(groups, steps=300)
    check(rep, want)
    # 2/3 of the weights step below half a spacing; the big ones hold the lag: peak just before k = 256
    assert rep["share_below_half_spacing"] == pytest.approx(300 / 450)
    assert rep["predicted_delay_peak_step"] == 255
    by_name = {t["name"]: t for t in rep["tensors"]}
    assert set(by_name) == {"big.weight", "small.weight", "mid.weight"}
    check(by_name["big.weight"], expected(groups[:1]))
    check(by_name["small.weight"], expected(groups[1:2]))
    assert by_name["small.weight"]["predicted_changed_fraction"] == 1.0
    assert by_name["mid.weight"]["share_below_half_spacing"] == 0.0
    assert "will matter" in rep["verdict"]


def test_hf_single_file_and_weight_decay(tmp_path) -> None:
    path, _ = make_hf(tmp_path)
    file = os.path.join(path, "model-00001-of-00002.safetensors")
    wd = 0.5
    rep = P.predict(file, P.AdamSettings(lr=LR, weight_decay=wd))
    # no moments: |step| = lr (1 + wd |w|), the decay taken in the update's direction
    big = binade_values(0, 300, seed=2)
    small = binade_values(-10, 100, seed=3)
    n = 400
    changed = (sum(min(1.0, LR * (1 + wd * abs(float(w))) / 2.0 ** -7) for w in big) +
               sum(min(1.0, LR * (1 + wd * abs(float(w))) / 2.0 ** -17) for w in small)) / n
    assert rep["numel"] == n
    assert rep["predicted_changed_fraction"] == pytest.approx(changed, rel=1e-9)


def test_nonfinite_weights_reported_and_left_out(tmp_path, capsys) -> None:
    path, groups = make_hf(tmp_path, nonfinite=3)
    rep = P.predict(path, P.AdamSettings(lr=LR))
    assert rep["nonfinite"] == 6
    assert {t["name"]: t["nonfinite"] for t in rep["tensors"]}["big.weight"] == 6
    check(rep, expected(groups))
    assert P.main(path, P.AdamSettings(lr=LR), as_json=False) == 0
    assert "6 non-finite" in capsys.readouterr().out


def test_large_lr_says_it_will_not_matter(tmp_path) -> None:
    path, groups = make_hf(tmp_path)
    rep = P.predict(path, P.AdamSettings(lr=2.0 ** -7))  # every step moves every weight at least half a spacing
    assert rep["share_below_half_spacing"] == 0.0
    assert rep["predicted_delay_steps"] < P.MATTERS_BELOW
    assert "unlikely to matter" in rep["verdict"]


# ---------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO checkpoints (files written as DeepSpeed lays them out; no launch)


def _stage_enum(stage: int):
    try:
        from deepspeed.runtime.zero.config import ZeroStageEnum

        return ZeroStageEnum(stage)  # pickled as DeepSpeed pickles it: the reader must not need DeepSpeed
    except ImportError:  # pragma: no cover
        return stage


def ds_params(seed: int = 5) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter: fp32 master values, exp_avg, exp_avg_sq chosen so that after ``STEP`` steps the
    AdamW step is lr / c exactly up to eps (m_hat = g, v_hat = (c g)**2), c per element; zeros where frozen."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (e, shape) in {"w.weight": (-2, (7, 5)), "b.bias": (-9, (9,)), "n.weight": (0, (4,))}.items():
        n = math.prod(shape)
        values = binade_values(e, n, seed=seed + n).float()
        grad = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
        c = torch.where(torch.rand(n, generator=g) < 0.5, 1.0, 4.0).double()
        frozen = torch.rand(n, generator=g) < 0.2
        m_hat = torch.where(frozen, 0.0, grad * torch.sign(torch.randn(n, generator=g, dtype=torch.float64)))
        v_hat = torch.where(frozen, 0.0, (c * grad) ** 2)
        # as stored (fp32 moments before bias correction), so that the expectation reads what the file holds
        m_hat = (m_hat * (1 - BETAS[0] ** STEP)).float().double() / (1 - BETAS[0] ** STEP)
        v_hat = (v_hat * (1 - BETAS[1] ** STEP)).float().double() / (1 - BETAS[1] ** STEP)
        out[name] = {"shape": shape, "values": values, "m_hat": m_hat, "v_hat": v_hat}
    return out


BETAS, STEP, EPS = (0.8, 0.99), 7, 1e-8


def write_zero3(tmp_path, params, world: int = 2) -> str:
    save = tmp_path / "ds"
    tag = save / "global_step7"
    os.makedirs(tag)
    (save / "latest").write_text("global_step7")
    flat = {k: [[] for _ in range(world)] for k in ("values", "exp_avg", "exp_avg_sq")}
    for p in params.values():
        n = p["values"].numel()
        part = -(-n // world)
        series = {"values": p["values"].double(), "exp_avg": p["m_hat"] * (1 - BETAS[0] ** STEP),
                  "exp_avg_sq": p["v_hat"] * (1 - BETAS[1] ** STEP)}
        for key, full in series.items():
            padded = torch.cat([full, torch.full((part * world - n,), 123.0, dtype=torch.float64)])  # padding
            for r in range(world):
                flat[key][r].append(padded[r * part:(r + 1) * part].float())
    shapes = [{name: torch.Size(p["shape"]) for name, p in params.items()}]
    for r in range(world):
        cat = {k: torch.cat(v[r]) for k, v in flat.items()}
        optim = {"optimizer_state_dict": {
            "zero_stage": _stage_enum(3), "partition_count": world,
            "optimizer_state_dict": {"state": {0: {"step": torch.tensor(float(STEP)), "exp_avg": cat["exp_avg"],
                                                   "exp_avg_sq": cat["exp_avg_sq"]}},
                                     "param_groups": [{"lr": 1e-3, "betas": BETAS, "eps": EPS, "weight_decay": 0.0,
                                                       "params": [0]}]},
            "fp32_flat_groups": [cat["values"]]}, "ds_version": "0.19.8"}
        torch.save(optim, tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        torch.save({"module": {}, "param_shapes": shapes, "dp_world_size": world},
                   tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
    return str(save)


def write_zero2(tmp_path, params, world: int = 2) -> str:
    tag = tmp_path / "ds2" / "global_step7"
    os.makedirs(tag)
    series = {"values": torch.cat([p["values"].double() for p in params.values()]),
              "exp_avg": torch.cat([p["m_hat"] for p in params.values()]) * (1 - BETAS[0] ** STEP),
              "exp_avg_sq": torch.cat([p["v_hat"] for p in params.values()]) * (1 - BETAS[1] ** STEP)}
    n = series["values"].numel()
    part = -(-n // (2 * world)) * 2
    for r in range(world):
        cut = {k: torch.cat([v, torch.zeros(part * world - n, dtype=v.dtype)])[r * part:(r + 1) * part].float()
               for k, v in series.items()}
        optim = {"optimizer_state_dict": {
            "zero_stage": _stage_enum(2), "partition_count": [world],
            "optimizer_state_dict": {"state": {0: {"step": torch.tensor(float(STEP)), "exp_avg": cut["exp_avg"],
                                                   "exp_avg_sq": cut["exp_avg_sq"]}},
                                     "param_groups": [{"lr": 1e-3, "betas": BETAS, "eps": EPS, "weight_decay": 0.0}]},
            "single_partition_of_fp32_groups": [cut["values"]]}}
        torch.save(optim, tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    torch.save({"module": {}, "param_shapes": [{name: torch.Size(p["shape"]) for name, p in params.items()}]},
               tag / "mp_rank_00_model_states.pt")
    return str(tag)


def ds_expected(params, lr: float) -> tuple[list[tuple[float, float, int]], dict[str, list]]:
    groups, per = [], {}
    for name, p in params.items():
        e = {"w.weight": -2, "b.bias": -9, "n.weight": 0}[name]
        s = 2.0 ** (e - 7)
        d = (lr * p["m_hat"] / (p["v_hat"].sqrt() + EPS)).abs()
        gs = [(s, float(x), 1) for x in d]
        per[name] = gs
        groups += gs
    return groups, per


@pytest.mark.parametrize("writer", [write_zero3, write_zero2])
def test_deepspeed_checkpoint_uses_adam_moments(tmp_path, writer) -> None:
    params = ds_params()
    path = writer(tmp_path, params)
    lr = 3e-6
    rep = P.predict(path, P.AdamSettings(lr=lr))
    assert rep["model"] == "adam_moments"
    assert rep["betas"] == list(BETAS) and rep["eps"] == EPS  # the checkpoint's own
    assert rep["numel"] == sum(p["values"].numel() for p in params.values())  # padding left out
    groups, per = ds_expected(params, lr)
    check(rep, expected(groups))
    frozen = sum(int((p["v_hat"] == 0).sum()) for p in params.values())
    assert rep["frozen_share"] == pytest.approx(frozen / rep["numel"])
    for t in rep["tensors"]:
        check(t, expected(per[t["name"]]))


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_tensors_taken_in_slices_give_the_same_answer(tmp_path, monkeypatch, chunk) -> None:
    """A tensor longer than CHUNK_ELEMENTS is taken a slice at a time (a 155M-element embedding would need
    ~8 GB whole): the figures are the known ones, moments, padding and non-finite weights included."""
    monkeypatch.setattr(P, "CHUNK_ELEMENTS", chunk)
    params = ds_params()
    rep = P.predict(write_zero3(tmp_path, params), P.AdamSettings(lr=3e-6))
    groups, per = ds_expected(params, 3e-6)
    check(rep, expected(groups))
    for t in rep["tensors"]:
        check(t, expected(per[t["name"]]))
    path, hf_groups = make_hf(tmp_path, nonfinite=3)
    rep = P.predict(path, P.AdamSettings(lr=LR), steps=300)
    assert rep["nonfinite"] == 6 and rep["numel"] == 444
    check(rep, expected(hf_groups, steps=300))


def test_deepspeed_without_moments_falls_to_lr_model_and_says_so(tmp_path) -> None:
    params = ds_params()
    path = write_zero3(tmp_path, params)
    tag = os.path.join(path, "global_step7")
    for r in range(2):
        f = os.path.join(tag, f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        sd = torch.load(f, weights_only=False)
        sd["optimizer_state_dict"]["optimizer_state_dict"]["state"] = {}  # e.g. SGD: no moments
        torch.save(sd, f)
    rep = P.predict(path, P.AdamSettings(lr=3e-6))
    assert rep["model"] == "lr_only"
    groups = [(2.0 ** ({"w.weight": -2, "b.bias": -9, "n.weight": 0}[n] - 7), 3e-6, p["values"].numel())
              for n, p in params.items()]
    check(rep, expected(groups))


def test_deepspeed_pickle_with_foreign_code_is_refused(tmp_path) -> None:
    path = write_zero3(tmp_path, ds_params())
    f = os.path.join(path, "global_step7", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    sd = torch.load(f, weights_only=False)
    sd["extra"] = Evil()
    torch.save(sd, f)
    with pytest.raises(P.PredictError, match="refusing to load"):
        P.predict(path, P.AdamSettings(lr=1e-6))


# ---------------------------------------------------------------------------------------------------
# The command: bad input and --json


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = cli_main(["predict", *argv])
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_keys(tmp_path, capsys) -> None:
    path, groups = make_hf(tmp_path)
    rc, out, _ = run_cli(capsys, path, "--lr", repr(LR), "--json")
    assert rc == 0
    rep = json.loads(out)
    for key in ("predicted_changed_fraction", "predicted_delay_steps", "share_below_half_spacing", "verdict",
                "model", "tensors"):
        assert key in rep
    check(rep, expected(groups))


def test_text_report(tmp_path, capsys) -> None:
    path, _ = make_hf(tmp_path)
    rc, out, _ = run_cli(capsys, path, "--lr", repr(LR), "--betas", "0.9,0.95", "--steps", "100")
    assert rc == 0
    assert "big.weight" in out and "verdict: Fair Cast will matter" in out and "over 100 steps" in out
    assert "betas (0.9, 0.95)" in out


@pytest.mark.parametrize("argv, message", [
    (["--lr", "0"], "--lr must be a finite number > 0"),
    (["--lr=-1e-6"], "--lr must be a finite number > 0"),
    (["--lr", "nan"], "--lr must be a finite number > 0"),
    (["--lr", "inf"], "--lr must be a finite number > 0"),
    (["--lr", "1e-6", "--betas", "0.9"], "--betas must be B1,B2"),
    (["--lr", "1e-6", "--betas", "a,b"], "--betas must be B1,B2"),
    (["--lr", "1e-6", "--betas", "0.9,1.0"], "--betas must be two numbers in [0, 1)"),
    (["--lr", "1e-6", "--eps", "0"], "--eps must be"),
    (["--lr", "1e-6", "--weight-decay=-1"], "--weight-decay must be"),
    (["--lr", "1e-6", "--steps", "0"], "--steps must be > 0"),
])
def test_bad_options(tmp_path, capsys, argv, message) -> None:
    path, _ = make_hf(tmp_path)
    rc, out, err = run_cli(capsys, path, *argv)
    assert rc == 2 and message in err and not out


def test_bad_paths(tmp_path, capsys) -> None:
    rc, _, err = run_cli(capsys, str(tmp_path / "nope"), "--lr", "1e-6")
    assert rc == 2 and "nope: no such file or directory" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = run_cli(capsys, str(empty), "--lr", "1e-6")
    assert rc == 2 and "not a checkpoint" in err
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    rc, _, err = run_cli(capsys, str(junk), "--lr", "1e-6")
    assert rc == 2 and "junk.safetensors: not a safetensors file" in err
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    rc, _, err = run_cli(capsys, str(text), "--lr", "1e-6")
    assert rc == 2 and "not a checkpoint" in err
    tags = tmp_path / "ds"
    (tags / "global_step1").mkdir(parents=True)
    (tags / "global_step1" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"junk")
    (tags / "global_step2").mkdir()
    (tags / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"junk")
    rc, _, err = run_cli(capsys, str(tags), "--lr", "1e-6")
    assert rc == 2 and "no 'latest' file" in err
    rc, _, err = run_cli(capsys, str(tags / "global_step1"), "--lr", "1e-6")
    assert rc == 2 and "cannot read it as a DeepSpeed checkpoint file" in err


def test_job_save_at_option() -> None:
    """The GRPO job's --save-at (checkpoints for predict): steps in order, bad values named."""
    from faircast_jobs.config import parse

    assert parse(["--steps", "500", "--save-at", "500,50"]).save_steps == (50, 500)
    assert parse([]).save_steps == ()
    for bad in ("0", "501", "x", "5,-1"):
        with pytest.raises(SystemExit):
            parse(["--steps", "500", "--save-at", bad])


# ---------------------------------------------------------------------------------------------------
# The committed validation (docs/predict/): the plot rebuilds from its CSV, the quoted law from the CSV

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VALIDATION_CSV = os.path.join(ROOT, "docs", "predict", "delay.csv")


def _validation():
    import importlib.util

    spec = importlib.util.spec_from_file_location("predict_validation",
                                                  os.path.join(ROOT, "benchmarks", "predict_validation.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_validation_plot_rebuilds_byte_for_byte(tmp_path) -> None:
    out = tmp_path / "delay.png"
    _validation().plot(VALIDATION_CSV, str(out))
    with open(os.path.join(ROOT, "docs", "predict", "delay.png"), "rb") as f:
        assert out.read_bytes() == f.read()


def test_validation_law_as_docs_quote_it() -> None:
    """docs/predict.md's fit (delay ~ lr^-0.986, ~ std^+0.87) and the median error of the delay from the
    initial weights (1.02), recomputed from the CSV with numpy."""
    import csv

    import numpy as np

    with open(VALIDATION_CSV) as f:
        init = [r for r in csv.DictReader(f) if r["source"] == "init"]
    by_lr = [r for r in init if float(r["init_std"]) == 0.1]
    slope = np.polyfit(np.log([float(r["lr"]) for r in by_lr]), np.log([float(r["meas_delay_steps"]) for r in by_lr]), 1)[0]
    assert round(slope, 3) == -0.986 and len(by_lr) == 11
    by_std = [r for r in init if float(r["lr"]) == 1.5e-6]
    slope = np.polyfit(np.log([float(r["init_std"]) for r in by_std]),
                       np.log([float(r["meas_delay_steps"]) for r in by_std]), 1)[0]
    assert round(slope, 2) == 0.87
    ratio = np.median([float(r["pred_delay_steps"]) / float(r["meas_delay_steps"]) for r in init])
    assert round(ratio, 2) == 1.02
    with open(os.path.join(ROOT, "docs", "predict.md")) as f:
        doc = f.read()
    assert "**−0.986**" in doc and "**+0.87**" in doc and "**1.02** [0.96, 1.20]" in doc
