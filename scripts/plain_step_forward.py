#!/usr/bin/env python
"""Is a LongSpark round that proposes nothing a plain step? The target forward of each decoding step at a long
prefix, three ways, interleaved call by call (issue 29's plain-step tax):

- `fast`: plain `generate` on the fast verification path (reserved cache rows, packed weights);
- `hooks`: the same with LongSpark's hidden-state hooks on the drafter's target layers;
- `longspark`: `generate(assistant_model=drafter)` with both sources off, so every round is a plain step.

Prints the median forward milliseconds (after the prefill) of each call and their median per way. Run it on an idle
machine; the SmolLM2 target and the shipped drafter.

    python scripts/plain_step_forward.py --prefix 4096 --new-tokens 24 --repeats 6 --num-threads 2
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import DynamicCache

from transformers_longspark import LongSparkDrafterModel
from transformers_longspark.benchmarks.common import time_forward_calls
from transformers_longspark.benchmarks.prompts import stdlib_token_ids
from transformers_longspark.benchmarks.settings import DRAFTER_METHODS
from transformers_longspark.benchmarks.speed import drafter_settings
from transformers_longspark.inference.verification import fast_verification
from transformers_longspark.loading import SHIPPED_DRAFTER_DIR, load_smollm2
from transformers_longspark.targets import HiddenStateCapture

WAYS = ("fast", "hooks", "longspark")


def step_ms(target, drafter, input_ids: torch.LongTensor, way: str, new_tokens: int) -> float:
    """The median target forward (ms) of one greedy `generate` call of `new_tokens` tokens, the prefill excluded."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(input_ids))  # fmt: skip
    with time_forward_calls(target) as calls:
        if way == "longspark":
            target.generate(input_ids, assistant_model=drafter, **kwargs)
        else:
            capture = None
            if way == "hooks":
                capture = HiddenStateCapture(target.model.layers, drafter.config.target_layer_ids, keep=8)
            cache = DynamicCache(config=target.config)
            with fast_verification(target, cache, input_ids.shape[1] + new_tokens):
                target.generate(input_ids, cache=cache, **kwargs)
            if capture is not None:
                capture.remove()
    return statistics.median(calls[1:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=4096, help="prompt tokens (held-out stdlib code)")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=6, help="calls per way, in rotated order")
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    target, tokenizer = load_smollm2()
    drafter = LongSparkDrafterModel.from_pretrained(SHIPPED_DRAFTER_DIR, dtype=target.dtype)
    input_ids = torch.tensor([stdlib_token_ids(tokenizer, args.prefix)])
    results: dict[str, list[float]] = {way: [] for way in WAYS}
    # The benchmark's `longspark_no_proposals` method: lookup and drafter off, every round a plain step.
    with drafter_settings(drafter, DRAFTER_METHODS["longspark_no_proposals"]):
        for repeat in range(args.repeats):
            shift = repeat % len(WAYS)
            for way in WAYS[shift:] + WAYS[:shift]:
                results[way].append(step_ms(target, drafter, input_ids, way, args.new_tokens))
    for way, values in results.items():
        calls = " ".join(f"{v:.1f}" for v in values)
        print(f"{way:>9}: median {statistics.median(values):.1f} ms a step (calls: {calls})")


if __name__ == "__main__":
    main()
