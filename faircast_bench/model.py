"""``python3 -m faircast_bench --model qwen3-0.6b|qwen2.5-0.5b``: Fair Cast against plain DeepSpeed on a real
architecture, on 2 CPU ranks, ZeRO-3 and ZeRO-2, in one run.

Every configuration (plain DeepSpeed, then each mode with the shipped defaults: guard on, diagnostics
every 10 steps) is one ``deepspeed`` launch of :mod:`faircast_bench.model_worker`, so each has its
own peak RSS per rank. Launches run one after another; with ``--rounds R`` the whole sequence repeats
R times, so plain and every mode are interleaved round by round and each configuration's median
pools its rounds' timed steps. The first ``--warmup`` steps of each launch are not timed (the first
also carries the guard's full check and the diagnostics' sample selection; their cost is reported
separately). Figures: median step time and its ratio to plain, the cast's ms and share of the step,
peak RSS per rank (the larger rank) and its difference from plain, checkpoint save and load time and
size against plain, the guard's and the diagnostics' cost. The goals of issue 23 are printed as
ratios with pass/miss; nothing is asserted.

Then (``--push-modes``, default ``dither stochastic``; ``--no-push`` skips it) the engine push at this
size, one launch of :mod:`faircast_bench.push_worker` per mode: ZeRO-3 on 2 ranks into a ``vllm
serve`` process on rank 0 through the ``faircast`` backend, dense and then delta updates after real
optimizer steps at ``--push-lr``, against vLLM's own ``reload_weights`` of the same tensors (timed
inside the engine) and a memcpy floor of the same bytes.

With ``--out``, a launch whose results are already there (a run that stopped part-way) is not repeated;
a launch that fails is reported in the table and the others still run (the exit status is then 1).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from faircast_ds.casting.modes import MODES, spec
from faircast_bench.stats import bootstrap_ratio_interval, median_ratio, spread
from faircast_bench.table import columns

CONFIGS = ("plain",) + MODES
CROSS_HOST = ("netns", "group-netns")  # push planes whose engine runs on another host (a network namespace)
MIB = 1 << 20
# issue 23, item 4
STEP_GOAL = {"nearest": 1.01, "stochastic": 1.01, "dither": 1.01, "error_feedback": 1.03}
RSS_SLACK_MIB = 64
SAVE_GOAL = 1.1
DELTA_GOAL = {"dither": 0.25}  # mode -> its delta push / a dense push
RELOAD_GOAL = 1.5  # a dense push / vLLM's own reload of the same tensors
VERIFY_GOAL = 0.5  # verification / the push it checks
PUSH_MODES = ("dither", "stochastic")
PUSH_LR = 1e-6


@dataclass
class Figures:
    """One (stage, configuration), pooled over rounds."""

    stage: int
    config: str
    step_s: float  # median of the timed steps
    cast_ms: float
    guard_first_ms: float  # the first step's guard (the full check)
    guard_ms: float  # median over the timed steps (sampled checks)
    diagnostics_first_ms: float  # the first step's observer (sample selection included)
    diagnostics_ms: float
    peak_mib: float  # the larger rank's peak RSS while training (before the checkpoint)
    peak_all_mib: float  # ... including the checkpoint save and load
    save_s: float
    load_s: float
    checkpoint_bytes: int
    shard_elements: int | None
    params: int
    round_steps: list[list[float]] = field(default_factory=list)  # per round: the timed steps (the slower rank)
    round_cast: list[list[float]] = field(default_factory=list)  # per round: the cast's seconds in those steps
    round_peaks: list[float] = field(default_factory=list)  # per round: the larger rank's training peak RSS
    # per timed step, the busier rank's: CPU seconds (user + system, all threads) and minor page faults;
    # None from a worker that did not record them. A core taken by other work is not counted in CPU seconds.
    cpu_s: float | None = None
    minor_faults: float | None = None
    round_cpu: list[list[float]] = field(default_factory=list)  # per round: the timed steps' CPU seconds


def _launch(stem: str, model: str, layers: int, stage: int, config: str, warmup: int, steps: int,
            log: str) -> None:
    from faircast_bench import model_worker as bench_model_worker

    _deepspeed(bench_model_worker.__name__, [stem, model, str(layers), str(stage), config, str(warmup), str(steps)],
               log, f"{config} ZeRO-{stage}")


# the push plane whose result files and column labels carry no plane's name: the TCP route's, which they
# predate and which is gone (a result file of today always names its plane; what a plane does is the push
# worker's and ServedPush's business, never this module's)
UNNAMED_PLANE = "tcp"
DEFAULT_PLANE = "shm"


def _launch_push(stem: str, model: str, layers: int, mode: str, lr: float, log: str, plane: str = DEFAULT_PLANE) -> None:
    """One push launch. ``plane="netns"`` (or ``"group-netns"``): two hosts on this machine (network
    namespaces joined by a veth pair, :mod:`faircast_bench.hosts`): the ranks run on one, ``vllm
    serve`` on the other (the worker reads where from ``ENGINE_NETNS``/``ENGINE_HOST``), and the push
    crosses the veth on the net plane (or the group plane). The namespaces are removed afterwards,
    whatever happened."""
    from faircast_bench import push_worker as bench_push_worker

    args, what = [stem, model, str(layers), mode, repr(lr), plane], f"push {mode} ({plane})"
    if plane not in CROSS_HOST:
        _deepspeed(bench_push_worker.__name__, args, log, what)
        return
    from faircast_bench.hosts import TwoHosts, available

    if not available():
        raise LaunchFailed(f"{what}: the cross-host row needs network namespaces (root and iproute2)")
    with TwoHosts() as hosts:
        engine, ranks = hosts.HOSTS
        _deepspeed(bench_push_worker.__name__, args, log, what, prefix=["ip", "netns", "exec", hosts.netns[ranks]],
                   env={bench_push_worker.ENGINE_NETNS: hosts.netns[engine],
                        bench_push_worker.ENGINE_HOST: hosts.addr[engine]})


def launch_env() -> tuple[dict[str, str], str]:
    """The environment and working directory of a benchmark launch: the clone this faircast_bench sits in,
    first on the path, so the workers import its faircast_bench and faircast_ds (a package folder of the
    clone, such as faircast_ds/tools/ with its inspect.py, would shadow the standard library as a script's
    folder)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env, root


