"""Cost of each cast against the memory floor, side by side, in one table from one run.

The floor is DeepSpeed's own cast: a round-to-nearest ``bf16.copy_(fp32)`` of the same shard
(read 4 bytes, write 2 per element). For every size and mode the table gives, as multiples of that
copy on the same tensors: the eager torch path (``cast_into`` with ``FAIRCAST_DS_KERNELS=eager``:
``casts.cast``, the counts, a copy) and the fused path (``casts.cast_into`` with the fast kernel); for stochastic
rounding also torchao's ``_fp32_to_bf16_sr`` where torchao is importable.

Times are minima over repeats after a warm-up, with the copy timed between the runs of each
mode so that both see the same machine. Only ratios are meant to be compared: absolute times
move with the machine and with whatever else runs on it (the load average is printed).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

from faircast_ds.casting.modes import (
    MODES,  # torch-free: the command line stays fast
    spec,
)
from faircast_bench.table import columns

DEFAULT_SIZES = (1 << 20, 16 << 20, 64 << 20)
GOALS = {"stochastic": 1.3, "dither": 1.3, "error_feedback": 2.5}  # fused / RN copy_
TORCHAO_GOAL = 10.0  # torchao SR / fused stochastic
TORCHAO_COUNTERPART = ("stochastic",)  # the modes torchao's SR cast is timed beside


@dataclass
class Row:
    size: int
    mode: str
    rn_ms: float
    fused_ms: float
    eager_ms: float | None = None
    torchao_ms: float | None = None

    @property
    def fused_ratio(self) -> float:
        return self.fused_ms / self.rn_ms

    @property
    def eager_ratio(self) -> float | None:
        return None if self.eager_ms is None else self.eager_ms / self.rn_ms


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    backend: str = ""
    threads: int = 0
    machine: str = ""
    load_before: str = ""
    load_after: str = ""
    build_s: float | None = None
    torchao: str = ""


def _time_ms(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


@contextlib.contextmanager
def _backend(name: str):  # type: ignore[no-untyped-def]
    from faircast_ds.casting.kernels import ENV_VAR

    before = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = name
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = before


def _torchao_sr() -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, str]:
    """torchao's SR cast, imported quietly (its import warns about CUDA-only extensions)."""
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), \
                contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            import torchao
            try:
                from torchao.optim.quant_utils import _fp32_to_bf16_sr
            except ImportError:  # older torchao
                from torchao.prototype.low_bit_optim.quant_utils import _fp32_to_bf16_sr
    except Exception as exc:
        return None, f"not importable ({type(exc).__name__})"
    return _fp32_to_bf16_sr, f"torchao {getattr(torchao, '__version__', '?')}"


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs"


def _loadavg() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def run(sizes: tuple[int, ...] = DEFAULT_SIZES, *, modes: tuple[str, ...] = MODES, repeats: int = 7,
        eager_repeats: int = 2, eager: bool = True, eager_max_size: int | None = None, torchao: bool = True,
        log: Callable[[str], None] = lambda s: None) -> Report:
    """Measure every (size, mode); see the module docstring."""
    import torch

    from faircast_ds.casting import kernels
    from faircast_ds.casting.rules import cast_into

    report = Report(threads=torch.get_num_threads(), machine=_machine(), load_before=_loadavg())
    t0 = time.perf_counter()
    report.backend = kernels.backend_for(torch.device("cpu"))  # builds the CPU kernel if needed
    report.build_s = time.perf_counter() - t0
    sr, report.torchao = _torchao_sr() if torchao else (None, "skipped")
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        x = torch.randn(n, generator=gen) * 0.02
        out = torch.empty(n, dtype=torch.bfloat16)
        residual = torch.zeros(n)
        rn_best = float("inf")
        for mode in modes:
            res = residual if spec(mode).residual else None
            kw = dict(seed=1, step=2, name="bench.w", residual=res)
            # Alternate copy and fused runs so both see the same machine state.
            fused_best = float("inf")
            out.copy_(x)
            cast_into(out, x, mode, **kw)
            for _ in range(repeats):
                rn_best = min(rn_best, _time_ms(lambda: out.copy_(x), 1, warmup=0))
                fused_best = min(fused_best, _time_ms(lambda: cast_into(out, x, mode, **kw), 1, warmup=0))
            row = Row(size=n, mode=mode, rn_ms=rn_best, fused_ms=fused_best)
            if eager and (eager_max_size is None or n <= eager_max_size):
                big = n > (4 << 20)  # the eager path takes seconds here: no warm-up, fewer repeats
                with _backend("eager"):
                    row.eager_ms = _time_ms(lambda: cast_into(out, x, mode, **kw), 1 if big else eager_repeats,
                                            warmup=0 if big else 1)
            if sr is not None and mode in TORCHAO_COUNTERPART:
                row.torchao_ms = _time_ms(lambda: out.copy_(sr(x)), min(repeats, 3))
            report.rows.append(row)
            log(f"  measured {n:>10,} {mode}")
        for row in report.rows:  # the copy's best over the whole size is every row's floor
            if row.size == n:
                row.rn_ms = rn_best
    report.load_after = _loadavg()
    return report


