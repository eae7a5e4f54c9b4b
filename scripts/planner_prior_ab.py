"""The planner's prior, A/B: LongSpark `generate` on held-out prompts with a source's first verified round replacing
its running means (before) or folded into the prior (`planning.PRIOR_ROUNDS`), and with a longer memory, every
variant interleaved prompt by prompt; greedy outputs checked equal. Prints tok/s end to end, rounds and plain rounds.

    python scripts/planner_prior_ab.py --num-threads 2 [--long]
"""

from __future__ import annotations

import argparse
import time

import torch

from transformers_longspark.benchmarks.prompts import long_context_prompts, short_prompts
from transformers_longspark.inference import planning
from transformers_longspark.loading import load_drafter, load_smollm2

VARIANTS = {  # (PRIOR_ROUNDS, RUNNING_MEAN_WEIGHT)
    "first round replaces the means": (0, 0.25),
    "prior worth 3 rounds (shipped)": (3, 0.25),
    "prior, longer memory": (3, 0.125),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--long", action="store_true", help="also 4 held-out code files at 4K tokens")
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    target, tokenizer = load_smollm2()
    drafter = load_drafter(target)[0]
    workloads = {"short": (short_prompts(tokenizer, 6), 96)}
    if args.long:
        workloads["long"] = (long_context_prompts(tokenizer, lengths=[4096], num_prompts=4), 64)
    for workload, (prompts, new_tokens) in workloads.items():
        totals = {name: [0, 0.0, 0, 0] for name in VARIANTS}
        for prompt in prompts:
            ids = torch.tensor([prompt["input_ids"]])
            target.generate(ids[:, :32], max_new_tokens=4, do_sample=False, assistant_model=drafter)  # warm-up
            reference = None
            for name, (prior_rounds, weight) in VARIANTS.items():
                planning.PRIOR_ROUNDS, planning.RUNNING_MEAN_WEIGHT = prior_rounds, weight
                start = time.perf_counter()
                out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      do_sample=False, assistant_model=drafter)  # fmt: skip
                seconds = time.perf_counter() - start
                reference = out if reference is None else reference
                if not torch.equal(out, reference):
                    raise SystemExit(f"{name}: greedy output differs on {prompt['name']}")
                stats, total = drafter.drafting_stats, totals[name]
                total[0] += out.shape[1] - ids.shape[1]
                total[1] += seconds
                total[2] += stats.rounds
                total[3] += stats.plain_rounds
        base = totals[next(iter(VARIANTS))]
        for name, (tokens, seconds, rounds, plain) in totals.items():
            ratio = tokens / seconds / (base[0] / base[1])
            print(f"{workload}: {name}: {tokens / seconds:.1f} tok/s ({ratio:.3f}x), {rounds} rounds, {plain} plain")


if __name__ == "__main__":
    main()