def _deepspeed(module: str, worker_args: list[str], log: str, what: str, *, prefix: list[str] | None = None,
               env: dict[str, str] | None = None) -> None:
    """``deepspeed --num_gpus 2 --module MODULE ARGS`` (under the command ``prefix``, with ``env`` added)."""
    extra, (env, root) = env or {}, launch_env()
    env.update(extra)
    runner = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    if not os.path.exists(runner):
        runner = "deepspeed"
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # as a module, from the clone's root, which is first on the path: the workers import faircast_bench by name
    cmd = [*(prefix or []), runner, "--num_gpus", "2", "--master_port", str(port), "--module", module, *worker_args]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=root)
    for leftover in _shm_buffers(port):  # DeepSpeed's CPU all-reduce never unlinks its /dev/shm buffers
        os.unlink(leftover)
    if proc.returncode != 0:
        with open(log) as f:
            tail = f.read()[-4000:]
        raise LaunchFailed(f"{what} exited {proc.returncode}{_killed(proc.returncode)}; log {log}:\n{tail}")


class LaunchFailed(RuntimeError):
    """One launch of the benchmark did not finish (the message names it, its exit status and its log)."""


def _killed(code: int) -> str:
    # the launcher reports a worker killed by a signal as a negative status or 128+N; 9 is the OOM killer's
    return " (SIGKILL: most likely the kernel's out-of-memory killer)" if code in (-9, 137) else ""


def _shm_buffers(port: int) -> list[str]:
    try:
        return [os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm")
                if n.startswith("deepspeed_allreduce_buffer_") and f"_{port}_" in n]
    except OSError:
        return []


def _bar(done: int, total: int, label: str, started: float) -> str:
    width = 30
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label} ({time.perf_counter() - started:.0f} s)"


def figures(stage: int, config: str, runs: list[list[dict[str, Any]]]) -> Figures:
    """Pool the ranks' JSON of every round of one (stage, configuration)."""
    timed, first, round_steps, round_cast, round_cpu = [], [], [], [], []
    for ranks in runs:
        by_step = list(zip(*[r["steps"] for r in ranks]))
        warm = ranks[0]["warmup"]
        first.append(by_step[0])
        this_round = []
        for per_rank in by_step[warm:]:
            this_round.append({k: max(r[k] for r in per_rank) for k in ("seconds", "cast_s", "guard_s", "diagnostics_s")})
            for k in ("cpu_s", "minor_faults"):
                this_round[-1][k] = max(r[k] for r in per_rank) if all(k in r for r in per_rank) else None
        timed += this_round
        round_steps.append([t["seconds"] for t in this_round])
        round_cast.append([t["cast_s"] for t in this_round])
        round_cpu.append([t["cpu_s"] for t in this_round])
    med = lambda k: statistics.median(t[k] for t in timed)  # noqa: E731
    usage = lambda k: med(k) if timed and all(t[k] is not None for t in timed) else None  # noqa: E731
    flat = [r for ranks in runs for r in ranks]
    return Figures(stage=stage, config=config, step_s=med("seconds"), cast_ms=1e3 * med("cast_s"),
                   guard_first_ms=1e3 * statistics.median(max(r["guard_s"] for r in f) for f in first),
                   guard_ms=1e3 * med("guard_s"),
                   diagnostics_first_ms=1e3 * statistics.median(max(r["diagnostics_s"] for r in f) for f in first),
                   diagnostics_ms=1e3 * med("diagnostics_s"),
                   peak_mib=statistics.median(max(r["train_peak_mib"] for r in ranks) for ranks in runs),
                   peak_all_mib=statistics.median(max(r["peak_mib"] for r in ranks) for ranks in runs),
                   save_s=statistics.median(max(r["save_s"] for r in ranks) for ranks in runs),
                   load_s=statistics.median(max(r["load_s"] for r in ranks) for ranks in runs),
                   checkpoint_bytes=max(r["checkpoint_bytes"] for r in flat),
                   shard_elements=max((r["shard_elements"] or 0) for r in flat) or None,
                   params=flat[0]["params"], round_steps=round_steps, round_cast=round_cast,
                   round_peaks=[max(r["train_peak_mib"] for r in ranks) for ranks in runs],
                   cpu_s=usage("cpu_s"), minor_faults=usage("minor_faults"),
                   round_cpu=round_cpu if all(c is not None for r in round_cpu for c in r) else [])


