"""The paper's ablation (Table 4) on a controlled long-range task: needle recall beyond the recent window.

Trains a tiny target on the needle-recall language (`experiments/needle_recall.py`), then, at equal budget (same steps,
same sequences), the full drafter and its variants without the global summary, without the boundary state and
without the recent window; then measures each drafter's greedy tau on the answer by the needle's distance (inside
the window, beyond it). Resumable: a trained target or drafter in `--work` is loaded, not retrained.

    python scripts/long_range_ablation.py            # ~20 min on 2 CPU cores: results/long_range_ablation.json
    python scripts/long_range_ablation.py --variants full --drafter-steps 3600 \
        --work runs/long_range_3x --output results/long_range_ablation_3x.json   # the budget study (~12 min)
    python scripts/long_range_ablation.py --small    # ~5 min: results/long_range_ablation_small.json
    python scripts/long_range_ablation.py --fixture tests/fixtures/recall   # the test suite's target and drafter

The small version (`--small`, and `--fixture`, its full drafter only) trains a smaller target and drafters with a
16-row window on needles at most 160 rows back; `--fixture` writes them where `tests/test_long_range_recall.py`
loads them. `--work` can start from another run's trained target (copy its `target/` folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from transformers_longspark import LongSparkDrafterModel
from transformers_longspark.benchmarks.common import machine_info
from transformers_longspark.experiments.needle_recall import (
    TRAINING_OPTIONS,
    VARIANTS,
    RecallLanguage,
    format_ablation,
    recall_acceptance,
    recall_drafter,
    tiny_target,
    train_drafter,
    train_target,
)

# The experiment, and the small version the test suite reads (`--fixture`).
FULL = dict(
    window=256,
    max_distance=4096,
    target_steps=2000,
    drafter_steps=1200,
    distances=[64, 192, 512, 1024, 2048, 4096],
    needle_length=8,
    block_size=8,
    target={},
    num_prompts=16,
)
SMALL = dict(
    window=16,
    max_distance=160,
    target_steps=3000,
    drafter_steps=800,
    distances=[4, 48, 96, 160],
    needle_length=6,
    block_size=4,
    target=dict(hidden_size=64, intermediate_size=128, head_dim=16),
    num_prompts=16,
)


def trained_target(setup: dict, language: RecallLanguage, folder: Path, seed: int):
    from transformers import AutoModelForCausalLM

    if (folder / "config.json").exists():
        print(f"== target: loading {folder}", flush=True)
        return AutoModelForCausalLM.from_pretrained(folder).eval()
    target = tiny_target(language, max_positions=setup["max_distance"] + 64, seed=seed, **setup["target"])
    print(f"== target: training {setup['target_steps']} steps", flush=True)
    log = train_target(target, language, setup["target_steps"], setup["max_distance"], seed=seed, log_every=250)
    target.eval().save_pretrained(folder)
    _save_summary(folder, log)
    return target


def trained_drafter(setup: dict, language: RecallLanguage, target, variant: str, folder: Path, seed: int):
    if (folder / "config.json").exists():
        print(f"== drafter {variant}: loading {folder}", flush=True)
        return LongSparkDrafterModel.from_pretrained(folder).eval()
    drafter = recall_drafter(
        target, language, variant, seed=seed, window_size=setup["window"], block_size=setup["block_size"]
    )
    print(f"== drafter {variant}: training {setup['drafter_steps']} steps", flush=True)
    options = TRAINING_OPTIONS.get(variant, {})
    log = train_drafter(
        target, drafter, language, setup["drafter_steps"], setup["max_distance"], seed=seed, log_every=100, **options
    )
    drafter.save_pretrained(folder)
    _save_summary(folder, log)
    return drafter


def _save_summary(folder: Path, log: list[dict]) -> None:
    summary = {"steps": len(log), "final_loss": log[-1]["loss"], "seconds": log[-1]["seconds"]}
    (folder / "training.json").write_text(json.dumps(summary) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("runs/long_range"), help="trained models (resumable)")
    parser.add_argument("--output", type=Path, help="the JSON report (default: results/long_range_ablation*.json)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--small", action="store_true", help="the small version: a 16-row window, needles <= 160 back")
    parser.add_argument("--fixture", type=Path, help="the small version's full drafter, for the test suite, in FIXTURE")
    parser.add_argument("--drafter-steps", type=int, help="train the drafters this many steps (a budget study)")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    small = args.small or args.fixture is not None
    setup = SMALL if small else FULL
    if args.drafter_steps:
        setup = {**setup, "drafter_steps": args.drafter_steps}
    language = RecallLanguage(needle_length=setup["needle_length"])
    work = args.fixture or (args.work / "small" if args.small else args.work)
    output = args.output or Path(f"results/long_range_ablation{'_small' if args.small else ''}.json")
    work.mkdir(parents=True, exist_ok=True)
    (work / "language.json").write_text(json.dumps(dataclasses.asdict(language)) + "\n")
    target = trained_target(setup, language, work / "target", args.seed)
    variants = ["full"] if args.fixture else args.variants
    drafters, seconds = {}, {}
    for variant in variants:
        drafters[variant] = trained_drafter(setup, language, target, variant, work / variant, args.seed + 1)
        summary = work / variant / "training.json"
        seconds[variant] = json.loads(summary.read_text())["seconds"] if summary.exists() else None
    rows = recall_acceptance(target, drafters, language, setup["distances"], setup["num_prompts"])
    result = {
        "benchmark": "long_range_ablation",
        "setup": setup,
        "rows": rows,
        "training_seconds": seconds,
        "machine": machine_info(torch.device("cpu")),
    }
    table = format_ablation(result)
    print(table)
    if not args.fixture:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
