#!/usr/bin/env python
"""A training run's curve: held-out tau and tokens per target step of its checkpoints against the CPU time that
trained them, from `longspark bench tau` reports and the run's `log.jsonl`.

The tau reports name each checkpoint's drafter `stepN` (`step0`: the drafter the run started from, its
`init_drafter`), e.g. `--drafter step0=src/.../longspark-smollm2-135m-instruct --drafter
step160=runs/RUN/checkpoint-000160/drafter`. A run's CPU time is each logged step's wall seconds times the torch
threads it ran with (`--threads FROM_STEP:THREADS ...`: a run resumed with another thread count). Writes the table
as JSON (rendered into docs by `scripts/render_results.py`) and the curve as a PNG.

    python scripts/training_curve.py --tau results/tau_stage5_short.json results/tau_stage5_long.json \
        --log runs/smollm2-135m-cpu-stage5/log.jsonl --threads 1:1 81:2 \
        --json results/training_curve_stage5.json --plot results/training_curve_stage5.png
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

STEP_NAME = re.compile(r"step(\d+)$")


def cpu_hours_by_step(log: list[dict[str, Any]], threads: dict[int, int]) -> dict[int, tuple[float, int]]:
    """`{step: (CPU-hours, target tokens)}` up to each logged step (the last record of a step counts: a resumed run
    logs the steps it redid again)."""
    records = {record["step"]: record for record in log}
    hours, result, starts = 0.0, {0: (0.0, 0)}, sorted(threads)
    for step in sorted(records):
        count = threads[max((s for s in starts if s <= step), default=starts[0])]
        hours += records[step]["seconds"] * count / 3600
        result[step] = (hours, records[step].get("tokens", 0))
    return result


def curve(reports: list[dict[str, Any]], log: list[dict[str, Any]], threads: dict[int, int]) -> dict[str, Any]:
    """The curve's rows, one per checkpoint: its step, CPU-hours, target tokens, and tau and tokens per step of each
    workload of the reports."""
    spent = cpu_hours_by_step(log, threads)
    rows: dict[int, dict[str, Any]] = {}
    for report in reports:
        for row in report["rows"]:
            match = STEP_NAME.search(row["drafter"])
            if match is None:
                raise SystemExit(f"Drafter {row['drafter']!r}: name the checkpoints stepN (step0: the starting one).")
            step = int(match.group(1))
            if step not in spent:
                raise SystemExit(f"Step {step} is not in the training log.")
            hours, tokens = spent[step]
            entry = rows.setdefault(step, {"step": step, "cpu_hours": hours, "target_tokens": tokens})
            entry[row["workload"]] = {key: row[key] for key in ("tau", "tokens_per_step", "rounds", "acceptance_rates")}
    first = reports[0]
    return {
        "benchmark": "training_curve",
        "rows": [rows[step] for step in sorted(rows)],
        "workloads": sorted({row["workload"] for report in reports for row in report["rows"]}),
        "threads": {str(step): count for step, count in threads.items()},
        "machine": first.get("machine", {}),
        "tau_settings": [report.get("settings", {}) for report in reports],
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    hours = [row["cpu_hours"] for row in result["rows"]]
    for workload in result["workloads"]:
        for axis, key in zip(axes, ("tau", "tokens_per_step"), strict=True):
            axis.plot(hours, [row[workload][key] for row in result["rows"]], marker="o", label=workload)
    for axis, label in zip(axes, ("held-out tau (drafter alone)", "tokens per target step"), strict=True):
        axis.set_xlabel("training CPU-hours (this run)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tau", nargs="+", type=Path, required=True, help="`longspark bench tau --json` reports")
    parser.add_argument("--log", type=Path, required=True, help="the run's log.jsonl")
    parser.add_argument("--threads", nargs="+", default=["1:1"], help="FROM_STEP:THREADS, e.g. 1:1 81:2")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    threads = {int(a): int(b) for a, b in (spec.split(":") for spec in args.threads)}
    log = [json.loads(line) for line in args.log.read_text(encoding="utf-8").splitlines() if line.strip()]
    result = curve([json.loads(path.read_text(encoding="utf-8")) for path in args.tau], log, threads)
    args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result["rows"], indent=1))


if __name__ == "__main__":
    main()