def _verdict(ok: bool) -> str:
    return "pass" if ok else "MISS"


def format_table(rows: list[Figures], *, model: str, layers: int, rounds: int, steps: int, command: str) -> str:

    lines = [("ZeRO", "config", "step s", "x plain", "step goal", "cast ms", "cast share", "peak RSS MiB",
              "+MiB vs plain", "RSS goal", "save s", "x plain", "save goal", "load s", "x plain", "ckpt MiB",
              "x plain", "guard ms first/later", "diag ms first/later")]
    for r in rows:
        plain = next((p for p in rows if p.stage == r.stage and p.config == "plain"), None)
        if plain is None:  # plain DeepSpeed's launch failed: no ratios for this stage
            lines.append((str(r.stage), r.config, f"{r.step_s:.2f}", "-", "-", f"{r.cast_ms:.0f}",
                          f"{100 * r.cast_ms / 1e3 / r.step_s:.1f}%", f"{r.peak_mib:.0f}", "-", "-",
                          f"{r.save_s:.1f}", "-", "-", f"{r.load_s:.1f}", "-", f"{r.checkpoint_bytes / MIB:.0f}", "-",
                          f"{r.guard_first_ms:.0f}/{r.guard_ms:.0f}",
                          f"{r.diagnostics_first_ms:.0f}/{r.diagnostics_ms:.0f}"))
            continue
        step_x, save_x, load_x = r.step_s / plain.step_s, r.save_s / plain.save_s, r.load_s / plain.load_s
        extra = r.peak_mib - plain.peak_mib
        if r.config == "plain":
            goals = ("-", "-", "-")
        else:
            residual_bytes = 4 * (r.shard_elements or 0) if spec(r.config).residual else 0  # per rank
            allowance = RSS_SLACK_MIB + residual_bytes / MIB
            residual = residual_bytes * 2  # both ranks' files
            save_goal = SAVE_GOAL * (1 + residual / max(plain.checkpoint_bytes, 1))
            goals = (f"<={STEP_GOAL[r.config]} {_verdict(step_x <= STEP_GOAL[r.config])}",
                     f"<=+{allowance:.0f} {_verdict(extra <= allowance)}",
                     f"<={save_goal:.2f} {_verdict(save_x <= save_goal)}")
        lines.append((str(r.stage), r.config, f"{r.step_s:.2f}", f"{step_x:.3f}", goals[0], f"{r.cast_ms:.0f}",
                      f"{100 * r.cast_ms / 1e3 / r.step_s:.1f}%", f"{r.peak_mib:.0f}",
                      "-" if r.config == "plain" else f"{extra:+.0f}", goals[1], f"{r.save_s:.1f}", f"{save_x:.2f}",
                      goals[2], f"{r.load_s:.1f}", f"{load_x:.2f}", f"{r.checkpoint_bytes / MIB:.0f}",
                      f"{r.checkpoint_bytes / max(plain.checkpoint_bytes, 1):.3f}",
                      f"{r.guard_first_ms:.0f}/{r.guard_ms:.0f}", f"{r.diagnostics_first_ms:.0f}/{r.diagnostics_ms:.0f}"))
    params = rows[0].params if rows else 0
    shard = max((r.shard_elements or 0) for r in rows) if rows else 0
    head = [f"python3 -m faircast_bench --model {model}: {layers} layers, {params:,} parameters, 2 CPU ranks "
            f"(largest shard {shard:,} elements); {rounds} round(s) x {steps} timed steps per configuration",
            f"command: {command}",
            "step s: median wall time of an optimizer step (forward, backward, step), the slower rank; "
            "cast ms: Fair Cast's cast inside it; peak RSS: the larger rank's, while training (before the "
            "checkpoint); guard/diag ms: their time in the first step (full check, sample selection) and later "
            "steps (median)"]
    return "\n".join(head + [""] + columns(lines))


def _interval_verdict(lo: float, hi: float, goal: float) -> str:
    """pass: the whole interval is within the goal; MISS: the whole interval is above it; open: it
    straddles the goal (the data do not settle it)."""
    return "pass" if hi <= goal else ("MISS" if lo > goal else "open")


