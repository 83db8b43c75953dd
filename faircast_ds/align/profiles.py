"""Engine numerics profiles: where each inference engine rounds to bf16, region by region.

A profile is data, not code. Each of the four regions (RoPE, SwiGLU, residual-add + RMSNorm,
attention) is described by a :class:`Rounding`: a few switches that the implementations in
``regions.py`` read, plus the human-readable story and the kernel source it was read from.

This module imports neither torch nor transformers, so configuration code can use the names.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

EngineName = Literal["hf", "vllm-cuda", "vllm-inductor", "sglang", "vllm-cpu"]
# vllm-cpu on a named kind of CPU (``get_profile("vllm-cpu")`` picks the host's); the Python API takes them,
# the ``align_rounding`` config takes ``vllm-cpu``
CpuVariantName = Literal["vllm-cpu-avx512bf16", "vllm-cpu-avx2"]
RegionName = Literal["rope", "swiglu", "rmsnorm", "attention"]
ToBf16 = Literal["even", "truncate"]

ENGINES: tuple[str, ...] = get_args(EngineName)
CPU_VARIANTS: tuple[str, ...] = get_args(CpuVariantName)
REGIONS: tuple[str, ...] = get_args(RegionName)


@dataclass(frozen=True)
class Rounding:
    """How one region rounds.

    Attributes:
        fused: intermediates stay fp32 and the region rounds once, at its bf16 output. When
            False the region runs as a chain of bf16 ops, each rounding its result (HF eager).
        where: where the bf16 roundings happen, in words.
        source: the kernel or module the ``where`` was read from.
        fp32_table: RoPE only: cos/sin stay fp32 instead of being cast to the model dtype.
        fp32_sum: residual add + RMSNorm only: the norm reads the unrounded fp32 sum of the
            residual add (only the stored residual is rounded), whether or not the norm itself
            is fused. Every engine that fuses the norm also keeps the sum, so it defaults to
            ``fused``; vLLM's CPU build keeps the sum but rounds inside the norm like HF.
        to_bf16: how a fused region's one rounding from fp32 to bf16 is done: ``even``
            (round to nearest even, as torch's ``.to(bf16)`` and every GPU kernel do) or
            ``truncate`` (drop the low 16 bits: toward zero), what vLLM's CPU kernels do on an x86
            CPU without AVX512-BF16.
        kernel_order: attention only (fused): the arithmetic order of vLLM's CPU ``vec`` attention kernel:
            q is scaled in fp32 before ``q·kᵀ``, and the softmax numerators go unnormalized through
            ``P·V``, which is multiplied by ``1/sum`` at the end (instead of normalizing P first).
    """

    fused: bool
    where: str
    source: str
    fp32_table: bool = False
    fp32_sum: bool | None = None
    to_bf16: ToBf16 = "even"
    kernel_order: bool = False

    def __post_init__(self) -> None:
        if self.fp32_sum is None:
            object.__setattr__(self, "fp32_sum", self.fused)
        if self.to_bf16 not in get_args(ToBf16):
            raise ValueError(f"to_bf16 must be one of {get_args(ToBf16)}, got {self.to_bf16!r}")
        if (self.to_bf16 != "even" or self.kernel_order) and not self.fused:
            raise ValueError("to_bf16 and kernel_order describe a fused region; an unfused region rounds as torch")

    def same_numerics(self, other: Rounding) -> bool:
        """True when both round in the same places and the same way (the prose may differ)."""
        return ((self.fused, self.fp32_table, self.fp32_sum, self.to_bf16, self.kernel_order)
                == (other.fused, other.fp32_table, other.fp32_sum, other.to_bf16, other.kernel_order))


@dataclass(frozen=True)
class EngineProfile:
    """Where one inference engine rounds to bf16 in each alignable region."""

    name: str
    rope: Rounding
    swiglu: Rounding
    rmsnorm: Rounding
    attention: Rounding

    def region(self, name: str) -> Rounding:
        """The rounding of region ``name`` (one of :data:`REGIONS`)."""
        return getattr(self, check_regions([name])[0])

    def differs_from_hf(self, region: str) -> bool:
        """True when aligning ``region`` to this engine changes HF eager numerics."""
        return not self.region(region).same_numerics(HF.region(region))

    def restricted_to(self, regions: list[str] | tuple[str, ...]) -> EngineProfile:
        """This profile for ``regions``; HF eager rounding everywhere else.

        This is what a trainer aligned on ``regions`` only computes.
        """
        keep = set(check_regions(regions))
        hf_rest = {r: HF.region(r) for r in REGIONS if r not in keep}
        name = self.name if keep == set(REGIONS) else f"{self.name}[{','.join(r for r in REGIONS if r in keep)}]"
        return replace(self, name=name, **hf_rest)

    def rounding_table(self) -> str:
        """A markdown table: region, where bf16 rounding happens, source."""
        rows = [f"| region | `{self.name}`: where bf16 rounding happens | source |", "|---|---|---|"]
        for r in REGIONS:
            rounding = self.region(r)
            rows.append(f"| {_REGION_TITLES[r]} | {rounding.where} | {rounding.source} |")
        return "\n".join(rows)


_REGION_TITLES = {"rope": "RoPE", "swiglu": "SwiGLU", "rmsnorm": "residual add + RMSNorm",
                  "attention": "attention"}

# --- the five profiles -------------------------------------------------------------------------
# Read from the sources named in each `source`; file paths are in the upstream repositories.

_HF_FILE = "transformers `models/qwen3/modeling_qwen3.py` (qwen2, llama identical)"

HF = EngineProfile(
    name="hf",
    rope=Rounding(
        fused=False,
        where="cos/sin cast to bf16; `q·cos`, `rotate(q)·sin` and their sum each rounded (3 roundings)",
        source=f"{_HF_FILE}: `RotaryEmbedding.forward` (`cos.to(x.dtype)`), `apply_rotary_pos_emb`",
    ),
    swiglu=Rounding(
        fused=False,
        where="`silu(gate)` rounded, `·up` rounded (2 roundings)",
        source=f"{_HF_FILE}: `MLP.forward` (`act_fn(gate_proj(x)) * up_proj(x)`)",
    ),
    rmsnorm=Rounding(
        fused=False,
        where="residual add rounded; fp32 norm of the rounded sum, `.to(bf16)`, then `weight·` rounded again",
        source=f"{_HF_FILE}: `DecoderLayer.forward` (`residual + hidden_states`), `RMSNorm.forward`",
    ),
    attention=Rounding(
        fused=False,
        where="bf16 scores `q·kᵀ` rounded, `·scaling` rounded, fp32 softmax rounded to bf16, bf16 `P·V`",
        source=f"{_HF_FILE}: `eager_attention_forward`",
    ),
)

# The GPU engines' attention kernels (FlashAttention, FlashInfer) keep the scores in fp32 with a
# blockwise online softmax and round P to bf16 for the P·V matrix multiply: neither HF eager nor a
# single rounding. That is not modelled; their profiles leave attention as HF eager computes it.
_GPU_ATTENTION = Rounding(
    fused=False,
    where="not modelled (fp32 online softmax, P rounded to bf16 for `P·V`): the trainer keeps HF eager attention",
    source="vLLM `v1/attention/backends/flash_attn.py`, FlashInfer `include/flashinfer/attention/`",
)

VLLM_CUDA = EngineProfile(
    name="vllm-cuda",
    rope=Rounding(
        fused=True,
        where="cos/sin cache cast to bf16 (query dtype); fp32 `x·cos − y·sin`, one rounding",
        source="vLLM `csrc/pos_encoding_kernels.cu` (`apply_token_rotary_embedding`), "
        "`model_executor/layers/rotary_embedding/base.py` (`forward_cuda` casts the cache)",
    ),
    swiglu=Rounding(
        fused=False,
        where="same places as HF: `silu_kernel` returns bf16, the product is a bf16 multiply",
        source="vLLM `csrc/activation_kernels.cu` (`silu_kernel`, `act_and_mul_kernel`)",
    ),
    rmsnorm=Rounding(
        fused=False,
        where="same places as HF: bf16 add, fp32 norm of the rounded sum, `(bf16)(x·rms)`, `·weight` rounded",
        source="vLLM `csrc/layernorm_kernels.cu` (`fused_add_rms_norm_kernel`, `rms_norm_kernel`; "
        "`kernels/vllm_c.py` registers them first when not compiling with Inductor, `platforms/cuda.py`)",
    ),
    attention=_GPU_ATTENTION,
)

# Inductor keeps bf16 pointwise intermediates in fp32 inside a fused kernel. Uncompiled, or with
# TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1, forward_native rounds like HF in RoPE and SwiGLU and
# norms the fp32 sum with two roundings; with an fp32 cos/sin cache the compiled RoPE would round
# like SGLang's. tests/align/test_align_inductor.py checks these against the compiler.
VLLM_INDUCTOR = EngineProfile(
    name="vllm-inductor",
    rope=Rounding(
        fused=True,
        where="cos/sin cache stored in bf16; `x1·cos − x2·sin` fused by Inductor in fp32, one rounding",
        source="vLLM `model_executor/layers/rotary_embedding/common.py` (`apply_rotary_emb_torch`), "
        "`base.py` (`cache.to(dtype)` at init)",
    ),
    swiglu=Rounding(
        fused=True,
        where="`F.silu(x[:d]) * x[d:]` fused by Inductor: fp32 `silu(g)·u`, one rounding",
        source="vLLM `model_executor/layers/activation.py` (`SiluAndMul.forward_native`)",
    ),
    rmsnorm=Rounding(
        fused=True,
        where="fp32 sum feeds the norm, residual stored bf16; `.to(bf16)·weight` fused: fp32 `x·rms·w`, one rounding",
        source="vLLM `model_executor/layers/layernorm.py` (`RMSNorm.forward_static`)",
    ),
    attention=_GPU_ATTENTION,
)

SGLANG = EngineProfile(
    name="sglang",
    rope=Rounding(
        fused=True,
        fp32_table=True,
        where="cos/sin cache kept fp32 on CUDA; fp32 `x·cos − y·sin`, one rounding",
        source="SGLang `srt/layers/rotary_embedding.py` (fp32 cache), FlashInfer `include/flashinfer/pos_enc.cuh` "
        "(`BatchQKApplyRotaryPosIdsCosSinCacheKernel`)",
    ),
    swiglu=Rounding(
        fused=True,
        where="fp32 `silu(g)·u`, one rounding",
        source="FlashInfer `include/flashinfer/activation.cuh` (`act_and_mul_kernel`)",
    ),
    rmsnorm=Rounding(
        fused=True,
        where="fp32 sum kept for the norm, residual stored bf16; fp32 `x·rms·w`, one rounding",
        source="FlashInfer `include/flashinfer/norm.cuh` (`FusedAddRMSNormKernel`, `RMSNormKernel`)",
    ),
    attention=_GPU_ATTENTION,
)

# vLLM's CPU build (vllm-cpu 0.32, eager), read from the installed sources and checked against the
# running engine: tests/vllm_tests/test_vllm.py (tiny Qwen3, an AVX512-BF16 CPU), tests/align/test_align_engine.py
# and benchmarks/align_probe.py (any CPU; SmolLM2 in docs/alignment.md). Its RoPE and attention are C++
# kernels that compute in fp32 and convert to bf16 with the CPU's vector types (`csrc/cpu/cpu_types_x86.hpp`):
# `_mm512_cvtneps_pbh` (round to nearest even) where the CPU has AVX512-BF16, otherwise a 16-bit shift
# (`FP32Vec8_to_BF16Vec8_avx2`, the AVX-512F branch alike): truncation toward zero. The norms, SwiGLU and the
# projections are torch ops (round to nearest) on every CPU.
_CPU_KERNELS = "vLLM `csrc/cpu/cpu_types_x86.hpp` (`BF16Vec8/BF16Vec16(const FP32Vec…&)`)"
VLLM_CPU_AVX512BF16 = EngineProfile(
    name="vllm-cpu-avx512bf16",
    rope=Rounding(
        fused=True,
        where="cos/sin cache cast to bf16 (query dtype); fp32 `x·cos − y·sin` (FP32Vec8), one rounding (to nearest)",
        source="vLLM `model_executor/layers/rotary_embedding/base.py` (`forward_cpu` → `_C.rotary_embedding`, "
        f"`_match_cos_sin_cache_dtype`), `csrc/cpu/pos_encoding.cpp`; {_CPU_KERNELS}: `_mm512_cvtneps_pbh`",
    ),
    swiglu=Rounding(
        fused=False,
        where="same places as HF: x86 runs `SiluAndMul.forward_native`, `F.silu(g)` rounded, `·u` rounded",
        source="vLLM `model_executor/layers/activation.py` (`SiluAndMul.forward_cpu`)",
    ),
    rmsnorm=Rounding(
        fused=False,
        fp32_sum=True,
        where="fp32 sum feeds the norm, residual stored bf16; inside the norm as HF: `(x·rms)` rounded, `·w` rounded",
        source="vLLM `ir/ops/layernorm.py` (`fused_add_rms_norm`, `rms_norm`: the native implementations, the only "
        "ones registered for CPU; `kernels/vllm_c.py` is GPU-only)",
    ),
    attention=Rounding(
        fused=True,
        where="fp32 scores `q·kᵀ·scale`, fp32 softmax, fp32 `P·V`, one rounding of the output (to nearest)",
        source="vLLM `v1/attention/backends/cpu_attn.py` (`cpu_attention_with_kv_cache`), `csrc/cpu/cpu_attn_impl.hpp`; "
        f"{_CPU_KERNELS}: `_mm512_cvtneps_pbh`",
    ),
)
VLLM_CPU_AVX2 = replace(
    VLLM_CPU_AVX512BF16,
    name="vllm-cpu-avx2",
    rope=replace(VLLM_CPU_AVX512BF16.rope, to_bf16="truncate",
                 where="cos/sin cache cast to bf16 (query dtype); fp32 `x·cos − y·sin` (FP32Vec8), one rounding: "
                 "truncated toward zero (no AVX512-BF16)",
                 source=VLLM_CPU_AVX512BF16.rope.source.replace("`_mm512_cvtneps_pbh`", "`FP32Vec8_to_BF16Vec8_avx2`")),
    attention=replace(VLLM_CPU_AVX512BF16.attention, to_bf16="truncate", kernel_order=True,
                      where="fp32 `(q·scale)·kᵀ`, fp32 `exp(s − max)`, unnormalized fp32 `P·V` times `1/sum`, one "
                      "rounding of the output: truncated toward zero (no AVX512-BF16)",
                      source=VLLM_CPU_AVX512BF16.attention.source.replace("`_mm512_cvtneps_pbh`",
                                                                          "`FP32Vec8_to_BF16Vec8_avx2`")
                      + ", `csrc/cpu/cpu_attn_vec.hpp` (`scale_on_logits = false`: q scaled in `copy_q_heads_tile`)"),
)


def host_has_avx512_bf16() -> bool:
    """Whether this machine's CPU has AVX512-BF16 (Linux: ``/proc/cpuinfo``; elsewhere torch's check)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512_bf16" in line.split()
    except OSError:
        pass
    import torch  # not at import time: the config stays torch-free

    return bool(torch.cpu._is_avx512_bf16_supported())


