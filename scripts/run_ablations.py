"""Ablations at long context and the drafter-depth sweep, then held-out tau on long code for every variant.

Each variant is `configs/experiments/ablation-base.yaml` with its switches (paper, Table 4: no global summary, no
boundary state, no recent window; and 3 instead of 5 draft layers), trained from scratch with `longspark train`
(resumable: a finished variant is skipped, an interrupted one resumes). Then `longspark bench tau` measures greedy
tau for all of them on the same held-out long code files, and a Markdown table is printed.

    nohup python scripts/run_ablations.py > runs/ablations.log 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import yaml

from transformers_longspark.training.run import TrainingConfig

VARIANTS = {
    "full": {},
    "no-summary": {"use_global_summary": False},
    "no-boundary": {"use_boundary_state": False},
    "no-window": {"use_recent_window": False},
    "3-layers": {"num_selected_layers": 3},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="configs/experiments/ablation-base.yaml")
    parser.add_argument("--output", default="runs/ablations")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument(
        "--eval-args",
        default="--workloads long --long-lengths 4096 --num-long-prompts 8 --max-new-tokens 32 --whole-blocks "
        "--num-threads 2",
        help="extra arguments of `longspark bench tau`",
    )
    parser.add_argument(
        "--reference",
        action="append",
        default=[],
        help="NAME=FOLDER: another drafter to evaluate, e.g. the shipped one",
    )
    args = parser.parse_args(argv)
    output = Path(args.output)
    for name in args.variants:
        run = output / name
        if (run / "final" / "model.safetensors").exists():
            print(f"== {name}: done already", flush=True)
            continue
        base = TrainingConfig.from_file(args.base)
        drafter = {**base.drafter, **VARIANTS[name]}
        config = TrainingConfig(**{**asdict(base), "output_dir": str(run), "drafter": drafter})
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.yaml").write_text(yaml.safe_dump(asdict(config), sort_keys=False))
        print(f"== {name}: training", flush=True)
        command = ["-m", "transformers_longspark.cli", "train", "--config", str(run / "config.yaml"), "--resume"]
        subprocess.run([sys.executable, *command], check=True)

    drafters = [f"--drafter={name}={output / name / 'final'}" for name in args.variants]
    drafters += [f"--drafter={reference}" for reference in args.reference]
    result = output / "long_tau.json"
    command = ["-m", "transformers_longspark.cli", "bench", "tau", *drafters, "--json", str(result)]
    subprocess.run([sys.executable, *command, *args.eval_args.split()], check=True)
    rows = json.loads(result.read_text())["rows"]
    print("| variant | training CPU time | workload | tau | rounds |")
    print("|---|---|---|---:|---:|")
    for row in rows:
        log_path = output / row["drafter"] / "log.jsonl"
        log = [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.exists() else []
        minutes = f"{sum(r['seconds'] for r in log) / 60:.1f} min" if log else "-"
        print(f"| {row['drafter']} | {minutes} | {row['workload']} | {row['tau']:.3f} | {row['rounds']} |")


if __name__ == "__main__":
    main()