@dataclass
class OffloadRow:
    """CPU optimizer offload: fp32 master on the host, served bf16 on ``device``; the whole flat shard."""

    size: int
    mode: str
    device: str
    rn_ms: float  # DeepSpeed's own refresh: served.copy_(master), casting and moving in one
    staged_ms: float  # Fair Cast's route: fused CPU kernel into a staging buffer, one copy to the device
    eager_ms: float | None = None  # the route before it: eager torch cast, count, copy

    @property
    def staged_ratio(self) -> float:
        return self.staged_ms / self.rn_ms


def run_offload(sizes: tuple[int, ...] = DEFAULT_SIZES[:2], *, modes: tuple[str, ...] = MODES, repeats: int = 5,
                eager: bool = True, device: str | None = None,
                log: Callable[[str], None] = lambda s: None) -> list[OffloadRow]:
    """Time the offload route (``ShardCaster.cast_flat`` with the master on the host and the served shard
    on an accelerator) against DeepSpeed's own cross-device ``copy_``. Without an accelerator the route is
    forced on the CPU (``force_staging``), which times the same code with a host-to-host copy."""
    import torch

    from faircast_ds.casting.bits import bf16_bits
    from faircast_ds.casting.rules import cast
    from faircast_ds.config.section import FairCastConfig
    from faircast_ds.shard.caster import ShardCaster, ShardSlice

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_host = device == "cpu"
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed(fn: Callable[[], object], n: int) -> float:
        def run_once() -> object:
            out = fn()
            sync()
            return out
        return _time_ms(run_once, n)

    rows = []
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        master = torch.randn(n, generator=gen) * 0.02
        if not on_host:
            master = master.pin_memory()
        served = torch.empty(n, dtype=torch.bfloat16, device=device)
        served.copy_(master)
        slices = [ShardSlice("bench.w", 0, n, 0)]
        for mode in modes:
            caster = ShardCaster(FairCastConfig(mode=mode, seed=1), force_staging=on_host)
            caster.begin_step()
            rn = timed(lambda: served.copy_(master), repeats)
            staged = timed(lambda: caster.cast_flat("bench", master, served, slices), repeats)
            row = OffloadRow(size=n, mode=mode, device=device + (" (staging forced)" if on_host else ""),
                             rn_ms=rn, staged_ms=staged)
            if eager:
                residual = torch.zeros(n) if spec(mode).residual else None

                def eager_route() -> None:  # what ShardCaster did across devices before the staged route
                    out = cast(master, mode, seed=1, step=1, name="bench.w", start=0, residual=residual)
                    moved = out.to(device)
                    int((bf16_bits(served) != bf16_bits(moved)).sum())
                    served.copy_(moved)

                row.eager_ms = timed(eager_route, 1 if n > (4 << 20) else 2)
            rows.append(row)
            log(f"  measured offload {n:>10,} {mode}")
    return rows


def format_offload(rows: list[OffloadRow]) -> str:
    head = ("size", "mode", "device", "RN copy_ ms", "staged ms", "staged/RN", "eager route ms", "eager/staged")
    lines = [head]
    for r in rows:
        lines.append((_size(r.size), r.mode, r.device, _fmt(r.rn_ms), _fmt(r.staged_ms), _fmt(r.staged_ratio, "x"),
                      _fmt(r.eager_ms), "-" if r.eager_ms is None else _fmt(r.eager_ms / r.staged_ms, "x")))
    table = columns(lines)
    return "\n".join(["CPU optimizer offload (fp32 master on the host, served bf16 on the device): Fair Cast's "
                      "staged route (fused CPU kernel into a pinned staging buffer, one copy to the device) against "
                      "DeepSpeed's own served.copy_(master) and the eager route it replaces", ""] + table)


def _fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:.3g}{unit}" if v < 100 else f"{v:.0f}{unit}"


def _size(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n:,}"


def format_report(report: Report) -> str:
    import torch

    head = ("size", "mode", "RN copy_ ms", "eager ms", "eager/RN", "fused ms", "fused/RN", "goal",
            "torchao SR ms", "torchao/fused")
    lines = [head]
    for r in report.rows:
        goal = GOALS.get(r.mode)
        verdict = "-" if goal is None else f"<={goal} {'ok' if r.fused_ratio <= goal else 'MISSED'}"
        tao = None if r.torchao_ms is None else r.torchao_ms / r.fused_ms
        lines.append((_size(r.size), r.mode, _fmt(r.rn_ms), _fmt(r.eager_ms), _fmt(r.eager_ratio, "x"),
                      _fmt(r.fused_ms), _fmt(r.fused_ratio, "x"), verdict, _fmt(r.torchao_ms),
                      "-" if tao is None else f"{tao:.1f}x {'ok' if tao >= TORCHAO_GOAL else 'MISSED'}"))
    table = columns(lines)
    build = "" if report.build_s is None else f", kernel ready in {report.build_s:.1f} s"
    header = [f"faircast-ds cast benchmark: {report.machine}; torch {torch.__version__}, {report.threads} threads",
              f"fused backend: {report.backend}{build}; torchao: {report.torchao}; "
              f"load average before/after: {report.load_before} / {report.load_after}",
              "ratios are against a round-to-nearest bf16.copy_(fp32) of the same tensor (the memory floor); "
              "min of repeats"]
    try:
        busy = os.getloadavg()[0] > 0.5 and report.threads > 1
    except OSError:
        busy = False
    if busy:
        header.append(f"note: other processes were running (load {report.load_before}); with {report.threads} "
                      "threads every parallel region waits for a time slice, so small sizes are noisy "
                      "(--threads 1 measures one core alone)")
    return "\n".join(header + [""] + table)


