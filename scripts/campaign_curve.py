#!/usr/bin/env python
"""The training campaign's curve: held-out teacher-forced tau of each shipped stage against the training CPU time
and target tokens spent since the first stage listed.

Each stage names its training log, the step that was shipped, and the `scripts/teacher_forced_tau.py` reports that
scored it (held-out code continuations, and chats), in which the stage's drafter is the entry named after the stage
and the drafter it continued is `start`. A stage that continues the run before it (the same log, a later step) counts
only the steps after that one. CPU-hours: the logged wall seconds of each step times the torch threads it ran with;
a step that took over twice its stage's median (paused while the machine timed a benchmark, or slowed by another
job: the log's seconds are wall time) counts as the median step.
Writes the table as JSON (rendered into docs by `scripts/render_results.py`) and the curve as a PNG.

    python scripts/campaign_curve.py --threads 2 \
        --stage stage8 results/smollm2-training-log-stage8.jsonl 150 \
            results/teacher_forced_tau_code_stage8.json results/teacher_forced_tau_greedy_stage8.json \
        --stage stage9 ... --json results/training_campaign.json --plot results/training_campaign.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def _read_log(path: Path) -> dict[int, dict[str, Any]]:
    """`{step: record}` (the last record of a step counts: a resumed run logs the steps it redid again)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return {record["step"]: record for record in map(json.loads, filter(str.strip, lines))}


def _scores(path: Path, name: str) -> dict[str, Any]:
    """The stage's tau and its `start`'s (the drafter it continued) in one teacher-forced report."""
    report = json.loads(path.read_text(encoding="utf-8"))
    drafters = report["drafters"]
    if name not in drafters or "start" not in drafters:
        raise SystemExit(f"{path} scores {sorted(drafters)}: it needs `start` and `{name}` (the stage's name).")
    scores = drafters[name]["all"]
    return {"tau": scores["tau"], "start_tau": drafters["start"]["all"]["tau"], "records": report["num_records"],
            "first_accepted": scores["acceptance_rates"][0]}  # fmt: skip


def campaign(stages: list[list[str]], threads: int) -> dict[str, Any]:
    rows, hours, tokens, previous = [], 0.0, 0, None
    for name, log_path, step, code_path, chat_path in stages:
        log, shipped = _read_log(Path(log_path)), int(step)
        if shipped not in log:
            raise SystemExit(f"Step {shipped} is not in {log_path}.")
        after = previous[1] if previous is not None and previous[0] == log_path else 0
        steps = [s for s in sorted(log) if after < s <= shipped]
        seconds = [log[s]["seconds"] for s in steps]
        median = statistics.median(seconds)
        slowed = sum(t > 2 * median for t in seconds)
        hours += sum(t if t <= 2 * median else median for t in seconds) * threads / 3600
        tokens += log[shipped]["tokens"] - (log[after]["tokens"] if after else 0)
        rows.append({"stage": name, "steps": len(steps), "slowed_steps": slowed, "cpu_hours": hours,
                     "target_tokens": tokens, "code": _scores(Path(code_path), name),
                     "chats": _scores(Path(chat_path), name)})  # fmt: skip
        previous = (log_path, shipped)
    return {"benchmark": "training_campaign", "threads": threads, "rows": rows}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    figure, axis = plt.subplots(figsize=(6.5, 3.8))
    hours = [0.0] + [row["cpu_hours"] for row in rows]
    axis.plot(hours, [rows[0]["code"]["start_tau"]] + [row["code"]["tau"] for row in rows], marker="o")
    for row in rows:
        axis.annotate(row["stage"], (row["cpu_hours"], row["code"]["tau"]), fontsize=8, xytext=(3, -10),
                      textcoords="offset points")  # fmt: skip
    axis.set_xlabel("training CPU-hours since the first stage")
    axis.set_ylabel("held-out code tau (teacher-forced)")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", nargs=5, action="append", required=True,
                        metavar=("NAME", "LOG", "STEP", "CODE_TAU_JSON", "CHAT_TAU_JSON"))  # fmt: skip
    parser.add_argument("--threads", type=int, default=2, help="torch threads every stage trained with")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    result = campaign(args.stage, args.threads)
    args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        plot(result, args.plot)
    for row in result["rows"]:
        print(
            f"{row['stage']}: {row['cpu_hours']:.1f} CPU-hours, {row['target_tokens']:,} target tokens, code tau "
            f"{row['code']['tau']:.3f}, chats {row['chats']['tau']:.3f} ({row['chats']['records']} records)"
        )


if __name__ == "__main__":
    main()
