"""Plain greedy generate against LongSpark at several (token, block) confidence thresholds, interleaved per prompt.

    python scripts/sweep_block_threshold.py --workload short --repeats 2
    python scripts/sweep_block_threshold.py --workload long --repeats 1      # two held-out stdlib files at 4K

Per threshold pair: the time ratio plain / LongSpark over all prompts (prefill included), tau and the tokens
drafted per round. Outputs are asserted identical to plain generate. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import time

import torch

import transformers_longspark  # noqa: F401  (routes generate(assistant_model=drafter) to LongSpark)
from transformers_longspark.benchmarks import long_context_prompts
from transformers_longspark.loading import load_drafter, load_target

QUESTIONS = [
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "What is the capital of Australia? Explain briefly.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did Natalia sell altogether in April and May?",
    "Write a short poem about the sea.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["short", "long"], default="short")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--pairs", nargs="+", default=["0.3:0", "0.3:0.15", "0.3:0.25", "0.3:0.4", "0:0.2"],
                        help="token:block threshold pairs")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(2)
    target, tokenizer = load_target()
    drafter, _ = load_drafter(target)
    if args.workload == "short":
        chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
        prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                                 return_dict=True)["input_ids"] for chat in chats]  # fmt: skip
    else:
        prompts = [torch.tensor([p["input_ids"]]) for p in long_context_prompts(tokenizer, [4096], num_prompts=2)]
    pairs = [tuple(float(x) for x in pair.split(":")) for pair in args.pairs]
    totals = {pair: [0.0, 0, 0, 0] for pair in pairs}  # seconds, rounds, drafted tokens, new tokens after the first
    plain_seconds = 0.0
    kwargs = dict(do_sample=False, max_new_tokens=args.max_new_tokens)
    for _ in range(args.repeats):
        for ids in prompts:
            start = time.perf_counter()
            plain = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            plain_seconds += time.perf_counter() - start
            for pair in pairs:
                config = drafter.generation_config
                config.assistant_confidence_threshold, config.block_confidence_threshold = pair
                start = time.perf_counter()
                output = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, **kwargs)
                seconds = time.perf_counter() - start
                assert torch.equal(plain, output), f"output differs from plain generate at {pair}"
                stats, total = drafter.drafting_stats, totals[pair]
                total[0] += seconds
                total[1] += stats.rounds
                total[2] += stats.drafted_tokens
                total[3] += output.shape[1] - ids.shape[1] - 1
    print(f"{'token:block':<12}{'plain/LongSpark':>16}{'tau':>7}{'drafted/round':>15}")
    for (token, block), (seconds, rounds, drafted, new) in totals.items():
        print(f"{f'{token}:{block}':<12}{plain_seconds / seconds:>15.3f}x{new / rounds:>7.2f}{drafted / rounds:>15.2f}")


if __name__ == "__main__":
    main()