def format_settled(rows: list[Figures]) -> str:
    """Issue 33, item 4: each mode's median step ratio to plain with its bootstrap 95% interval (rounds
    resampled, paired with plain's; :mod:`faircast_bench.stats`) beside the cast's share of the same
    steps, and peak RSS as the median over rounds beside plain's own round-to-round spread."""
    lines = [("ZeRO", "config", "rounds", "steps", "step s", "x plain", "95% interval", "step goal", "cast ms",
              "cast share", "peak RSS MiB", "+MiB vs plain", "plain spread MiB", "RSS allowance", "RSS goal",
              "with ckpt MiB", "+MiB vs plain")]
    for r in rows:
        plain = next((p for p in rows if p.stage == r.stage and p.config == "plain"), None)
        steps = sum(len(x) for x in r.round_steps)
        share = sum(map(sum, r.round_cast)) / max(sum(map(sum, r.round_steps)), 1e-12)
        peak = statistics.median(r.round_peaks) if r.round_peaks else r.peak_mib
        if plain is None or r.config == "plain" or len(plain.round_steps) != len(r.round_steps):
            plain_spread = f"{spread(r.round_peaks):.0f}" if r.config == "plain" else "-"
            lines.append((str(r.stage), r.config, str(len(r.round_steps)), str(steps), f"{r.step_s:.2f}",
                          "1.000" if r.config == "plain" else "-", "-", "-", f"{r.cast_ms:.0f}", f"{100 * share:.2f}%",
                          f"{peak:.0f}", "-", plain_spread, "-", "-", f"{r.peak_all_mib:.0f}", "-"))
            continue
        ratio = median_ratio(r.round_steps, plain.round_steps)
        lo, hi = bootstrap_ratio_interval(r.round_steps, plain.round_steps)
        goal = STEP_GOAL[r.config]
        plain_peak = statistics.median(plain.round_peaks) if plain.round_peaks else plain.peak_mib
        extra = peak - plain_peak
        allowance = RSS_SLACK_MIB + (4 * (r.shard_elements or 0) / MIB if spec(r.config).residual else 0)
        lines.append((str(r.stage), r.config, str(len(r.round_steps)), str(steps), f"{r.step_s:.2f}", f"{ratio:.3f}",
                      f"[{lo:.3f}, {hi:.3f}]", f"<={goal} {_interval_verdict(lo, hi, goal)}", f"{r.cast_ms:.0f}",
                      f"{100 * share:.2f}%", f"{peak:.0f}", f"{extra:+.0f}", f"{spread(plain.round_peaks):.0f}",
                      f"+{allowance:.0f}", _verdict(extra <= allowance), f"{r.peak_all_mib:.0f}",
                      f"{r.peak_all_mib - plain.peak_all_mib:+.0f}"))
    head = ["step time and memory: x plain = median step / plain's median step over every round's timed steps; "
            "95% interval: bootstrap over rounds (paired with plain's) and the steps inside them; step goal: pass "
            "= the interval is within the goal, MISS = above it, open = it straddles it; cast share: the cast's "
            "time in those same steps / their wall time; peak RSS: the larger rank's training peak, median over "
            "rounds; plain spread: plain's largest minus smallest peak over the rounds; with ckpt: the peak including "
            "the checkpoint save and load after the steps (median over rounds)"]
    return "\n".join(head + [""] + columns(lines))


def format_usage(rows: list[Figures]) -> str:
    """Where a step's time goes besides the cast: each configuration's CPU seconds (a core taken by other
    work is not counted) and minor page faults per timed step (medians, the busier rank), beside plain's.
    Empty when the workers did not record them."""
    if not any(r.cpu_s is not None for r in rows):
        return ""
    lines = [("ZeRO", "config", "step s", "x plain", "CPU s/step", "x plain", "95% interval", "step goal",
              "CPU / wall", "minor faults/step", "x plain")]
    for r in rows:
        plain = next((p for p in rows if p.stage == r.stage and p.config == "plain"), None)

        def ratio(mine: float | None, theirs: float | None) -> str:
            return f"{mine / theirs:.3f}" if mine is not None and theirs else "-"

        interval, verdict = "-", "-"
        if (plain is not None and r.config != "plain" and r.config in STEP_GOAL and r.round_cpu
                and len(plain.round_cpu) == len(r.round_cpu)):
            lo, hi = bootstrap_ratio_interval(r.round_cpu, plain.round_cpu)
            interval = f"[{lo:.3f}, {hi:.3f}]"
            verdict = f"<={STEP_GOAL[r.config]} {_interval_verdict(lo, hi, STEP_GOAL[r.config])}"
        lines.append((str(r.stage), r.config, f"{r.step_s:.2f}", ratio(r.step_s, plain and plain.step_s),
                      "-" if r.cpu_s is None else f"{r.cpu_s:.2f}", ratio(r.cpu_s, plain and plain.cpu_s),
                      interval, verdict, ratio(r.cpu_s, r.step_s),
                      "-" if r.minor_faults is None else f"{r.minor_faults:,.0f}",
                      ratio(r.minor_faults, plain and plain.minor_faults)))
    head = ["per timed step, the busier rank: CPU s = user + system seconds of the rank's process (all its "
            "threads; a core idle or taken by other work is not counted); 95% interval and step goal: as above, "
            "for the CPU seconds (the goal is set on wall time; this is the same question asked of a figure "
            "other load moves less); CPU / wall: how many cores the step kept busy; minor faults: pages the "
            "kernel mapped in (memory freed and touched again shows here)"]
    return "\n".join(head + [""] + columns(lines))


