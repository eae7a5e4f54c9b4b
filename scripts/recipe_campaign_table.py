#!/usr/bin/env python
"""The recipe campaign's table: each arm's change against the reference recipe, the CPU time it trained, and its
held-out tau and tokens per target step (the drafter round's calibrated cost included), from `longspark bench tau`
reports whose drafters are named by arm, and each arm's training config (its change, and its run's `log.jsonl`).

    python scripts/recipe_campaign_table.py --step 150 --tau results/recipe_campaign_short.json \
        results/recipe_campaign_long.json --reference stage7=configs/smollm2-135m-cpu-stage7.yaml \
        --arm kl=configs/experiments/recipe7-kl.yaml ... [--log kl=results/recipe7-kl-log.jsonl ...] \
        --json results/recipe_campaign.json

An arm's CPU-hours are its median logged step's wall seconds times the steps times its torch threads: the median
keeps a stretch of steps slowed by another job on the machine from counting as training time.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import yaml

IGNORED_FIELDS = {"output_dir"}


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"drafter": {"a": 1}, "train_data": [{"path": "x"}]}` -> `{"drafter.a": 1, "train_data.0.path": "x"}`."""
    flat = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            value = {str(index): item for index, item in enumerate(value)}
        flat.update(flatten(value, f"{name}.") if isinstance(value, dict) else {name: value})
    return flat


def change(config: dict[str, Any], reference: dict[str, Any]) -> str:
    """The fields in which `config` differs from `reference`, as `field: value`; "reference" when none."""
    ours, theirs = flatten(config), flatten(reference)
    fields = sorted((set(ours) | set(theirs)) - IGNORED_FIELDS)
    changed = [f"{key}: {ours.get(key, '(default)')}" for key in fields if ours.get(key) != theirs.get(key)]
    return ", ".join(changed) or "reference"


def training_cost(config: dict[str, Any], step: int, log_path: Path | None = None) -> dict[str, float]:
    """The median step's seconds and the CPU-hours and target tokens up to `step` of the config's run (its
    `output_dir/log.jsonl`, or `log_path`)."""
    log_path = log_path or Path(config["output_dir"]) / "log.jsonl"
    records = {}
    for line in log_path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            records[record["step"]] = record  # a resumed run logs the steps it redid again: the last counts
    if step not in records:
        raise SystemExit(f"{log_path} has no step {step}: train the arm that far first.")
    seconds = statistics.median(records[s]["seconds"] for s in range(1, step + 1) if s in records)
    threads = config.get("num_threads") or 1
    return {"median_step_seconds": seconds, "cpu_hours": seconds * step * threads / 3600,
            "target_tokens": records[step].get("tokens", 0)}  # fmt: skip


def campaign(
    reports: list[dict[str, Any]], arms: dict[str, Path], reference: str, step: int, logs: dict[str, Path]
) -> dict[str, Any]:
    configs = {name: yaml.safe_load(path.read_text(encoding="utf-8")) for name, path in arms.items()}
    rows = []
    for name, config in configs.items():
        row = {"arm": name, "config": str(arms[name]), "change": change(config, configs[reference]),
               **training_cost(config, step, logs.get(name))}  # fmt: skip
        for report in reports:
            for result in report["rows"]:
                if result["drafter"] == name:
                    row[result["workload"]] = {
                        "tau": result["tau"], "tokens_per_step": result["tokens_per_step"],
                        "draft_round_cost": result.get("costs", {}).get("draft_round_cost"),
                        "acceptance_rates": result["acceptance_rates"], "rounds": result["rounds"],
                    }  # fmt: skip
        rows.append(row)
    start = {result["workload"]: {"tau": result["tau"], "tokens_per_step": result["tokens_per_step"],
                                  "draft_round_cost": result.get("costs", {}).get("draft_round_cost")}
             for report in reports for result in report["rows"] if result["drafter"] == "start"}  # fmt: skip
    return {
        "benchmark": "recipe_campaign",
        "step": step,
        "reference": reference,
        "rows": rows,
        "start": start,
        "workloads": sorted({row["workload"] for report in reports for row in report["rows"]}),
        "machine": reports[0].get("machine", {}),
        "tau_settings": [report.get("settings", {}) for report in reports],
        "tau_commands": [report.get("command") for report in reports],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tau", nargs="+", type=Path, required=True, help="`longspark bench tau --json` reports")
    parser.add_argument("--reference", required=True, help="NAME=CONFIG: the recipe the arms change")
    parser.add_argument("--arm", nargs="+", required=True, help="NAME=CONFIG, NAME as in the tau reports")
    parser.add_argument("--step", type=int, required=True, help="the step every arm's checkpoint was taken at")
    parser.add_argument("--log", nargs="*", default=[], help="NAME=LOG: an arm's log.jsonl kept elsewhere")
    parser.add_argument("--start-label", default="the drafter every arm starts from",
                        help="what the tau reports' drafter named `start` is")  # fmt: skip
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    specs = [args.reference, *args.arm]
    arms = {name: Path(path) for name, path in (spec.split("=", 1) for spec in specs)}
    reports = [json.loads(path.read_text(encoding="utf-8")) for path in args.tau]
    logs = {name: Path(path) for name, path in (spec.split("=", 1) for spec in args.log)}
    result = campaign(reports, arms, args.reference.split("=", 1)[0], args.step, logs)
    result["start_label"] = args.start_label
    args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(result["rows"], indent=1))


if __name__ == "__main__":
    main()
