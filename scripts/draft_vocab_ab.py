#!/usr/bin/env python
"""Drafters side by side in one run: the shipped one and copies with a smaller draft vocabulary
(`scripts/prune_draft_vocab.py`), on held-out short prompts and long code, interleaved per prompt.

Each drafter runs with its own generation config (the shipped defaults: lookup, drafter and the calibrated cost model)
and alone (lookup off, costs 0: every round drafts), greedily and sampled at T=1 on short prompts, greedily on long
code. Prints per workload, mode and setting each drafter's decode tokens/s (the tokens after the first over the time
after the prefill), its ratio over the shipped drafter, tau and the drafter round in milliseconds; greedy outputs
must be identical.

    python scripts/prune_draft_vocab.py --size 8192 --output runs/drafter-vocab-8192   # and --size 4096
    python scripts/draft_vocab_ab.py --num-threads 2 runs/drafter-vocab-8192 runs/drafter-vocab-4096 \
        --json results/draft_vocab_ab.json
"""

from __future__ import annotations

import argparse
import collections
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from transformers_longspark.benchmarks.common import machine_info, time_forward_calls
from transformers_longspark.benchmarks.prompts import long_context_prompts, short_prompts
from transformers_longspark.benchmarks.settings import DRAFTER_ALONE
from transformers_longspark.benchmarks.speed import drafter_settings
from transformers_longspark.inference.stats import tau
from transformers_longspark.loading import SHIPPED_DRAFTER_DIR, load_drafter, load_target

# (workload, mode, drafter settings)
CASES = [("short", "greedy", "defaults"), ("short", "greedy", "alone"), ("short", "T=1", "defaults"),
         ("long", "greedy", "defaults"), ("long", "greedy", "alone")]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafters", nargs="+", type=Path, help="folders of the drafters to compare with the shipped")
    parser.add_argument("--num-short", type=int, default=8)
    parser.add_argument("--num-long", type=int, default=2)
    parser.add_argument("--long-length", type=int, default=4096)
    parser.add_argument("--num-threads", type=int)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    target, tokenizer = load_target()
    drafters = {"shipped": load_drafter(target, SHIPPED_DRAFTER_DIR)[0]}
    drafters |= {path.name: load_drafter(target, path)[0] for path in args.drafters}
    prompts = {"short": short_prompts(tokenizer, args.num_short),
               "long": long_context_prompts(tokenizer, (args.long_length,), args.num_long)}  # fmt: skip
    new_tokens = {"short": 96, "long": 64}
    totals = collections.defaultdict(lambda: collections.defaultdict(float))
    outputs = collections.defaultdict(list)
    names = list(drafters)
    for workload, mode, setting in CASES:
        items = prompts[workload]
        for index, prompt in enumerate([items[0], *items]):  # the first run of each drafter is a warm-up
            ids = torch.tensor([prompt["input_ids"]])
            kwargs = dict(max_new_tokens=new_tokens[workload], pad_token_id=tokenizer.eos_token_id,
                          attention_mask=torch.ones_like(ids), do_sample=mode != "greedy")  # fmt: skip
            for name in names[index % len(names) :] + names[: index % len(names)]:
                drafter = drafters[name]
                torch.manual_seed(index)
                with (
                    drafter_settings(drafter, DRAFTER_ALONE if setting == "alone" else {}),
                    time_forward_calls(target) as calls,
                ):
                    start = time.perf_counter()
                    output = target.generate(ids, assistant_model=drafter, **kwargs)
                    seconds = time.perf_counter() - start
                if index == 0:
                    continue
                stats, total = drafter.drafting_stats, totals[(workload, mode, setting, name)]
                total["new_tokens"] += output.shape[1] - ids.shape[1]
                total["decode_seconds"] += seconds - calls[0]
                total["rounds"] += stats.rounds
                total["prompts"] += 1
                total["drafter_rounds"] += stats.drafter_rounds
                total["drafter_seconds"] += stats.proposal_seconds + stats.context_update_seconds
                if mode == "greedy":
                    outputs[(workload, setting, name)].append(output[0].tolist())
    identical = all(outputs[(w, s, n)] == outputs[(w, s, "shipped")] for (w, s, n) in outputs)
    print(f"greedy outputs identical: {identical}")
    command = shlex.join(["python", "scripts/draft_vocab_ab.py", *sys.argv[1:]])
    report = {"machine": machine_info(), "command": command, "identical": identical, "rows": []}
    for workload, mode, setting in CASES:
        reference = None
        for name in names:
            t = totals[(workload, mode, setting, name)]
            rate = (t["new_tokens"] - t["prompts"]) / t["decode_seconds"]
            reference = reference or rate
            row = {"workload": workload, "mode": mode, "setting": setting, "drafter": name,
                   "decode_tokens_per_s": rate, "vs_shipped": rate / reference,
                   "tau": tau(int(t["new_tokens"]), int(t["rounds"]), int(t["prompts"])),
                   "drafter_round_ms": 1e3 * t["drafter_seconds"] / max(t["drafter_rounds"], 1),
                   "drafter_rounds": int(t["drafter_rounds"]), "rounds": int(t["rounds"])}  # fmt: skip
            report["rows"].append(row)
            print(f"{workload:5s} {mode:6s} {setting:8s} {name:22s} {rate:6.2f} tok/s {row['vs_shipped']:.3f}x  "
                  f"tau {row['tau']:.2f}  round {row['drafter_round_ms']:.2f} ms ({row['drafter_rounds']}/"
                  f"{row['rounds']} rounds drafted)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