def run(model: str, *, layers: int | None, stages: tuple[int, ...], configs: tuple[str, ...], warmup: int,
        steps: int, rounds: int, out_dir: str | None, log=print, failures: list[str] | None = None) -> list[Figures]:
    from faircast_bench.builders import architecture

    layers = layers or architecture(model).layers
    failures = failures if failures is not None else []
    out_dir = out_dir or tempfile.mkdtemp(prefix="faircast-bench-model-")
    os.makedirs(out_dir, exist_ok=True)
    # interleaved: every round runs every configuration once, each round in another order (plain is not
    # always the first launch after the machine was idle)
    plan = [(rnd, stage, config) for rnd in range(rounds) for stage in stages
            for config in configs[rnd % len(configs):] + configs[:rnd % len(configs)]]
    started = time.perf_counter()
    results: dict[tuple[int, str], list[list[dict[str, Any]]]] = {}
    for done, (rnd, stage, config) in enumerate(plan):
        stem = os.path.join(out_dir, f"r{rnd}-z{stage}-{config}")
        ranks = _read_ranks(stem, layers, warmup, steps)
        if ranks is None:
            log(_bar(done, len(plan), f"round {rnd + 1}: ZeRO-{stage} {config}", started))
            try:
                _launch(stem, model, layers, stage, config, warmup, steps, stem + ".log")
            except LaunchFailed as exc:
                log(f"FAILED: {exc}")
                failures.append(f"ZeRO-{stage} {config} (round {rnd + 1}): {str(exc).splitlines()[0]}")
                continue
            ranks = _read_ranks(stem, layers, warmup, steps)
            if ranks is None:
                failures.append(f"ZeRO-{stage} {config} (round {rnd + 1}): no results in {stem}.rank*.json")
                continue
        else:
            log(f"ZeRO-{stage} {config} round {rnd + 1}: results already in {stem}.rank*.json, not repeated")
        results.setdefault((stage, config), []).append(ranks)
    log(_bar(len(plan), len(plan), "done", started))
    return [figures(stage, config, results[stage, config]) for stage in stages for config in configs
            if (stage, config) in results]


def run_push(model: str, *, layers: int, modes: tuple[str, ...], lr: float, out_dir: str, log=print,
             failures: list[str] | None = None, planes: tuple[str, ...] = (DEFAULT_PLANE,)) -> list[dict[str, Any]]:
    """One push launch per mode and data plane (``shm``: the one-host
    shared-memory plane; ``net``: each rank's own connection, on loopback; ``netns`` (``group-netns``: the
    group plane's sends): the same across two
    network namespaces); results already in ``out_dir`` are reused; their rank-0 JSON."""
    failures = failures if failures is not None else []
    started, out = time.perf_counter(), []
    runs = [(m, p) for m in modes for p in planes]
    for done, (mode, plane) in enumerate(runs):
        stem = os.path.join(out_dir, f"push-{mode}" + ("" if plane == UNNAMED_PLANE else f"-{plane}"))
        data = _read_push(stem, layers, lr)
        if data is None:
            log(_bar(done, len(runs), f"push into vllm serve: {mode} ({plane})", started))
            try:
                _launch_push(stem, model, layers, mode, lr, stem + ".log", plane)
            except LaunchFailed as exc:
                log(f"FAILED: {exc}")
                failures.append(f"push {mode}: {str(exc).splitlines()[0]}")
                continue
            data = _read_push(stem, layers, lr)
            if data is None:
                failures.append(f"push {mode}: no results in {stem}.json")
                continue
        else:
            log(f"push {mode}: results already in {stem}.json, not repeated")
        out.append(data)
    log(_bar(len(runs), len(runs), "pushes done", started))
    return out


def _read_push(stem: str, layers: int, lr: float) -> dict[str, Any] | None:
    try:
        with open(stem + ".json") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if data.get("layers") == layers and data.get("lr") == lr and len(data.get("pushes", ())) >= 6 else None


def _verify_s(row: dict[str, Any]) -> float:
    """A push's verification seconds: the trainer's own (a route that compares on its side), else the
    engine's check inside its finish call (every plane)."""
    return row.get("verify_seconds") or (row.get("engine") or {}).get("check_seconds") or 0.0


def _label(data: dict[str, Any]) -> str:
    """A push result's column label: its mode, and its data plane unless unnamed (a result of the TCP route)."""
    plane = data.get("plane", UNNAMED_PLANE)
    return data["mode"] + ("" if plane == UNNAMED_PLANE else f"/{plane}")


