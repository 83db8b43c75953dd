"""python3 -m faircast_bench --model: the pooling of the ranks' figures and the goal verdicts, on figures made
up here (the launches themselves are what `python3 -m faircast_bench --model ... --layers 2` runs)."""
from __future__ import annotations

import pytest

from faircast_bench.model import figures, format_table


def _rank(config: str, seconds: list[float], cast: float, peak: float, save: float, size: int,
          shard: int | None = 1000 * 1024 * 1024) -> dict:
    return {"config": config, "warmup": 1, "params": 187_045_376, "shard_elements": shard,
            "steps": [{"step": i + 1, "seconds": s, "cast_s": cast, "guard_s": 0.5 if i == 0 else 0.01,
                       "diagnostics_s": 0.2 if i == 0 else 0.0} for i, s in enumerate(seconds)],
            "train_peak_mib": peak, "peak_mib": peak + 100, "save_s": save, "load_s": save / 2,
            "checkpoint_bytes": size}


def test_figures_take_the_slower_rank_and_skip_the_warmup():
    f = figures(3, "dither", [[_rank("dither", [20.0, 8.0, 9.0, 10.0], 0.05, 3000, 4.0, 100),
                               _rank("dither", [21.0, 8.5, 8.0, 12.0], 0.06, 3100, 5.0, 0)]])
    assert f.step_s == 9.0  # median of max(8, 8.5), max(9, 8), max(10, 12)
    assert f.cast_ms == pytest.approx(60.0)
    assert f.guard_first_ms == pytest.approx(500.0) and f.guard_ms == pytest.approx(10.0)
    assert f.diagnostics_first_ms == pytest.approx(200.0) and f.diagnostics_ms == 0.0
    assert (f.peak_mib, f.save_s, f.checkpoint_bytes) == (3100, 5.0, 100)


def test_table_prints_ratios_to_plain_and_the_goals():
    plain = figures(3, "plain", [[_rank("plain", [9, 10, 10, 10], 0.0, 3000, 10.0, 1000, None)] * 2])
    fine = figures(3, "stochastic", [[_rank("stochastic", [9, 10.05, 10.05, 10.05], 0.05, 3050, 10.5, 1000)] * 2])
    slow = figures(3, "dither", [[_rank("dither", [9, 10.5, 10.5, 10.5], 0.05, 3100, 12.0, 1000)] * 2])
    # error feedback may add its 4-byte residual per shard element (4,000 MiB here) + 64 MiB
    ef = figures(3, "error_feedback", [[_rank("error_feedback", [9, 10.2, 10.2, 10.2], 0.1, 7000, 10.0, 1000)] * 2])
    text = format_table([plain, fine, slow, ef], model="qwen3-0.6b", layers=2, rounds=1, steps=3, command="x")
    rows = {line.split()[1]: line for line in text.splitlines() if line.startswith("3 ")}
    assert "1.005" in rows["stochastic"] and "<=1.01 pass" in rows["stochastic"]
    assert "<=+64 pass" in rows["stochastic"] and "+50" in rows["stochastic"]
    assert "1.050" in rows["dither"] and "<=1.01 MISS" in rows["dither"] and "<=+64 MISS" in rows["dither"]
    assert "<=1.10 MISS" in rows["dither"] and "<=1.10 pass" in rows["stochastic"]
    assert "<=+4064 pass" in rows["error_feedback"] and "<=1.03 pass" in rows["error_feedback"]
    assert "187,045,376 parameters" in text


def test_stages_are_checked(capsys):
    import argparse

    from faircast_bench.model import main_from_args

    args = argparse.Namespace(stages="3,1", modes=["dither"])
    assert main_from_args(args) == 2
    assert "--stages takes 2 and/or 3" in capsys.readouterr().err


