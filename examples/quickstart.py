"""Speculative generation with LongSpark on the offline SmolLM2-135M-Instruct target.

    python examples/quickstart.py [--prompt "..."] [--max-new-tokens 128] [--drafter PATH]

Prints the generated text, whether it is identical to plain greedy `generate`, the accepted length tau and the
tokens/s of both runs.
"""

import argparse
import time
from pathlib import Path

import torch

import transformers_longspark  # noqa: F401  (routes generate(assistant_model=drafter) to LongSpark)
from transformers_longspark.loading import load_drafter, load_target

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, then explain how it works."


def timed_generate(target, inputs, **kwargs):
    start = time.perf_counter()
    output = target.generate(**inputs, do_sample=False, **kwargs)
    return output, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drafter", type=Path, help="drafter folder (default: the shipped SmolLM2 drafter)")
    args = parser.parse_args()

    target, tokenizer = load_target()  # SmolLM2-135M-Instruct, offline
    drafter, _ = load_drafter(target, args.drafter)
    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_length = inputs["input_ids"].shape[1]

    timed_generate(target, inputs, max_new_tokens=8, assistant_model=drafter)  # warm-up
    plain, plain_seconds = timed_generate(target, inputs, max_new_tokens=args.max_new_tokens)
    assisted, assisted_seconds = timed_generate(target, inputs, max_new_tokens=args.max_new_tokens,
                                                assistant_model=drafter)  # fmt: skip
    new_tokens = assisted.shape[1] - prompt_length
    stats = drafter.drafting_stats
    tau = (new_tokens - 1) / max(1, stats.rounds)

    print(tokenizer.decode(assisted[0, prompt_length:], skip_special_tokens=True))
    print("-" * 80)
    print(f"identical to plain generate: {torch.equal(plain, assisted)}")
    print(f"accepted length tau: {tau:.2f}  ({new_tokens - 1} tokens after the first, {stats.rounds} rounds)")
    print(f"plain generate: {(plain.shape[1] - prompt_length) / plain_seconds:.1f} tokens/s")
    print(f"LongSpark:      {new_tokens / assisted_seconds:.1f} tokens/s  "
          f"(speedup {plain_seconds / assisted_seconds * new_tokens / (plain.shape[1] - prompt_length):.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