def _deltas(pushes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The deltas among a push worker's pushes, each after one step: pushes 5, 6 and 10, 12 (results from
    before pushes named their kind: 5 and 6)."""
    return [q for q in pushes[4:] if q.get("kind", "delta") == "delta"]


def push_figures(data: dict[str, Any]) -> dict[str, Any]:
    """The push worker's pushes (dense verified whole, dense unverified, dense verified whole, dense verified
    sampled, delta, delta; then, where the worker made them, the narrower checks and the dense pushes and deltas
    after a step each: :mod:`faircast_bench.push_worker`) as the figures the table prints."""
    p = data["pushes"]
    first, bare, dense, dense_sampled = p[0], p[1], p[2], p[3]
    deltas = _deltas(p)
    stepped = [q for q in p[6:] if q.get("kind") == "dense" and q.get("steps_before")]  # dense after a step: 9, 11
    delta_s = statistics.median(d["seconds"] for d in deltas)
    reload_s = dense["engine"].get("load_seconds") or float("nan")
    return {"mode": _label(data), "numel": dense["numel"], "params_total": dense["params_total"],
            "first_s": first["seconds"], "dense_s": dense["seconds"], "bare_dense_s": bare["seconds"],
            "dense_sampled_s": dense_sampled["seconds"],
            "dense_sampled_reload_s": dense_sampled["engine"].get("load_seconds") or float("nan"), "dense_sampled_verify_s": _verify_s(dense_sampled),
            "checks": [q.get("check") for q in p],
            "dense_bytes": dense["bytes"], "dense_gathers": dense["gathers"], "dense_verify_s": _verify_s(dense),
            "reload_s": reload_s, "bare_reload_s": bare["engine"].get("load_seconds") or float("nan"),
            "receive_s": dense["engine"].get("receive_seconds") or float("nan"),
            "delta_s": delta_s, "delta_changed": [d["changed"] / d["numel"] for d in deltas],
            "delta_bytes": [d["bytes"] for d in deltas], "delta_gathers": [d["gathers"] for d in deltas],
            "delta_params": [d["params"] for d in deltas],
            "delta_verify_s": statistics.median(_verify_s(d) for d in deltas),
            "delta_reload_s": statistics.median(d["engine"].get("load_seconds") or 0.0 for d in deltas),
            "stepped_dense_s": statistics.median(q["seconds"] for q in stepped) if stepped else None,
            "stepped_reload_s": statistics.median(q["engine"].get("load_seconds") or 0.0 for q in stepped)
            if stepped else None,
            "memcpy_s": data["memcpy_s"], "server_start_s": data.get("server_start_s"), "export_s": data.get("export_s")}


def format_push_table(pushes: list[dict[str, Any]], *, model: str, layers: int, lr: float) -> str:
    lines = [("mode", "update", "check", "changed", "MiB sent", "gathers", "push s", "x dense", "delta goal",
              "vLLM reload s", "push x reload", "reload goal", "verify s", "verify x push", "verify goal",
              "x memcpy")]
    figures = [push_figures(data) for data in pushes]
    for f in figures:
        bare = f["bare_dense_s"]
        for label, check, push_s, reload_s in (("dense", "whole", f["dense_s"], f["reload_s"]),
                                               ("dense", "sampled", f["dense_sampled_s"], f["dense_sampled_reload_s"])):
            cost = push_s - bare  # the verified dense push against the same push unverified
            ratio = push_s / reload_s
            goal = f"<={RELOAD_GOAL} {_verdict(ratio <= RELOAD_GOAL)}" if check == "sampled" else "-"
            lines.append((f["mode"], label, check, "100%", f"{f['dense_bytes'] / MIB:.0f}", str(f["dense_gathers"]),
                          f"{push_s:.2f}", f"{push_s / f['dense_sampled_s']:.3f}", "-", f"{reload_s:.2f}",
                          f"{ratio:.2f}", goal, f"{cost:.2f}", f"{cost / bare:.2f}",
                          f"<={VERIFY_GOAL} {_verdict(cost <= VERIFY_GOAL * bare)}", f"{push_s / f['memcpy_s']:.0f}"))
        lines.append((f["mode"], "dense", "none", "100%", f"{f['dense_bytes'] / MIB:.0f}", str(f["dense_gathers"]),
                      f"{bare:.2f}", f"{bare / f['dense_sampled_s']:.3f}", "-", f"{f['bare_reload_s']:.2f}",
                      f"{bare / f['bare_reload_s']:.2f}", "-", "-", "-", "-", f"{bare / f['memcpy_s']:.0f}"))
        if f["stepped_dense_s"] is not None:
            s_x = f["stepped_dense_s"] / f["stepped_reload_s"]
            lines.append((f["mode"], "dense after a step", "sampled", "100%", f"{f['dense_bytes'] / MIB:.0f}",
                          str(f["dense_gathers"]), f"{f['stepped_dense_s']:.2f}",
                          f"{f['stepped_dense_s'] / f['dense_sampled_s']:.3f}", "-", f"{f['stepped_reload_s']:.2f}",
                          f"{s_x:.2f}", f"<={RELOAD_GOAL} {_verdict(s_x <= RELOAD_GOAL)}", "-", "-", "-",
                          f"{f['stepped_dense_s'] / f['memcpy_s']:.0f}"))
        delta_x = f["delta_s"] / f["dense_sampled_s"]
        mode = f["mode"].split("/")[0]  # a plane's rows are labelled "MODE/PLANE"
        goal = f"<={DELTA_GOAL[mode]} {_verdict(delta_x <= DELTA_GOAL[mode])}" if mode in DELTA_GOAL else "-"
        unchecked = f["delta_s"] - f["delta_verify_s"]
        lines.append((f["mode"], "delta after a step", "sampled", "/".join(f"{c:.2%}" for c in f["delta_changed"]),
                      "/".join(f"{b / MIB:.0f}" for b in f["delta_bytes"]),
                      "/".join(str(g) for g in f["delta_gathers"]), f"{f['delta_s']:.2f}", f"{delta_x:.3f}", goal,
                      f"{f['delta_reload_s']:.2f}", "-", "-", f"{f['delta_verify_s']:.2f}",
                      f"{f['delta_verify_s'] / unchecked:.2f}",
                      f"<={VERIFY_GOAL} {_verdict(f['delta_verify_s'] <= VERIFY_GOAL * unchecked)}",
                      f"{f['delta_s'] / f['memcpy_s']:.0f}"))
    head = [f"engine push at this size: ZeRO-3, 2 ranks, into `vllm serve` (faircast backend, verified through "
            f"the engine's finish, its kernels read back); deltas after one optimizer step each at lr {lr:g}",
            "push s: the trainer's whole push (walk, channel, engine load, verification); x dense: against the "
            "dense push with the default (sampled) check; vLLM reload s: inside the engine, vLLM's own "
            "reload_weights of the tensors the update loaded (a delta's: the engine's whole load, with the elements "
            "its change lists named written in place where the kernels read them live); check: whole = every element read back through "
            "the kernels, sampled = vectors whole, the embedding's sampled rows, 64 input columns of every matrix "
            "and, on the net plane, the rows and columns a delta's change lists touched; verify s: "
            "dense = verified minus unverified push, delta = the check after the walk (verify x push: against "
            "the rest of the push); gathers: ZeRO-3 full-parameter gathers of the walk; x memcpy: against "
            "copying the same bf16 bytes once"]
    for f in figures:
        if f["stepped_dense_s"] is not None:
            head.append(f"{f['mode']}: delta after a step / dense after a step (both medians, one optimizer step "
                        f"before each push): {f['delta_s'] / f['stepped_dense_s']:.3f}; x dense compares with the "
                        "dense push no step preceded")
    if figures:
        f = figures[0]
        head.append(f"first push (dense, the engine's first update, whole check) {f['first_s']:.2f} s; export "
                    f"{f['export_s']:.1f} s; vllm serve start {f['server_start_s']:.0f} s; memcpy floor of "
                    f"{2 * f['numel'] / MIB:.0f} MiB {1e3 * f['memcpy_s']:.0f} ms; {f['params_total']} tensors")
    return "\n".join(head + [""] + columns(lines))


def push_stages(data: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Seconds per stage (faircast_ds.export.source.Stages) of the unverified dense push, the dense push with the
    sampled check and the deltas (median), rank 0's account; ``engine.load`` is vLLM's reload inside the
    engine. Empty for results written before pushes reported their stages."""
    p = data["pushes"]
    if not all("stages" in q for q in p):
        return {}

    def of(q: dict[str, Any]) -> dict[str, float]:
        out = dict(q["stages"])
        for key, stage in (("load_seconds", "engine.load"), ("check_seconds", "engine.check"),
                           ("check_staged_seconds", "engine.check.staged"),
                           ("check_kernels_seconds", "engine.check.kernels")):
            if q.get("engine", {}).get(key) is not None:
                out[stage] = q["engine"][key]
        out["push"] = q["seconds"]
        return out

    deltas = [of(q) for q in _deltas(p)]
    names = {n for d in deltas for n in d}
    return {"dense, no check": of(p[1]), "dense, sampled check": of(p[3]),
            "delta (median)": {n: statistics.median(d.get(n, 0.0) for d in deltas) for n in names}}