def _push(mode: str, dense: float, bare: float, reload: float, delta: float, verify: float) -> dict:
    def row(version, kind, seconds, changed, load, verify_s, gathers):
        return {"version": version, "kind": kind, "params": gathers, "params_total": 311, "changed": changed,
                "numel": 1000, "elements": changed, "bytes": 2 * changed, "seconds": seconds, "gathers": gathers,
                "verify_seconds": verify_s, "verified": True, "engine": {"load_seconds": load, "receive_seconds": 1}}
    return {"mode": mode, "layers": 28, "lr": 1e-6, "memcpy_s": 0.1, "export_s": 5.0, "server_start_s": 60.0,
            "pushes": [row(0, "dense", 2 * dense, 1000, reload, 1.0, 311), row(1, "dense", bare, 1000, reload, 0, 311),
                       row(2, "dense", 3 * bare, 1000, reload, 1.0, 311), row(3, "dense", dense, 1000, reload, 1.0, 311),
                       row(4, "delta", delta, 7, 0.1, verify, 200), row(5, "delta", delta, 9, 0.1, verify, 210)]}


def test_push_table_prints_the_push_goals():
    from faircast_bench.model import format_push_table

    good = _push("dither", dense=6.0, bare=5.0, reload=5.0, delta=1.0, verify=0.2)
    bad = _push("stochastic", dense=12.0, bare=6.0, reload=4.0, delta=9.0, verify=6.0)
    text = format_push_table([good, bad], model="qwen3-0.6b", layers=28, lr=1e-6)
    rows = [line for line in text.splitlines() if line.startswith(("dither", "stochastic"))]
    whole_ok, dense_ok, _, delta_ok, _, dense_bad, _, delta_bad = rows
    assert "whole" in whole_ok and "<=0.5 MISS" in whole_ok and "2.00" in whole_ok  # (15 - 5) / 5
    assert "sampled" in dense_ok and "<=1.5 pass" in dense_ok and "1.20" in dense_ok  # 6.0 / 5.0
    assert "<=0.5 pass" in dense_ok and "0.20" in dense_ok  # (6 - 5) / 5
    assert "<=0.25 pass" in delta_ok and "0.167" in delta_ok and "0.70%/0.90%" in delta_ok and "200/210" in delta_ok
    assert delta_ok.split()[-5:-1] == ["0.20", "0.25", "<=0.5", "pass"]  # 0.2 / (1.0 - 0.2)
    assert "<=1.5 MISS" in dense_bad and "3.00" in dense_bad  # 12 / 4
    assert "<=0.5 MISS" in dense_bad  # (12 - 6) / 6 = 1.0
    assert "<=0.5 MISS" in delta_bad  # 6 / (9 - 6)
    assert "<=0.25" not in delta_bad  # the delta goal is dither's


def test_width_table_prints_each_sampled_check_beside_the_reload_and_its_floor():
    """Pushes 7 and 8 (32 and 16 columns) join the default's push 4 in their own table; the deltas are still
    pushes 5 and 6 only, and results from before the narrower pushes print no width table."""
    from faircast_bench.model import format_width_table, push_figures

    data = _push("dither", dense=6.0, bare=5.0, reload=5.0, delta=1.0, verify=0.2)
    assert format_width_table([data]) == ""  # six pushes: no widths measured
    for q in data["pushes"]:
        q["check"], q["check_columns"] = "sampled", 64
    data["pushes"][3]["engine"].update(check_seconds=0.5, check_kernels_seconds=0.4)
    for version, (columns, seconds, kernels) in enumerate(((32, 5.6, 0.2), (16, 5.3, 0.1)), start=6):
        data["pushes"].append({"version": version, "kind": "dense", "seconds": seconds, "check": "sampled",
                               "check_columns": columns, "engine": {"load_seconds": 4.0, "check_seconds": kernels + 0.1,
                                                                    "check_kernels_seconds": kernels}})
    rows = [line.split() for line in format_width_table([data]).splitlines() if line.startswith("dither")]
    assert rows == [["dither", "64", "6.00", "1.20", "0.500", "0.400", "1.08"],  # (5.0 + 0.4) / 5.0
                    ["dither", "32", "5.60", "1.40", "0.300", "0.200", "1.05"],
                    ["dither", "16", "5.30", "1.32", "0.200", "0.100", "1.02"]]  # 5.3 / 4.0; (4.0 + 0.1) / 4.0
    assert push_figures(data)["delta_s"] == 1.0 and push_figures(data)["delta_changed"] == [0.007, 0.009]


