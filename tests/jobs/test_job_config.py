"""The GRPO job's options (faircast_jobs/config.py) and its off-grid control (jobs/offgrid.py), in process.

The off-grid masters are checked against an oracle of their own: numpy bit arithmetic for each bf16
value's neighbours and the midpoints between them (exact in float64), and torch's own round-to-nearest
for the round trip.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from faircast_jobs.config import FULL_SEEDS, JOB_MODES, REGIMES, JobConfig, parse


def usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        parse(argv + ["--name", "x"])
    assert e.value.code == 2
    return capsys.readouterr().err


def test_regime_presets_parse():
    cfg = parse(["--name", "x"])
    assert cfg.regime == "paper" and cfg == JobConfig(name="x")
    big = parse(["--regime", "large-step", "--steps", "7", "--name", "x"])
    assert (big.lr, big.hidden, big.prompt_vocab, big.steps) == (1e-4, 256, 0, 7)  # flags override the regime
    assert parse(["--full", "--name", "x"]).seeds == FULL_SEEDS["paper"] >= 8
    assert set(REGIMES) == set(FULL_SEEDS)
    with pytest.raises(SystemExit):
        parse(["--regime", "bogus"])


def test_job_options_parse():
    cfg = parse(["--lr", "3e-6", "--steps", "250", "--init-std", "0.05", "--seed-list", "8-19",
                 "--modes", "fp32,nearest,dither", "--off-grid", "--engine", "vllm", "--name", "x"])
    assert (cfg.lr, cfg.steps, cfg.init_std, cfg.off_grid, cfg.rollout_engine) == (3e-6, 250, 0.05, True, "vllm")
    assert cfg.seed_ids == tuple(range(8, 20)) and cfg.modes == ("fp32", "nearest", "dither")
    assert parse(["--seed-list", "0-2,7,5", "--name", "x"]).seed_ids == (0, 1, 2, 7, 5)
    assert parse(["--seed-list", "4", "--name", "x"]).seed_ids == (4,)
    assert parse(["--first-seed", "5", "--seeds", "3", "--name", "x"]).seed_ids == (5, 6, 7)
    assert parse(["--name", "x"]).seed_ids == (0,) and parse(["--name", "x"]).off_grid is False
    assert parse(["--rollout-engine", "vllm", "--name", "x"]).rollout_engine == "vllm"


@pytest.mark.parametrize("argv,message", [
    (["--seed-list", "19-8"], "runs backwards"),
    (["--seed-list", "8-x"], "is not a seed"),
    (["--seed-list", "-3"], "is not a seed"),
    (["--seed-list", "1,,2"], "empty item"),
    (["--seed-list", "3,1-4"], "names a seed more than once"),
    (["--seed-list", "8-19", "--seeds", "2"], "drop --seeds"),
    (["--seed-list", "8-19", "--first-seed", "2"], "drop --first-seed"),
    (["--seed-list", "8-19", "--full"], "drop --full"),
    (["--modes", "fp32,rn"], "unknown mode(s) 'rn' in --modes"),
    (["--modes", "dither,dither"], "--modes names dither more than once"),
    (["--modes", "nearest,"], "--modes 'nearest,': empty item"),
    (["--lr", "0"], "--lr must be a finite number > 0"),
    (["--lr", "inf"], "--lr must be a finite number > 0"),
    (["--init-std", "-0.1"], "--init-std must be a finite number > 0"),
    (["--steps", "0"], "--steps must be an integer >= 1"),
    (["--seeds", "0"], "--seeds must be an integer >= 1"),
    (["--tie", "-1"], "--tie must be a finite number >= 0"),
    (["--hidden", "66"], "--hidden must be a multiple of 4"),
    (["--engine", "sglang"], "invalid choice: 'sglang'"),
    (["--zero-stage", "0"], "--zero-stage must be 1, 2 or 3, got 0"),
    (["--zero-stage", "4"], "--zero-stage must be 1, 2 or 3, got 4"),
])
def test_bad_options_are_refused_by_name(capsys, argv, message):
    assert message in usage_error(capsys, argv)


def test_config_validates_outside_the_command_line_too():
    with pytest.raises(ValueError, match="unknown mode"):
        JobConfig(modes=("fp32", "bf16"))
    with pytest.raises(ValueError, match="--modes needs at least one"):
        JobConfig(modes=())
    with pytest.raises(ValueError, match=r"--seed-list seeds must be integers in \[0, "):
        JobConfig(seed_list=(1, -2))
    # a run.json of an earlier job: `engine` was the rollout engine's name
    old = {**JobConfig(name="r").to_json(), "engine": "vllm", "modes": ["nearest", "dither"], "unknown": 1}
    del old["rollout_engine"], old["seed_list"], old["off_grid"]
    cfg = JobConfig.from_json(old)
    assert cfg.rollout_engine == "vllm" and cfg.modes == ("nearest", "dither") and cfg.seed_ids == (0,)
    assert JobConfig.from_json(JobConfig(seed_list=(3, 4), off_grid=True).to_json()) == \
        JobConfig(seed_list=(3, 4), off_grid=True)
    # a run.json from before the regimes (docs/grpo/default): the large-step job, no evaluations or KL
    legacy = JobConfig.from_json({"steps": 300, "lr": 1e-4, "hidden": 256, "modes": ["fp32", "nearest"]})
    assert (legacy.regime, legacy.prompt_vocab, legacy.eval_every, legacy.kl_every) == ("large-step", 0, 0, 0)
    assert set(JOB_MODES) == {"fp32", "nearest", "stochastic", "dither", "error_feedback"}


# ----------------------------------------------------------------------------------------- off-grid


def cells(values: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per bf16 value: |v| and the magnitudes of the midpoints to its lower and upper bf16 neighbours
    (float64, exact), from the fp32 bit patterns alone."""
    bits = values.float().numpy().view(np.uint32).astype(np.int64)
    mag_bits = bits & 0x7FFFFFFF
    as_f64 = lambda b: b.astype(np.uint32).view(np.float32).astype(np.float64)  # noqa: E731
    mag = as_f64(mag_bits)
    up = as_f64(mag_bits + 0x10000)  # the next bf16 magnitude up: the last kept bit + 1
    down = np.where(mag_bits == 0, 0.0, as_f64(np.maximum(mag_bits - 0x10000, 0)))
    return mag, (mag + down) / 2, (mag + up) / 2