def check_widths(data: dict[str, Any]) -> list[dict[str, float]]:
    """The dense pushes verified by a sampled check, one per width (input columns read per matrix): the
    default's (push 4) and the narrower ones of pushes 7 and later; empty before the worker made those."""
    p = data["pushes"]
    rows = [q for q in [p[3], *p[6:]] if q.get("check_columns") and q.get("check") == "sampled"
            and q.get("kind", "dense") == "dense" and not q.get("steps_before")]
    if len(rows) < 2:
        return []
    return [{"columns": q["check_columns"], "push_s": q["seconds"],
             "reload_s": q["engine"].get("load_seconds") or float("nan"),
             "check_s": q["engine"].get("check_seconds") or float("nan"),
             "kernels_s": q["engine"].get("check_kernels_seconds") or float("nan")} for q in rows]


def format_width_table(pushes: list[dict[str, Any]]) -> str:
    """What the width of the sampled check costs: the same dense push verified at each width, against vLLM's
    own reload in the same push, and the floor reload + kernel read-back puts under any push at that width."""
    lines = [("mode", "columns per matrix", "push s", "push x reload", "engine check s", "kernel read-back s",
              "(reload + read-back) x reload")]
    for data in pushes:
        mode = _label(data)
        for w in check_widths(data):
            lines.append((mode, str(w["columns"]), f"{w['push_s']:.2f}", f"{w['push_s'] / w['reload_s']:.2f}",
                          f"{w['check_s']:.3f}", f"{w['kernels_s']:.3f}",
                          f"{(w['reload_s'] + w['kernels_s']) / w['reload_s']:.2f}"))
    if len(lines) == 1:
        return ""
    head = ["the sampled check's width: the same dense push verified by reading back k input columns of every "
            "matrix through its kernel (vectors whole and the embedding's sampled rows at every width); the last "
            "column is what vLLM's reload and the read-back alone take, before any transfer"]
    return "\n".join(head + [""] + columns(lines))


