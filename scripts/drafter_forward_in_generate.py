#!/usr/bin/env python
"""The drafter's forward inside `generate`: its first call in a round, and the same call repeated at once.

On held-out short prompts the drafter alone (lookup off, costs 0: every round drafts) decodes greedily; each drafter
forward is run three times on the same block and context, and the median of each call's milliseconds is printed.
The first call finds the drafter's weights swept from the caches by the target step before it; the repeats find
them in cache. Their gap is what reading the weights costs a round beyond the operations themselves.

    taskset -c 0 python scripts/drafter_forward_in_generate.py --num-threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from transformers_longspark.benchmarks.prompts import short_prompts
from transformers_longspark.benchmarks.settings import DRAFTER_ALONE
from transformers_longspark.benchmarks.speed import drafter_settings
from transformers_longspark.loading import load_drafter, load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--num-threads", type=int)
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    target, tokenizer = load_target()
    drafter, _ = load_drafter(target)
    calls: dict[str, list[float]] = {"first": [], "repeated": [], "repeated again": []}
    forward = type(drafter).forward

    def timed_forward(self, *inputs, **kwargs):
        for times in calls.values():
            start = time.perf_counter()
            output = forward(self, *inputs, **kwargs)
            times.append(time.perf_counter() - start)
        return output

    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    type(drafter).forward = timed_forward
    try:
        with drafter_settings(drafter, DRAFTER_ALONE):
            for prompt in short_prompts(tokenizer, args.num_prompts):
                target.generate(torch.tensor([prompt["input_ids"]]), assistant_model=drafter, **kwargs)
    finally:
        type(drafter).forward = forward
    for name, times in calls.items():
        print(f"{name:15s} {1e3 * statistics.median(times):.2f} ms (median of {len(times)} forwards)")


if __name__ == "__main__":
    main()
