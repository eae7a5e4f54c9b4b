"""Verifications priced at the request's prefix, A/B: LongSpark `generate` on held-out long code with the calibrated
forward costs read at the prefix (`RoundCosts.forward_cost(rows, length)`) or at the calibration's short prefix for
every length (before), interleaved file by file; greedy outputs checked equal. Prints decode tok/s (the tokens after
the first over the time after it, from a streamer's timestamps), rounds and the round mix.

    python scripts/length_priced_ab.py --num-threads 2 --num-prompts 4 --length 4096
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers.generation.streamers import BaseStreamer

from transformers_longspark.benchmarks.prompts import long_context_prompts
from transformers_longspark.inference import planning
from transformers_longspark.loading import load_drafter, load_smollm2

PRICED_AT_PREFIX = planning.RoundCosts.forward_cost


def priced_at_short_prefix(self, rows, length=0):
    return PRICED_AT_PREFIX(self, rows)


class FirstTokenTime(BaseStreamer):
    """The time of the first new token (the second `put`; the first is the prompt)."""

    def __init__(self):
        self.puts, self.first = 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    target, tokenizer = load_smollm2()
    drafter = load_drafter(target)[0]
    prompts = long_context_prompts(tokenizer, lengths=[args.length], num_prompts=args.num_prompts)
    variants = {"priced at the short prefix (before)": priced_at_short_prefix, "priced at the prefix": PRICED_AT_PREFIX}
    totals = {name: [0, 0.0, 0, 0, 0] for name in variants}
    for prompt in prompts:
        ids = torch.tensor([prompt["input_ids"]])
        reference = None
        for name, forward_cost in variants.items():
            planning.RoundCosts.forward_cost = forward_cost
            streamer = FirstTokenTime()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                  do_sample=False, assistant_model=drafter, streamer=streamer)  # fmt: skip
            end = time.perf_counter()
            reference = out if reference is None else reference
            if not torch.equal(out, reference):
                raise SystemExit(f"{name}: greedy output differs on {prompt['name']}")
            stats, total = drafter.drafting_stats, totals[name]
            total[0] += out.shape[1] - ids.shape[1] - 1
            total[1] += end - streamer.first
            total[2] += stats.rounds
            total[3] += stats.lookup_rounds
            total[4] += stats.plain_rounds
    planning.RoundCosts.forward_cost = PRICED_AT_PREFIX
    base = totals[next(iter(variants))]
    for name, (tokens, seconds, rounds, lookup, plain) in totals.items():
        ratio = tokens / seconds / (base[0] / base[1])
        print(f"{name}: {tokens / seconds:.1f} decode tok/s ({ratio:.3f}x), {rounds} rounds "
              f"({lookup} lookup, {plain} plain)")  # fmt: skip


if __name__ == "__main__":
    main()