def test_deltas_are_also_compared_with_dense_pushes_after_a_step():
    """Pushes 9-12 (a step before each): their dense pushes get their own row against their own reload, their
    deltas join the delta median, and the header gives delta / dense-after-a-step; none of them is a width."""
    from faircast_bench.model import format_push_table, format_width_table, push_figures

    data = _push("dither", dense=6.0, bare=5.0, reload=5.0, delta=4.0, verify=0.2)
    for version, (kind, seconds, load) in enumerate((("dense", 16.0, 9.0), ("dense", 12.0, 8.0)), start=6):
        data["pushes"].append({"version": version, "kind": kind, "seconds": seconds, "check": "sampled",
                               "check_columns": 64, "steps_before": 0, "engine": {"load_seconds": load}})
    for version, (kind, seconds, load) in enumerate((("dense", 7.0, 5.0), ("delta", 5.0, 1.0), ("dense", 9.0, 7.0),
                                                     ("delta", 4.5, 1.0)), start=8):
        data["pushes"].append({"version": version, "kind": kind, "seconds": seconds, "check": "sampled",
                               "check_columns": 64, "steps_before": 1, "changed": 10, "numel": 1000,
                               "bytes": 20, "gathers": 0, "params": 5, "verify_seconds": 0.5,
                               "engine": {"load_seconds": load}})
    f = push_figures(data)
    assert f["stepped_dense_s"] == 8.0 and f["stepped_reload_s"] == 6.0  # medians of 7, 9 and 5, 7
    assert f["delta_s"] == 4.25  # median of 4, 4, 5, 4.5
    text = format_push_table([data], model="qwen3-0.6b", layers=28, lr=1e-6)
    row = next(line.split() for line in text.splitlines() if line.startswith("dither ") and "dense after a step" in line)
    assert row[5:] == ["sampled", "100%", "0", "311", "8.00", "1.333", "-", "6.00", "1.33", "<=1.5", "pass", "-", "-",
                       "-", "80"]  # 8 / 6 (dense sampled push 4); 8 / 6 reload; 8 / 0.1 memcpy
    assert "delta after a step / dense after a step (both medians, one optimizer step before each push): 0.531" in text
    widths = [line.split()[1] for line in format_width_table([data]).splitlines() if line.startswith("dither")]
    assert widths == ["64", "64"]  # pushes 7, 8 (no step before them; push 4 here names no width)


def test_a_stopped_run_is_resumed_and_a_failed_launch_is_reported(tmp_path, monkeypatch):
    import json

    from faircast_bench import model as bench_model

    def write(stem, config, layers=28):
        for r in (0, 1):
            d = _rank(config, [9, 10, 10, 10], 0.05, 3000, 10.0, 1000)
            d.update(layers=layers)
            (tmp_path / f"{stem}.rank{r}.json").write_text(json.dumps(d))

    write("r0-z3-plain", "plain")
    write("r0-z3-dither", "dither", layers=2)  # another depth: not reused
    launched = []

    def launch(stem, model, layers, stage, config, warmup, steps, log):
        launched.append(config)
        if config == "stochastic":
            raise bench_model.LaunchFailed("stochastic ZeRO-3 exited -9 (SIGKILL: ...)")
        write(stem.rsplit("/", 1)[1], config)

    monkeypatch.setattr(bench_model, "_launch", launch)
    failures: list[str] = []
    rows = bench_model.run("qwen3-0.6b", layers=28, stages=(3,), configs=("plain", "stochastic", "dither"),
                           warmup=1, steps=3, rounds=1, out_dir=str(tmp_path), log=lambda s: None, failures=failures)
    assert launched == ["stochastic", "dither"]  # plain's results were there
    assert [r.config for r in rows] == ["plain", "dither"]
    assert len(failures) == 1 and "stochastic" in failures[0] and "-9" in failures[0]


