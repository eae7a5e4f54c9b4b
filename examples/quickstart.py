"""Speculative generation with LongSpark on the offline SmolLM2-135M-Instruct target, side by side with plain generate.

    python examples/quickstart.py [--prompt "..."] [--max-new-tokens 128] [--long-prompt-tokens 4096] [--skip-long]

Two cases: a chat question, and a long-code continuation (a Python standard-library file cut to ~4K tokens, no chat
template). For each, it prints the generated text, whether it is identical to plain greedy `generate`, the accepted
length tau (tokens after the first / verification rounds), and the tokens/s of both runs (end to end, prompt
processing included) with the speedup.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import transformers_longspark  # noqa: F401  (routes generate(assistant_model=drafter) to LongSpark)
from transformers_longspark.benchmarks import long_context_prompts
from transformers_longspark.loading import load_drafter, load_target

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, then explain how it works."


def timed_generate(target, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, float]:
    start = time.perf_counter()
    output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, **kwargs)
    return output, time.perf_counter() - start


def shorten(text: str, max_lines: int) -> str:
    lines = text.strip("\n").splitlines()
    more = [f"[... {len(lines) - max_lines} more lines]"] if len(lines) > max_lines else []
    return "\n".join(lines[:max_lines] + more)


def compare(title: str, target, tokenizer, drafter, input_ids: torch.LongTensor, max_new_tokens: int,
            max_lines: int | None = None) -> float:  # fmt: skip
    """Plain greedy `generate`, then LongSpark on the same prompt; prints the comparison, returns the speedup.
    With `max_lines`, the prompt's last lines are shown and the generated text is cut to `max_lines` lines."""
    prompt_length = input_ids.shape[1]
    print(f"\n=== {title} ({prompt_length} prompt tokens) ===")
    plain, plain_seconds = timed_generate(target, input_ids, max_new_tokens=max_new_tokens)
    assisted, assisted_seconds = timed_generate(target, input_ids, max_new_tokens=max_new_tokens,
                                                assistant_model=drafter)  # fmt: skip
    plain_tokens, new_tokens = plain.shape[1] - prompt_length, assisted.shape[1] - prompt_length
    rounds = drafter.drafting_stats.rounds
    tau = (new_tokens - 1) / rounds if rounds else float("nan")
    plain_speed, longspark_speed = plain_tokens / plain_seconds, new_tokens / assisted_seconds
    speedup = longspark_speed / plain_speed

    text = tokenizer.decode(assisted[0, prompt_length:], skip_special_tokens=True)
    if max_lines is None:
        print(text.strip("\n"))
    else:
        prompt_end = tokenizer.decode(input_ids[0, -40:]).splitlines()[-3:]
        print("[the prompt ends with:]", *prompt_end, "[LongSpark continues:]", shorten(text, max_lines), sep="\n")
    print("-" * 80)
    print(f"identical to plain generate: {'yes' if torch.equal(plain, assisted) else 'NO'}")
    print(f"accepted length tau: {tau:.2f}  ({new_tokens - 1} tokens after the first, {rounds} rounds)")
    print(f"tokens/s: plain generate {plain_speed:.1f}, LongSpark {longspark_speed:.1f}  (speedup {speedup:.2f}x)")
    if speedup < 1.0:
        print(f"LongSpark is slower than plain generate here: {tau:.2f} tokens per round do not yet pay for drafting "
              "and verifying each block on this machine (see 'Results on this machine' in the README).")  # fmt: skip
    return speedup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the chat question")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per case")
    parser.add_argument("--long-prompt-tokens", type=int, default=4096, help="length of the long-code prompt")
    parser.add_argument("--skip-long", action="store_true", help="run the chat case only")
    parser.add_argument("--drafter", type=Path, help="drafter folder (default: the shipped SmolLM2 drafter)")
    args = parser.parse_args()

    target, tokenizer = load_target()  # SmolLM2-135M-Instruct, offline
    drafter, _ = load_drafter(target, args.drafter)
    messages = [{"role": "user", "content": args.prompt}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]  # fmt: skip
    warmup = min(8, args.max_new_tokens)  # the first generate() calls pay one-time costs; keep them out of the timing
    timed_generate(target, chat_ids, max_new_tokens=warmup)
    timed_generate(target, chat_ids, max_new_tokens=warmup, assistant_model=drafter)

    speedups = {"chat": compare(f"chat: {args.prompt!r}", target, tokenizer, drafter, chat_ids, args.max_new_tokens)}
    if not args.skip_long:
        reserve = args.max_new_tokens + drafter.config.block_size + 1
        max_positions = target.config.get_text_config().max_position_embeddings
        (code,) = long_context_prompts(tokenizer, [args.long_prompt_tokens], 1, max_positions, reserve)
        code_ids = torch.tensor([code["input_ids"]])
        title = f"long code: continue {code['name']} from the Python standard library, no chat template"
        speedups["long code"] = compare(title, target, tokenizer, drafter, code_ids, args.max_new_tokens, max_lines=12)
    print("\nspeedup of LongSpark over plain generate: " + ", ".join(f"{k} {v:.2f}x" for k, v in speedups.items()))


if __name__ == "__main__":
    main()
