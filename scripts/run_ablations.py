"""Ablations at long context and the drafter-depth sweep, then held-out tau on long code for every variant.

Each variant is `configs/experiments/ablation-base.yaml` with its switches (paper, Table 4: no global summary, no
boundary state, no recent window; and 3 instead of 5 draft layers), trained from scratch with `longspark train`
(resumable: a finished variant is skipped, an interrupted one resumes). Then `scripts/eval_long_tau.py` measures
greedy tau for all of them on the same held-out files of the code corpus, and a Markdown table is printed.

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
    parser.add_argument("--eval-args", default="--lengths 4096 --num-files 8 --new-tokens 32 --num-threads 2",
                        help="extra arguments of scripts/eval_long_tau.py")  # fmt: skip
    parser.add_argument("--reference", action="append", default=[],
                        help="NAME=FOLDER: another drafter to evaluate, e.g. the shipped one")  # fmt: skip
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
    subprocess.run([sys.executable, "scripts/eval_long_tau.py", *drafters, "--json", str(result), "--check", "0",
                    *args.eval_args.split()], check=True)  # fmt: skip
    rows = json.loads(result.read_text())["tau"]
    print("| variant | training CPU time | " + " | ".join(f"tau at {n}" for n in next(iter(rows.values()))) + " |")
    for name, per_length in rows.items():
        log_path = output / name / "log.jsonl"
        log = [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.exists() else []
        minutes = f"{sum(r['seconds'] for r in log) / 60:.1f} min" if log else "-"
        cells = [f"{row['tau']:.3f} ({row['rounds']} rounds)" for row in per_length.values()]
        print(f"| {name} | {minutes} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