def to_json(report: Report) -> dict:
    import torch

    data = asdict(report)
    data["torch"] = torch.__version__
    for row, r in zip(data["rows"], report.rows):
        row["fused_ratio"] = r.fused_ratio
        row["eager_ratio"] = r.eager_ratio
    return data


def main(argv: list[str] | None = None) -> int:
    """``python3 -m faircast_bench`` (faircast_bench/__main__.py)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python3 -m faircast_bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


def add_arguments(parser) -> None:  # type: ignore[no-untyped-def]
    parser.add_argument("--quick", action="store_true", help="skip the 64M size (about 30 s instead of ~2 min)")
    parser.add_argument("--sizes", type=int, nargs="+", help="element counts to measure (overrides the default)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats of the copy and the fused path")
    parser.add_argument("--no-eager", action="store_true", help="skip the (slow) eager torch path")
    parser.add_argument("--no-torchao", action="store_true", help="skip torchao's SR even if importable")
    parser.add_argument("--threads", type=int, help="torch intra-op threads for every path (default: torch's)")
    parser.add_argument("--json", metavar="PATH", help="also write the measurements as JSON")
    model = parser.add_argument_group("a real model through DeepSpeed (faircast_bench.model; 2 CPU ranks)")
    model.add_argument("--model", choices=("qwen3-0.6b", "qwen2.5-0.5b"),
                       help="benchmark plain DeepSpeed and each mode on this architecture instead of the casts alone")
    model.add_argument("--layers", type=int, help="cut the depth to N layers (vocabulary and widths stay real)")
    model.add_argument("--stages", default="3,2", help="ZeRO stages, comma-separated (default 3,2)")
    model.add_argument("--steps", type=int, default=3, help="timed optimizer steps per configuration")
    model.add_argument("--warmup", type=int, default=1, help="untimed steps first (the first carries the guard's "
                                                             "full check)")
    model.add_argument("--rounds", type=int, default=1, help="repeat every configuration this many times, "
                                                             "interleaved")
    model.add_argument("--out", help="folder for the launches' logs and JSON (default: a temporary one); "
                                     "launches whose results are already there are not repeated")
    model.add_argument("--push-modes", nargs="+", choices=MODES, default=None,
                       help="modes whose ZeRO-3 push into `vllm serve` is measured (default: dither stochastic)")
    model.add_argument("--push-planes", nargs="+", choices=("shm", "net", "netns", "group", "group-netns"),
                       default=None,
                       help="the push's data planes: shm (one host, shared memory: each rank writes its own "
                            "slices; the default), net (each rank sends its own "
                            "slices on its own connection; loopback here), netns (the net plane across hosts: "
                            "`vllm serve` in one network namespace, the trainer ranks in another, over a "
                            "veth pair; needs root and iproute2), group (each rank's slices by sends in a gloo "
                            "process group with the engine, loopback here; no MAC over the bytes), group-netns "
                            "(the group plane across the namespaces)")
    model.add_argument("--push-lr", type=float, default=None,
                       help="AdamW learning rate of the steps between delta pushes (default 1e-6)")
    model.add_argument("--no-push", action="store_true", help="skip the engine push")
    parser.add_argument("--offload", action="store_true",
                        help="also time the CPU-offload route (master on the host, served on the accelerator; "
                             "forced on the CPU without one), 1M and 16M elements")


def run_cli(args) -> int:  # type: ignore[no-untyped-def]
    import sys

    if getattr(args, "model", None):
        from faircast_bench import model as bench_model

        return bench_model.main_from_args(args)
    sizes = tuple(args.sizes) if args.sizes else (DEFAULT_SIZES[:2] if args.quick else DEFAULT_SIZES)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report = run(sizes, modes=tuple(args.modes), repeats=args.repeats, eager=not args.no_eager,
                 torchao=not args.no_torchao, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_report(report))
    offload = []
    if getattr(args, "offload", False):
        offload = run_offload(tuple(args.sizes) if args.sizes else DEFAULT_SIZES[:2], modes=tuple(args.modes),
                              eager=not args.no_eager, log=lambda s: print(s, file=sys.stderr, flush=True))
        print()
        print(format_offload(offload))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        data = to_json(report)
        if offload:
            data["offload"] = [dict(asdict(r), staged_ratio=r.staged_ratio) for r in offload]
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
    return 0
