"""The planner's exploration, A/B (experiment, not adopted): LongSpark `generate` with the shipped source choice, with
probes of a passed-over source only in rounds whose best choice is a plain step (a probe never displaces a source
worth more than one), and with that plus untried sources valued at the prior's rate (1/2) instead of infinity.
Variants interleaved prompt by prompt, twice in alternating order; greedy outputs checked equal; decode tok/s (the
tokens after the first over the time after it). `--trace` instead prints, for the shipped choice on the long prompts,
each prompt's rounds by source and what the drafter's rounds kept, with and without a lookup continuation on offer.

    python scripts/planner_probe_ab.py [--num-short 6] [--num-long 4] [--trace]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch
from session_before_after import FirstToken  # a streamer that notes when the first new token arrives

from transformers_longspark.benchmarks.prompts import long_context_prompts, short_prompts
from transformers_longspark.inference import planning
from transformers_longspark.inference.planning import FIRST_PROBE_INTERVAL, MAX_PROBE_INTERVAL, Source
from transformers_longspark.loading import load_drafter, load_smollm2

SHIPPED = planning.RoundPlanner.choose


def variant(untried_at_prior: bool):
    """`RoundPlanner.choose` whose probes only replace plain steps (`untried_at_prior`: an untried source is worth
    its value at rate 1/2, and is probed like the others, instead of infinitely much)."""

    def choose(self, continuation, can_draft, length=0, matched=0, room=None):
        prior = 0.5 if untried_at_prior else None
        values = {}
        if continuation:
            rate = self.match_rate(matched)
            rate = prior if rate is None else rate
            values[Source.LOOKUP] = self.costs.lookup_value(rate, len(continuation), not self.choose_lookup_length)[0]
        if can_draft:
            block = self.block_size if room is None else min(room, self.block_size)
            rate = prior if self.drafter_rate() is None else self.drafter_rate()
            values[Source.DRAFTER], self.draft_length = self.costs.drafter_value(rate, block, length)
        options = list(values)
        values[Source.NONE] = 1.0
        best = max(values, key=values.get)
        probe = None
        for source in options:
            record = self.records[source]
            if source is best:
                record.passed_over, record.probe_interval = 0, FIRST_PROBE_INTERVAL
            elif record.accepted is not None or untried_at_prior:
                record.passed_over += 1
                if probe is None and best is Source.NONE and record.passed_over >= record.probe_interval:
                    record.passed_over, record.probe_interval = 0, min(2 * record.probe_interval, MAX_PROBE_INTERVAL)
                    probe = source
        chosen = best if probe is None else probe
        self.lookup_match = matched if chosen is Source.LOOKUP else 0
        self.draft_length = self.draft_length if chosen is Source.DRAFTER else 0
        return chosen

    return choose


VARIANTS = {
    "shipped": SHIPPED,
    "probe in plain rounds": variant(untried_at_prior=False),
    "probe in plain rounds, untried at the prior": variant(untried_at_prior=True),
}


def trace(target, drafter, prompts) -> None:
    """Each prompt's rounds by source, and the drafter's rounds (kept drafts) with and without a lookup offer."""
    rounds = []

    def choose(self, continuation, can_draft, length=0, matched=0, room=None):
        source = SHIPPED(self, continuation, can_draft, length, matched, room)
        rounds.append({"source": source, "lookup_offered": bool(continuation)})
        return source

    def record(self, source, proposed, accepted):
        rounds[-1]["accepted"] = accepted
        return shipped_record(self, source, proposed, accepted)

    shipped_record = planning.RoundPlanner.record
    planning.RoundPlanner.choose, planning.RoundPlanner.record = choose, record
    try:
        for prompt in prompts:
            rounds.clear()
            ids = torch.tensor([prompt["input_ids"]])
            target.generate(ids, max_new_tokens=64, do_sample=False, assistant_model=drafter)
            drafted = [r for r in rounds if r["source"] is Source.DRAFTER]
            by_offer = {offered: [r["accepted"] for r in drafted if r["lookup_offered"] is offered]
                        for offered in (True, False)}  # fmt: skip
            print(f"{prompt['name']}: rounds {dict(Counter(r['source'].value for r in rounds))}; drafter rounds "
                  f"with a lookup offer {len(by_offer[True])} (kept {sum(by_offer[True])}), without "
                  f"{len(by_offer[False])} (kept {sum(by_offer[False])})")  # fmt: skip
    finally:
        planning.RoundPlanner.choose, planning.RoundPlanner.record = SHIPPED, shipped_record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-short", type=int, default=6)
    parser.add_argument("--num-long", type=int, default=4)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--trace", action="store_true", help="trace the shipped choice on the long prompts instead")
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    target, tokenizer = load_smollm2()
    drafter = load_drafter(target)[0]
    long_prompts = long_context_prompts(tokenizer, lengths=[4096], num_prompts=args.num_long)
    if args.trace:
        return trace(target, drafter, long_prompts)
    workloads = {"short": (short_prompts(tokenizer, args.num_short), 96), "long": (long_prompts, 64)}
    for workload, (prompts, new_tokens) in workloads.items():
        totals = {name: Counter() for name in VARIANTS}
        for prompt in prompts:
            ids = torch.tensor([prompt["input_ids"]])
            target.generate(ids[:, :32], max_new_tokens=4, do_sample=False, assistant_model=drafter)  # warm-up
            reference = None
            for order in (list(VARIANTS), list(reversed(VARIANTS))):
                for name in order:
                    planning.RoundPlanner.choose = VARIANTS[name]
                    clock = FirstToken()
                    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                          do_sample=False, assistant_model=drafter, streamer=clock)  # fmt: skip
                    seconds = time.perf_counter() - clock.time
                    reference = out if reference is None else reference
                    if not torch.equal(out, reference):
                        raise SystemExit(f"{name}: greedy output differs on {prompt['name']}")
                    stats = drafter.drafting_stats
                    totals[name].update(tokens=out.shape[1] - ids.shape[1] - 1, seconds=seconds, rounds=stats.rounds,
                                        plain=stats.plain_rounds, lookup=stats.lookup_rounds)  # fmt: skip
        planning.RoundPlanner.choose = SHIPPED
        base = totals["shipped"]["tokens"] / totals["shipped"]["seconds"]
        for name, t in totals.items():
            speed = t["tokens"] / t["seconds"]
            print(f"{workload}: {name}: {speed:.2f} decode tok/s ({speed / base:.3f}x), {t['rounds']} rounds, "
                  f"{t['plain']} plain, {t['lookup']} lookup", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
