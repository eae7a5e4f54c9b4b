"""Plain greedy generate against LongSpark at several (token, block) confidence thresholds, interleaved per prompt.

    python scripts/sweep_block_threshold.py --workload short --repeats 2
    python scripts/sweep_block_threshold.py --workload long --repeats 1      # two held-out stdlib files at 4K

Per threshold pair: the time ratio plain / LongSpark over all prompts (prefill included), tau and the tokens
drafted per round. Greedy outputs are asserted identical to plain generate; `--modes sampled` runs at T=1.
Run it with nothing else on the machine. Before/after of the shipped threshold, long code at 4K and 8K:

    python scripts/sweep_block_threshold.py --workload long --lengths 4096 8192 --modes greedy sampled \
        --pairs 0.3:0 0.3:0.25 --repeats 1
"""

from __future__ import annotations

import argparse
import time

import torch

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
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096], help="long prompt lengths, 2 files each")
    parser.add_argument("--modes", nargs="+", default=["greedy"], choices=["greedy", "sampled"])
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
        files = long_context_prompts(tokenizer, args.lengths, num_prompts=2 * len(args.lengths))
        prompts = [torch.tensor([p["input_ids"]]) for p in files]
    pairs = [tuple(float(x) for x in pair.split(":")) for pair in args.pairs]
    for mode in args.modes:
        sweep(target, drafter, prompts, pairs, args.repeats, args.max_new_tokens, mode)


def sweep(target, drafter, prompts, pairs, repeats: int, max_new_tokens: int, mode: str) -> None:
    totals = {pair: [0.0, 0, 0, 0] for pair in pairs}  # seconds, rounds, drafted tokens, new tokens after the first
    plain_seconds = 0.0
    kwargs = dict(do_sample=mode == "sampled", max_new_tokens=max_new_tokens)
    if mode == "sampled":
        kwargs.update(temperature=1.0, top_k=0, top_p=1.0)
    for _ in range(repeats):
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
                if mode == "greedy":
                    assert torch.equal(plain, output), f"output differs from plain generate at {pair}"
                stats, total = drafter.drafting_stats, totals[pair]
                total[0] += seconds
                total[1] += stats.rounds
                total[2] += stats.drafted_tokens
                total[3] += output.shape[1] - ids.shape[1] - 1
    print(f"{mode}:\n{'token:block':<12}{'plain/LongSpark':>16}{'tau':>7}{'drafted/round':>15}")
    for (token, block), (seconds, rounds, drafted, new) in totals.items():
        print(f"{f'{token}:{block}':<12}{plain_seconds / seconds:>15.3f}x{new / rounds:>7.2f}{drafted / rounds:>15.2f}")


if __name__ == "__main__":
    main()
