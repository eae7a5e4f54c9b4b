#!/usr/bin/env python
"""What a drafter round costs, part by part, with the drafter's linear layers in each dtype this CPU runs packed.

On held-out short prompts, the drafter alone (lookup off, costs 0: every round drafts) decodes with
`drafter.linear_dtype` = `torch.float32`, `torch.bfloat16` (where the CPU has native bf16 kernels), `torch.int8`
(int8 weights with a scale per row, bf16 inputs) and `torch.qint8` (the same rows in fbgemm's dynamic int8, the
default on x86), interleaved per prompt, beside plain decoding on the fast path (every round a plain step), which
gives the target step. Prints, per setting, the milliseconds per drafter round of each part
(`DraftingStats.drafter_round_parts`: drafter forward, context read with the summary update, planning, the rest) and
the round in target steps, with tau and tokens/s, and writes them as JSON.

    python scripts/drafter_round_parts.py --num-threads 2 --json results/drafter_round_parts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from transformers_longspark.benchmarks.common import machine_info, time_forward_calls
from transformers_longspark.benchmarks.prompts import short_prompts
from transformers_longspark.benchmarks.settings import DRAFTER_ALONE, DRAFTER_METHODS
from transformers_longspark.benchmarks.speed import drafter_settings
from transformers_longspark.inference.stats import DraftingStats, tau
from transformers_longspark.loading import load_drafter, load_target
from transformers_longspark.packed_linear import drafter_linear_dtype, fast_dtype

NO_PROPOSALS = DRAFTER_METHODS["longspark_no_proposals"]
SETTINGS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "qint8": torch.qint8}
if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # emulated bf16: not a setting anyone would run
    del SETTINGS["bf16"]
if fast_dtype(torch.float32) != torch.qint8:  # no fbgemm here
    del SETTINGS["qint8"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--num-threads", type=int)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    target, tokenizer = load_target()
    drafter, _ = load_drafter(target)
    prompts = short_prompts(tokenizer, args.num_prompts)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    totals = {name: DraftingStats() for name in SETTINGS}
    tokens = {name: [0, 0, 0.0] for name in [*SETTINGS, "plain_steps"]}  # new tokens, rounds, seconds
    step_ms = []
    for index, prompt in enumerate([prompts[0], *prompts]):  # the first run of each is a warm-up
        input_ids = torch.tensor([prompt["input_ids"]])
        order = [*SETTINGS, "plain_steps"]
        for name in order[index % len(order) :] + order[: index % len(order)]:
            drafter.linear_dtype = SETTINGS.get(name, "auto")  # plain steps: no drafter round to price
            settings = NO_PROPOSALS if name == "plain_steps" else DRAFTER_ALONE
            with drafter_settings(drafter, settings), time_forward_calls(target) as forwards:
                start = time.perf_counter()
                output = target.generate(input_ids, assistant_model=drafter, **kwargs)
                seconds = time.perf_counter() - start
            stats = drafter.drafting_stats
            if index == 0:
                continue
            new = output.shape[1] - input_ids.shape[1]
            tokens[name] = [tokens[name][0] + new, tokens[name][1] + stats.rounds, tokens[name][2] + seconds]
            if name == "plain_steps":
                step_ms += [1e3 * s for s in forwards[1:]]  # one-token forwards after the prefill
            else:
                for field in ("drafter_rounds", "proposal_seconds", "planning_seconds", "drafter_forward_seconds",
                              "context_update_seconds"):  # fmt: skip
                    setattr(totals[name], field, getattr(totals[name], field) + getattr(stats, field))
    step = statistics.median(step_ms)
    report = {
        "benchmark": "drafter_round_parts",
        "machine": machine_info(),
        "plain_step_ms": step,
        "prompts": len(prompts),
        "settings": {},
    }
    print(f"plain step on the fast path (median one-token forward): {step:.1f} ms")
    print("| linear dtype | drafter forward | context read | planning | rest | round ms | in steps | tau | tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, value in SETTINGS.items():
        drafter.linear_dtype = value
        parts = totals[name].drafter_round_parts()
        new, rounds, seconds = tokens[name]
        row = {**parts, "round_steps": parts["total"] / step, "tau": tau(new, rounds, len(prompts)),
               "tokens_per_s": new / seconds, "dtype": str(drafter_linear_dtype(drafter))}  # fmt: skip
        report["settings"][name] = row
        print(f"| {row['dtype']} | {parts['drafter_forward']:.2f} | {parts['context_read']:.2f} | "
              f"{parts['planning']:.2f} | {parts['rest']:.2f} | {parts['total']:.2f} | {row['round_steps']:.3f} | "
              f"{row['tau']:.2f} | {row['tokens_per_s']:.1f} |")  # fmt: skip
    new, _, seconds = tokens["plain_steps"]
    report["plain_steps_tokens_per_s"] = new / seconds
    print(f"plain steps only: {new / seconds:.1f} tok/s; CPU: {report['machine']['cpu']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