# ---- issue 33, item 4: the step ratio with its interval, the cast's share, RSS over rounds ------------------

def test_a_constant_slowdown_has_a_point_interval_that_misses_the_goal():
    from faircast_bench.stats import bootstrap_ratio_interval, median_ratio

    plain = [[10.0, 10.0, 10.0]] * 6
    mode = [[10.5, 10.5, 10.5]] * 6
    assert median_ratio(mode, plain) == pytest.approx(1.05)
    assert bootstrap_ratio_interval(mode, plain) == (pytest.approx(1.05), pytest.approx(1.05))


def test_round_drift_cancels_in_the_paired_interval():
    """Plain's own median moves by half between rounds (a shared machine); the mode is 0.5% slower
    than plain in every round. The interval stays inside 1.01 (pairs by round), while the drift is 50x
    the difference being measured."""
    from faircast_bench.stats import bootstrap_ratio_interval, median_ratio

    drift = [8.5, 12.4, 9.0, 11.8, 8.7, 12.0]
    jitter = [0.999, 1.0, 1.001]
    plain = [[d * j for j in jitter] for d in drift]
    mode = [[1.005 * d * j for j in jitter] for d in drift]
    lo, hi = bootstrap_ratio_interval(mode, plain)
    assert lo <= median_ratio(mode, plain) <= hi
    assert 1.0 < lo and hi < 1.01, (lo, hi)


def test_equal_noisy_configurations_leave_the_goal_open():
    import random

    from faircast_bench.stats import bootstrap_ratio_interval

    rng = random.Random(5)
    plain = [[rng.uniform(9, 11) for _ in range(3)] for _ in range(6)]
    mode = [[rng.uniform(9, 11) for _ in range(3)] for _ in range(6)]
    lo, hi = bootstrap_ratio_interval(mode, plain)
    assert lo < 1.0 < 1.01 < hi, (lo, hi)


def test_unpaired_rounds_are_refused():
    from faircast_bench.stats import bootstrap_ratio_interval

    with pytest.raises(ValueError, match="paired rounds"):
        bootstrap_ratio_interval([[1.0]] * 3, [[1.0]] * 2)


def test_settled_table_prints_the_interval_the_cast_share_and_plain_rss_spread():
    from faircast_bench.model import format_settled

    def rounds(config, steps, cast, peaks):  # one launch per round, both ranks alike
        return figures(2, config, [[_rank(config, [30.0] + steps, cast, p, 1.0, 1000, 1000 * 1024 * 1024)] * 2
                                   for p in peaks])

    plain = rounds("plain", [10.0, 10.0], 0.0, [3000, 3040, 2990, 3010, 3020, 3000])
    dither = rounds("dither", [10.5, 10.5], 0.05, [3030] * 6)  # 5% slower throughout: MISS
    ef = rounds("error_feedback", [10.0, 10.0], 0.2, [7060] * 6)  # +4055 within 4 B x 2^30 + 64 MiB
    text = format_settled([plain, dither, ef])
    rows = {line.split()[1]: line for line in text.splitlines() if line.startswith("2 ")}
    assert "[1.050, 1.050]" in rows["dither"] and "<=1.01 MISS" in rows["dither"]
    assert "0.48%" in rows["dither"]  # 0.05 s of each 10.5 s step
    assert "+25" in rows["dither"]  # 3030 against plain's median over rounds, 3005
    assert rows["dither"].split()[14] == "50"  # plain's spread: 3040 - 2990
    assert "<=1.03 pass" in rows["error_feedback"] and "2.00%" in rows["error_feedback"]
    assert "+4055" in rows["error_feedback"] and "+4064" in rows["error_feedback"]
    assert rows["error_feedback"].split()[-3] == "pass"
    assert rows["error_feedback"].split()[-2:] == ["7160", "+4055"]  # with the checkpoint: _rank's peak + 100