def check_off_grid(values: torch.Tensor, masters: torch.Tensor) -> None:
    assert masters.dtype == torch.float32 and masters.shape == values.shape
    mag, low_mid, high_mid = cells(values)
    m = np.abs(masters.numpy().astype(np.float64))
    zero = mag == 0
    # strictly inside the cell: between the two midpoints (a midpoint itself would be a tie), same sign
    assert np.all((m > low_mid) | (zero & (m >= 0))) and np.all(m < high_mid)
    assert np.array_equal(np.signbit(masters.numpy()), np.signbit(values.float().numpy()))
    # round-to-nearest (torch's own cast) gives back the bf16 value, bit for bit
    assert torch.equal(masters.to(torch.bfloat16).view(torch.int16), values.to(torch.bfloat16).view(torch.int16))


EDGES = [1.0, -1.0, 2.0**-10, -(2.0**-10), 0.0, -0.0, 0.1, 3.0, 2.0**-133, -(2.0**-133), 3.3895313892515355e38]


def test_off_grid_masters_lie_inside_their_cells():
    from faircast_jobs.offgrid import off_grid

    g = torch.Generator().manual_seed(0)
    values = torch.cat([torch.tensor(EDGES).to(torch.bfloat16).repeat(200),
                        (0.1 * torch.randn(50_000, generator=g)).to(torch.bfloat16)])
    masters = off_grid(values, seed=8, name="w")
    check_off_grid(values, masters)
    # uniform across the cell in units of the local spacing: both sides, reaching near both edges
    mag, low_mid, high_mid = cells(values)
    m = np.abs(masters.numpy().astype(np.float64))
    nonzero = mag > 0
    frac = np.where(m >= mag, (m - mag) / (high_mid - mag), -(mag - m) / np.where(mag > low_mid, mag - low_mid, 1))
    frac = frac[nonzero]
    assert 0.45 < np.mean(frac > 0) < 0.55 and abs(np.mean(frac)) < 0.02
    assert frac.max() > 0.99 and frac.min() < -0.99 and np.mean(np.abs(frac) > 0.5) == pytest.approx(0.5, abs=0.02)
    assert np.mean(masters.numpy() != values.float().numpy()) > 0.999  # almost every master moved


def test_off_grid_is_seeded_and_the_same_for_every_mode():
    from faircast_jobs.grpo import build_model
    from faircast_jobs.offgrid import off_grid, off_grid_state

    values = (0.1 * torch.randn(4096, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    a = off_grid(values, seed=8, name="w")
    assert torch.equal(a.view(torch.int32), off_grid(values, seed=8, name="w").view(torch.int32))
    assert not torch.equal(a, off_grid(values, seed=9, name="w"))
    assert not torch.equal(a, off_grid(values, seed=8, name="v"))
    # the job's model: the bf16 modes' build and the fp32 reference's start from the same masters
    cfg = JobConfig(hidden=32, vocab=64, name="x")
    bf16, fp32 = build_model(cfg, 8, fp32=False), build_model(cfg, 8, fp32=True)
    ma, mb = off_grid_state(bf16.named_parameters(), 8), off_grid_state(fp32.named_parameters(), 8)
    assert list(ma) == [n for n, _ in bf16.named_parameters()] == list(mb)
    for name, p in bf16.named_parameters():
        assert torch.equal(ma[name].view(torch.int32), mb[name].view(torch.int32)), name
        check_off_grid(p.detach(), ma[name])


def test_off_grid_refuses_values_off_the_grid():
    from faircast_jobs.offgrid import off_grid

    with pytest.raises(ValueError, match="off the bf16 grid"):
        off_grid(torch.tensor([0.1, 0.2], dtype=torch.float32), seed=0, name="w")
    with pytest.raises(ValueError, match="finite"):
        off_grid(torch.tensor([float("inf")], dtype=torch.bfloat16), seed=0, name="w")


def test_the_zero_stage_reaches_the_deepspeed_config_with_only_its_own_keys():
    from faircast_jobs.grpo import ds_config

    for stage in (1, 2, 3):
        cfg = parse(["--model", "smollm2-135m-instruct", "--task", "addition", "--zero-stage", str(stage), "--name", "x"])
        zero = ds_config("dither", 0, cfg, 8)["zero_optimization"]
        assert zero["stage"] == stage
        assert any(k.startswith("stage3_") for k in zero) == (stage == 3), zero
    assert parse(["--name", "x"]).zero_stage == 3  # the default: the runs of docs/pretrained.md
