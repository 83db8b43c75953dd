"""What each cast mode costs a delta weight sync on SmolLM2-135M-Instruct (issue 49 item 3; docs/modes.md).

    python3 -m faircast_jobs.delta_table [OUT]        # OUT: launch/smollm2_delta.sh's folder (runs/delta)

Reads every ``OUT/*/steps.csv`` and prints, per learning rate and mode, the median over steps 2.. (step 1
starts from the initial weights, the same for every mode) of: the served weights changed per step, the bytes
a delta sync carries per step (``sync_bytes``: per changed tensor the smaller of index + value and bitmap +
value encodings, over the full served model), that delta as a share of a dense bf16 push
(``sync_bytes_dense``), and the bytes the verified push into `vllm serve` actually moved
(``engine_sync_bytes``, the job's ServedPush). Beside them, two outside figures a delta-sync user compares
against (in docs/modes.md, with their sources): ~99% of bf16 weights unchanged per step, and 20-35 MB per
step against 1.2 GB dense (1.7-2.9%) at Qwen3-0.6B.

Where the rows carry them (the job's importance-sampling columns, faircast_jobs/rollouts.py ``is_figures``), a
second table puts beside each mode's lag what TRL's vLLM importance-sampling correction would see of the
trainer-engine gap (docs/mismatch.md): does the correction see round-to-nearest's lag?
"""
from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

ORDER = ("nearest", "dither", "stochastic", "error_feedback")


def read(out: Path) -> dict[tuple[float, str], list[dict]]:
    """(lr, mode) -> that run's rows, from every steps.csv under ``out`` (the lr from each folder's job.json)."""
    import json

    runs: dict[tuple[float, str], list[dict]] = {}
    for csv_path in sorted(out.glob("*/steps.csv")):
        job = csv_path.parent / "job.json"
        if not job.is_file():
            raise SystemExit(f"{csv_path.parent}: no job.json beside steps.csv (not a job's folder)")
        lr = float(json.loads(job.read_text())["lr"])
        with open(csv_path) as f:
            for row in csv.DictReader(f):
                runs.setdefault((lr, row["mode"]), []).append(row)
    if not runs:
        raise SystemExit(f"no */steps.csv under {out}: run launch/smollm2_delta.sh first")
    return runs


def figures(rows: list[dict]) -> dict[str, float]:
    later = [r for r in rows if int(r["step"]) >= 2]
    if not later:
        raise SystemExit(f"{rows[0]['mode']}: only step 1 is there; the table needs steps 2..")
    med = lambda key: statistics.median(float(r[key]) for r in later)  # noqa: E731
    return {"steps": len(later), "changed": med("changed_fraction"), "delta": med("sync_bytes"),
            "dense": med("sync_bytes_dense"), "pushed": med("engine_sync_bytes")}


def table(runs: dict[tuple[float, str], list[dict]]) -> str:
    lines = ["| lr | mode | steps | changed per step | unchanged | delta per step | delta / dense | pushed per step |",
             "|---|---|---|---|---|---|---|---|"]
    for lr in sorted({k[0] for k in runs}, reverse=True):
        modes = sorted((m for (x, m) in runs if x == lr), key=lambda m: (ORDER + (m,)).index(m))
        for mode in modes:
            f = figures(runs[(lr, mode)])
            lines.append(f"| {lr:g} | {mode} | 2..{f['steps'] + 1} | {100 * f['changed']:.2f}% | "
                         f"{100 * (1 - f['changed']):.2f}% | {f['delta'] / 1e6:.1f} MB | "
                         f"{100 * f['delta'] / f['dense']:.1f}% | {f['pushed'] / 1e6:.1f} MB |")
    dense = next(iter(runs.values()))[0]["sync_bytes_dense"]
    lines.append(f"\ndense bf16 push: {int(dense) / 1e6:.1f} MB; medians over the steps shown")
    return "\n".join(lines)


CORRECTION = ("is_token_mean", "is_seq_min", "is_seq_max", "is_seq_masked", "phantom_clip_tokens", "engine_mismatch_k3")


def correction_table(runs: dict[tuple[float, str], list[dict]]) -> str | None:
    """Per lr and mode over steps 2..: the lag along the drift (median), the mean token ratio (median of the
    steps' means), the sequence ratio's extremes (min and max over the steps), the share of sequences TRL's
    default sequence_mask drops and of tokens outside [0.8, 1.2] (means over the steps), the K3 KL (median)."""
    lines = ["| lr | mode | steps | lag along drift (median) | token ratio mean | sequence ratio min, max | "
             "sequences masked (TRL default) | tokens outside [0.8, 1.2] | K3 KL |", "|---|---|---|---|---|---|---|---|---|"]
    found = False
    for lr in sorted({k[0] for k in runs}, reverse=True):
        for mode in sorted((m for (x, m) in runs if x == lr), key=lambda m: (ORDER + (m,)).index(m)):
            later = [r for r in runs[(lr, mode)] if int(r["step"]) >= 2 and r.get("is_token_mean", "") not in ("", "nan")]
            if not later:
                continue
            found = True
            col = lambda key: [float(r[key]) for r in later]  # noqa: E731
            lag = [x for x in col("lag_drift_steps") if x == x]
            lines.append(f"| {lr:g} | {mode} | {len(later)} | {statistics.median(lag) if lag else float('nan'):.1f} | "
                         f"{statistics.median(col('is_token_mean')):.4f} | {min(col('is_seq_min')):.3f}, "
                         f"{max(col('is_seq_max')):.3f} | {100 * statistics.fmean(col('is_seq_masked')):.2f}% | "
                         f"{100 * statistics.fmean(col('phantom_clip_tokens')):.2f}% | "
                         f"{statistics.median(col('engine_mismatch_k3')):.2e} |")
    return "\n".join(lines) if found else None


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    runs = read(Path(args[0] if args else "runs/delta"))
    print(table(runs))
    more = correction_table(runs)
    if more is not None:
        print("\nWhat an importance-sampling correction sees, beside the lag (steps with the columns):\n")
        print(more)


if __name__ == "__main__":
    main()