def test_rounds_are_interleaved_in_a_rotating_order(tmp_path, monkeypatch):
    import json

    from faircast_bench import model as bench_model

    launched = []

    def launch(stem, model, layers, stage, config, warmup, steps, log):
        launched.append(stem.rsplit("/", 1)[1])
        for r in (0, 1):
            d = _rank(config, [9, 10, 10, 10], 0.05, 3000, 10.0, 1000)
            d.update(layers=2)
            (tmp_path / f"{stem.rsplit('/', 1)[1]}.rank{r}.json").write_text(json.dumps(d))

    monkeypatch.setattr(bench_model, "_launch", launch)
    rows = bench_model.run("qwen3-0.6b", layers=2, stages=(3, 2), configs=("plain", "dither", "error_feedback"),
                           warmup=1, steps=3, rounds=2, out_dir=str(tmp_path), log=lambda s: None)
    assert launched == ["r0-z3-plain", "r0-z3-dither", "r0-z3-error_feedback", "r0-z2-plain", "r0-z2-dither",
                        "r0-z2-error_feedback", "r1-z3-dither", "r1-z3-error_feedback", "r1-z3-plain",
                        "r1-z2-dither", "r1-z2-error_feedback", "r1-z2-plain"]
    assert [len(r.round_steps) for r in rows] == [2] * 6


def test_launches_import_this_package_and_the_standard_library(tmp_path):
    """A launch's path and folder give this checkout's faircast_ds and faircast_bench and the standard library's
    inspect (a root computed from the module's own folder once put faircast_ds/tools/ first: every launch died
    importing torch)."""
    import os
    import subprocess
    import sys

    import faircast_bench
    import faircast_ds
    from faircast_bench.model import launch_env

    env, root = launch_env()
    code = ("import inspect, faircast_ds, faircast_bench; print(inspect.__file__); print(faircast_ds.__file__); "
            "print(faircast_bench.__file__)")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True)
    lib, pkg, bench = out.stdout.split()
    assert os.path.dirname(lib) == os.path.dirname(os.__file__)
    assert (pkg, bench) == (faircast_ds.__file__, faircast_bench.__file__)


def test_cpu_time_and_page_faults_per_step_are_the_busier_ranks_medians_beside_plains():
    from faircast_bench.model import format_usage

    def ranked(config, seconds, cpu, faults):
        r = _rank(config, seconds, 0.05, 3000, 4.0, 100)
        for step, c, f in zip(r["steps"], cpu, faults):
            step.update(cpu_s=c, minor_faults=f, major_faults=0)
        return r

    plain = figures(3, "plain", [[ranked("plain", [20, 10, 10, 10], [40, 19, 18, 20], [9, 100, 120, 110]),
                                  ranked("plain", [20, 10, 10, 10], [40, 18, 18, 18], [9, 90, 130, 100])]])
    ef = figures(3, "error_feedback", [[ranked("error_feedback", [20, 11, 11, 12], [40, 22, 21, 23], [9, 300, 310, 290]),
                                        ranked("error_feedback", [20, 11, 11, 12], [40, 20, 20, 20], [9, 5, 5, 5])]])
    # the busier rank per step, the warm-up skipped, then the median: CPU max(19,18), max(18,18), max(20,18)
    assert (plain.cpu_s, plain.minor_faults) == (19, 110)  # faults: max(100,90), max(120,130), max(110,100)
    assert (ef.cpu_s, ef.minor_faults) == (22, 300)
    text = format_usage([plain, ef])
    row = next(line for line in text.splitlines() if line.startswith("3 ") and "error_feedback" in line).split()
    assert row[2:6] + row[8:] == ["11.00", "1.100", "22.00", "1.158", "<=1.03", "MISS", "2.000", "300", "2.727"]
    lo, hi = float(row[6].strip("[,")), float(row[7].strip("]"))
    assert 1.03 < lo <= 1.158 <= hi  # every resampled CPU ratio is above the goal: 20-23 s against 18-20 s
    # a worker that did not record them (older results): no figure rather than a made-up one
    old = figures(3, "plain", [[_rank("plain", [20, 10, 10, 10], 0.0, 3000, 4.0, 100)] * 2])
    assert old.cpu_s is None and format_usage([old]) == ""