def format_stage_table(pushes: list[dict[str, Any]]) -> str:
    """One row per stage, one column per mode and update: where a push's seconds go. Stages overlap (the
    HTTP update call waits while the trainer walks and sends), so they do not sum to the push."""
    cols = [(_label(data), label, stages)
            for data in pushes for label, stages in push_stages(data).items()]
    if not cols:
        return ""
    names = sorted({n for _, _, st in cols for n in st} - {"push"},
                   key=lambda n: -max(st.get(n, 0.0) for _, _, st in cols))
    lines = [("stage", *(f"{m} {label}" for m, label, _ in cols))]
    lines.append(("push (whole)", *(f"{st['push']:.3f}" for _, _, st in cols)))
    for n in names:
        lines.append((n, *(f"{st[n]:.3f}" if n in st else "-" for _, _, st in cols)))
    first = pushes[0]["pushes"][3]
    head = ["seconds per stage of the push, rank 0 (faircast_ds.export.source.Stages; trainer.*: the trainer's walk, "
            "encode, MAC and socket; engine.*: the engine's receiver; http.*: each HTTP round trip, whole; stages "
            f"overlap); per push {first.get('http_calls', '?')} HTTP calls and {first.get('collectives', '?')} "
            "collectives besides the walk's gathers (dense, sampled check)"]
    return "\n".join(head + [""] + columns(lines))


def _read_ranks(stem: str, layers: int, warmup: int, steps: int) -> list[dict[str, Any]] | None:
    """Both ranks' results of one launch, or None when they are not (all) there or were made with
    another depth or step count."""
    out = []
    for r in (0, 1):
        try:
            with open(f"{stem}.rank{r}.json") as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            return None
    if any(d.get("layers") != layers or d.get("warmup") != warmup or len(d.get("steps", ())) != warmup + steps
           for d in out):
        return None
    return out


def main_from_args(args) -> int:  # type: ignore[no-untyped-def]
    stages = tuple(int(s) for s in str(args.stages).split(",") if s)
    bad = [s for s in stages if s not in (2, 3)]
    if bad:
        print(f"error: --stages takes 2 and/or 3, got {bad}", file=sys.stderr)
        return 2
    configs = ("plain",) + tuple(m for m in args.modes if m != "plain")
    command = "python3 -m faircast_bench " + " ".join(sys.argv[2:] if len(sys.argv) > 2 else [])
    push_modes = () if getattr(args, "no_push", False) else tuple(getattr(args, "push_modes", None) or PUSH_MODES)
    bad = [m for m in push_modes if m not in MODES]
    if bad:
        print(f"error: --push-modes takes Fair Cast modes {list(MODES)}, got {bad}", file=sys.stderr)
        return 2
    lr = float(getattr(args, "push_lr", None) or PUSH_LR)
    from faircast_bench.builders import architecture

    layers = args.layers or architecture(args.model).layers
    out_dir = args.out or tempfile.mkdtemp(prefix="faircast-bench-model-")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    failures: list[str] = []
    rows = run(args.model, layers=args.layers, stages=stages, configs=configs, warmup=args.warmup,
               steps=args.steps, rounds=args.rounds, out_dir=out_dir, log=log, failures=failures)
    planes = tuple(getattr(args, "push_planes", None) or (DEFAULT_PLANE,))
    pushes = run_push(args.model, layers=layers, modes=push_modes, lr=lr, out_dir=out_dir, log=log,
                      failures=failures, planes=planes) if push_modes else []
    table = format_table(rows, model=args.model, layers=layers, rounds=args.rounds, steps=args.steps, command=command)
    table += "\n\n" + format_settled(rows)
    usage = format_usage(rows)
    if usage:
        table += "\n\n" + usage
    if pushes:
        table += "\n\n" + format_push_table(pushes, model=args.model, layers=layers, lr=lr)
        for extra in (format_stage_table(pushes), format_width_table(pushes)):
            if extra:
                table += "\n\n" + extra
    if failures:
        table += "\n\nFAILED (not in the tables above; logs in " + out_dir + "):\n" + "\n".join(f"- {f}" for f in failures)
    print(table)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)) or ".", exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "layers": layers, "rows": [r.__dict__ for r in rows],
                       "pushes": [push_figures(p) for p in pushes], "push_lr": lr, "failures": failures,
                       "table": table}, f, indent=1)
    return 1 if failures else 0
