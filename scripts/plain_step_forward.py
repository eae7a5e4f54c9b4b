#!/usr/bin/env python
"""Is a LongSpark round that proposes nothing a plain step? The target forward of each decoding step at a long
prefix, five ways, interleaved call by call (issue 29's plain-step tax):

- `fast`: plain `generate` on the fast verification path (reserved cache rows, packed weights, lean layers);
- `hooks`: the same with LongSpark's hidden-state hooks on the drafter's target layers;
- `stock_layers`: `fast` with the target's stock decoder layers (`fast_verification(..., lean_layers=False)`);
- `longspark`: `generate(assistant_model=drafter)` with both sources off, so every round is a plain step;
- `static`: plain `generate` with transformers' static cache.

Prints the median forward milliseconds (after the prefill) of each call and their median per way; with `--profile`,
each way's decoding steps under torch's profiler instead (self CPU ms per step, and its largest operations). Run it
on an idle machine; the SmolLM2 target and the shipped drafter.

    python scripts/plain_step_forward.py --prefix 4096 --new-tokens 24 --repeats 6 --num-threads 2
    python scripts/plain_step_forward.py --prefix 6144 --new-tokens 13 --repeats 2 --profile --ways fast static
    python scripts/plain_step_forward.py --prefix 128 --new-tokens 24 --repeats 8 --ways fast stock_layers
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

WAYS = ("fast", "hooks", "stock_layers", "longspark", "static")


def decode(target, drafter, input_ids: torch.LongTensor, way: str, new_tokens: int) -> None:
    """One greedy `generate` call of `new_tokens` tokens, `way`."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(input_ids))  # fmt: skip
    if way == "longspark":
        target.generate(input_ids, assistant_model=drafter, **kwargs)
    elif way == "static":
        target.generate(input_ids, cache_implementation="static", **kwargs)
    else:
        capture = None
        if way == "hooks":
            capture = HiddenStateCapture(target.model.layers, drafter.config.target_layer_ids, keep=8)
        cache = DynamicCache(config=target.config)
        rows = input_ids.shape[1] + new_tokens
        with fast_verification(target, cache, rows, lean_layers=way != "stock_layers"):
            target.generate(input_ids, cache=cache, **kwargs)
        if capture is not None:
            capture.remove()


def step_ms(target, drafter, input_ids: torch.LongTensor, way: str, new_tokens: int) -> float:
    """The median target forward (ms) of one `decode` call, the prefill excluded."""
    with time_forward_calls(target) as calls:
        decode(target, drafter, input_ids, way, new_tokens)
    return statistics.median(calls[1:]) * 1000


def profile_steps(target, drafter, input_ids: torch.LongTensor, way: str, new_tokens: int) -> str:
    """Self CPU ms per decoding step of one `decode` call under torch's profiler (the prefill and the first step
    skipped), and its largest operations."""
    from torch.profiler import ProfilerActivity, profile, schedule

    active = new_tokens - 3
    profiler = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=2, warmup=1, active=active))
    hook = target.register_forward_hook(lambda *_: profiler.step())
    profiler.start()
    try:
        decode(target, drafter, input_ids, way, new_tokens)
    finally:
        hook.remove()
        profiler.stop()
    events = sorted(profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / 1000 / active
    top = "; ".join(f"{e.key} {e.self_cpu_time_total / 1000 / active:.2f}" for e in events[:6])
    return f"{total:.1f} ms a step (self CPU; largest, ms a step: {top})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=4096, help="prompt tokens (held-out stdlib code)")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=6, help="calls per way, in rotated order")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--profile", action="store_true", help="profile each call's decoding steps instead")
    args = parser.parse_args()
    if args.profile and args.new_tokens < 5:
        parser.error("--profile needs --new-tokens of at least 5 (the prefill and two steps are skipped).")
    torch.set_num_threads(args.num_threads)
    target, tokenizer = load_smollm2()
    drafter = LongSparkDrafterModel.from_pretrained(SHIPPED_DRAFTER_DIR, dtype=target.dtype)
    input_ids = torch.tensor([stdlib_token_ids(tokenizer, args.prefix)])
    ways = tuple(args.ways)
    results: dict[str, list[float]] = {way: [] for way in ways}
    # The benchmark's `longspark_no_proposals` method: lookup and drafter off, every round a plain step.
    with drafter_settings(drafter, DRAFTER_METHODS["longspark_no_proposals"]):
        for repeat in range(args.repeats):
            shift = repeat % len(ways)
            for way in ways[shift:] + ways[:shift]:
                if args.profile:
                    print(f"{way:>12}: {profile_steps(target, drafter, input_ids, way, args.new_tokens)}")
                else:
                    results[way].append(step_ms(target, drafter, input_ids, way, args.new_tokens))
    if args.profile:
        return
    for way, values in results.items():
        calls = " ".join(f"{v:.1f}" for v in values)
        print(f"{way:>12}: median {statistics.median(values):.1f} ms a step (calls: {calls})")


if __name__ == "__main__":
    main()