def _host_vllm_cpu() -> EngineProfile:
    """``vllm-cpu``: vLLM's CPU build as it runs on this machine's CPU."""
    import platform

    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    variant = VLLM_CPU_AVX2 if x86 and not host_has_avx512_bf16() else VLLM_CPU_AVX512BF16
    return replace(variant, name="vllm-cpu")


PROFILES: dict[str, EngineProfile] = {
    p.name: p for p in (HF, VLLM_CUDA, VLLM_INDUCTOR, SGLANG, VLLM_CPU_AVX512BF16, VLLM_CPU_AVX2)}
# names resolved on the machine that asks: the engine is assumed to run on a CPU of the same kind
HOST_RESOLVED = {"vllm-cpu": _host_vllm_cpu}


def get_profile(engine: str) -> EngineProfile:
    """The profile of ``engine``; ``ValueError`` naming the known engines otherwise.

    ``vllm-cpu`` is vLLM's CPU build on this machine's kind of CPU (``vllm-cpu-avx512bf16`` where it has
    AVX512-BF16, ``vllm-cpu-avx2`` on any other x86 CPU), under the name ``vllm-cpu``; name the variant
    when the engine runs on another kind of CPU than the trainer.
    """
    if isinstance(engine, str) and engine in HOST_RESOLVED:
        return HOST_RESOLVED[engine]()
    try:
        return PROFILES[engine]
    except (KeyError, TypeError):
        raise ValueError(f"unknown engine {engine!r}; known engines: {', '.join(ENGINES + CPU_VARIANTS)}") from None


def check_regions(regions: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``regions`` as a tuple, in canonical order; ``ValueError`` on an unknown or repeated name."""
    if isinstance(regions, str):
        raise ValueError(f"regions must be a list of region names, not the string {regions!r}")
    regions = tuple(regions)
    unknown = [r for r in regions if r not in REGIONS]
    if unknown:
        raise ValueError(f"unknown region(s) {unknown}; known regions: {', '.join(REGIONS)}")
    if len(set(regions)) != len(regions):
        raise ValueError(f"repeated region in {list(regions)}")
    return tuple(r for r in REGIONS if r in regions)
