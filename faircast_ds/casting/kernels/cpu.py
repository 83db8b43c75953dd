"""The fused CPU kernel (``fused_cast.cpp``): built at first use, once per machine, then cached.

The build is torch's JIT extension loader (as DeepSpeed builds its CPU ops): about 6 s with g++ on
two cores, cached under torch's extensions folder (``TORCH_EXTENSIONS_DIR`` moves it). The code is
compiled for the CPU it runs on (``-march=native``), so the cached build is named after that CPU: a
shared home folder used by two kinds of machine keeps two builds rather than one that crashes. The
name also carries a hash of the source and the flags: torch's loader decides whether to rebuild by
file times alone (ninja), and a copy or an install can leave a changed source older than the cached
object, which would then keep serving the old kernel's bits.

Bits do not depend on the flags: the hash and the rounding are integer arithmetic, and error
feedback's fp32 add and subtract are compiled without ``-ffast-math`` and with
``-ffp-contract=off``, so each rounds once, as torch's eager ops do.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import threading
from pathlib import Path
from types import ModuleType

import torch

from faircast_ds.casting.kernels.nan import torch_nan16
from faircast_ds.casting.kernels.operands import check_marks, contiguous, write_back
from faircast_ds.casting.modes import kernel_code

SOURCE = Path(__file__).with_name("fused_cast.cpp")
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp")
# -fopenmp links libgomp.so.1, the soname torch's own bundled runtime has: the loader reuses the
# one already in the process, so at::parallel_for runs on torch's threads (torch.set_num_threads).
LDFLAGS = ("-fopenmp",)


_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}
_errors: dict[str, str] = {}


class KernelUnavailable(RuntimeError):
    """The fused CPU kernel could not be built or loaded here (the reason is in the message)."""


def _cpu_tag() -> str:
    """A short id of this CPU's model and instruction set, for naming the -march=native build."""
    desc = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    desc += line
                if line.strip() == "":
                    break  # the first processor's block is enough
    except OSError:
        pass
    return hashlib.sha1(desc.encode()).hexdigest()[:10]


def build_name(arch: str) -> str:
    """The cached build's name: the arch, this CPU, and a hash of the source and the flags."""
    digest = hashlib.sha1(SOURCE.read_bytes())
    digest.update(repr((CFLAGS, LDFLAGS)).encode())
    return (f"faircast_ds_fused_cast_{arch.replace('-', '_').replace('.', '_')}_{_cpu_tag()}_"
            f"{digest.hexdigest()[:10]}")


def _build(arch: str) -> ModuleType:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise KernelUnavailable(f"no C++ compiler: {cxx!r} is not on PATH")
    if not SOURCE.exists():
        raise KernelUnavailable(f"kernel source {SOURCE} is missing from this installation")
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise KernelUnavailable("torch's extension builder needs ninja, which is not installed")
    try:
        return cpp_extension.load(
            name=build_name(arch),
            sources=[str(SOURCE)],
            extra_cflags=[*CFLAGS, f"-march={arch}"],
            extra_ldflags=list(LDFLAGS),
            verbose=os.environ.get("FAIRCAST_DS_KERNELS_VERBOSE", "") == "1",
        )
    except Exception as exc:  # a compiler error, a broken toolchain: report it, never half-load
        raise KernelUnavailable(f"building {SOURCE.name} failed: {type(exc).__name__}: {exc}") from exc


def load(arch: str = "native") -> ModuleType:
    """The compiled kernel module, built on first call; raises :class:`KernelUnavailable`.

    ``arch`` is the ``-march`` it is built for: ``native`` is what ``cast_into`` uses; the tests
    also build a narrower one (``x86-64-v3``: AVX2) to check the generic vector code."""
    module = _modules.get(arch)
    if module is not None:
        return module
    with _lock:
        if arch not in _modules and arch not in _errors:
            try:
                _modules[arch] = _build(arch)
            except KernelUnavailable as exc:
                _errors[arch] = str(exc)
        if arch in _errors:
            raise KernelUnavailable(_errors[arch])
        return _modules[arch]


def available() -> bool:
    """Whether the fused CPU kernel can run here (builds it the first time it is asked)."""
    try:
        load()
    except KernelUnavailable:
        return False
    return True


def unavailable_reason() -> str | None:
    """Why building the native kernel failed, or None."""
    return _errors.get("native")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def cast_into(out: torch.Tensor, x: torch.Tensor, mode: str, *, key: int, start: int,
              residual: torch.Tensor | None, arch: str = "native", runs=None,
              marks: torch.Tensor | None = None, mark_base: int = 0) -> tuple[int, int]:
    """Run the fused kernel on CPU tensors already checked by ``casts.cast_into``.

    Non-contiguous operands go through contiguous copies (1-D narrow views at any offset are
    contiguous and need none). ``runs`` (a ``faircast_ds.casting.runs.Runs`` covering ``x``): the elements'
    parameter indices, in place of ``start``; one call casts them all. ``marks``: change marks (a uint8
    bitmap on the CPU, :mod:`faircast_ds.casting.marks`) the kernel ORs a 1 into at bit ``mark_base + i``
    for every element ``i`` whose bits it changed. Returns (changed, nonfinite).
    """
    module = load(arch)
    pairs = [(out, x)] + ([(out, residual), (x, residual)] if residual is not None else [])
    if any(a.numel() and b.numel() and _overlap(a, b) for a, b in pairs):
        raise ValueError("cast_into: the output, the input and the residual must not share memory")
    if out.numel() == 0:
        return 0, 0
    marks_ptr = 0
    if marks is not None:
        check_marks(marks, mark_base, out.numel(), out.device)
        marks_ptr = marks.data_ptr()
    dst, src, res = contiguous(out, x, residual)
    res_ptr = res.data_ptr() if res is not None else 0
    if runs is not None:
        offsets, starts = runs.on("cpu")
        changed, nonfinite = module.cast_runs_into(
            kernel_code(mode, "cpp"), dst.data_ptr(), src.data_ptr(), res_ptr, src.numel(), offsets.data_ptr(),
            starts.data_ptr(), starts.numel(), key, torch_nan16(out.device), marks_ptr, mark_base)
    else:
        changed, nonfinite = module.cast_into(
            kernel_code(mode, "cpp"), dst.data_ptr(), src.data_ptr(), res_ptr, src.numel(), start, key,
            torch_nan16(out.device), marks_ptr, mark_base)
    write_back(out, dst, residual, res)
    return changed, nonfinite
