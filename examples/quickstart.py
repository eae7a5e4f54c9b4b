"""Speculative generation with LongSpark on the offline SmolLM2-135M-Instruct target, side by side with plain generate.

    python examples/quickstart.py [--prompt "..."] [--max-new-tokens 128] [--long-prompt-tokens 4096] [--skip-long]
                                  [--num-threads N] [--drafter DIR]

Two cases: a chat question, and a long-code continuation (a Python standard-library file cut to ~4K tokens, no chat
template). For each, it prints the generated text, whether it is identical to plain greedy `generate`, the accepted
length tau (tokens after the first / verification rounds), and the tokens/s of both runs (end to end, prompt
processing included) with the speedup, and one line on why it is faster or slower. Every `generate` call shows a
progress bar of its tokens ("prefill" until the first one).

About 2-3 minutes on a 2-core CPU, most of it the long-code case (two 4K-token prefills); `--skip-long` runs the chat
case alone. The first run also de-quantizes the demo target once (~20 s, cached, see README.md).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from tqdm.auto import tqdm

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, then explain how it works."
README_SECTION = "README.md, 'Results on this machine'"


def default_num_threads(torch_default: int) -> int:
    """torch's default (one thread per core) minus the cores other processes keep busy (1-minute load average), at
    least 1. On a busy machine torch's threads wait for each other, and a model this small runs many times slower with
    all cores than with one."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    return max(1, min(torch_default, usable) - busy)


class TokenProgress:
    """A `generate(streamer=...)` that shows a tqdm bar of the new tokens. transformers first passes the prompt, then
    the tokens of each step (or of each accepted block); until the first new token the bar reads "prefill"."""

    def __init__(self, description: str, max_new_tokens: int):
        self.bar = tqdm(total=max_new_tokens, desc=description, unit="tok", leave=False)
        self.prompt_seen = False

    def put(self, token_ids) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            self.bar.set_postfix_str(f"prefill of {token_ids.numel()} tokens")
            return
        self.bar.set_postfix_str("")
        self.bar.update(token_ids.numel())

    def end(self) -> None:
        self.bar.close()


def timed_generate(target, input_ids, description: str | None = None, **kwargs):
    """`(output ids, seconds)` of one greedy `generate`, with a progress bar when `description` is given."""
    import torch

    streamer = TokenProgress(description, kwargs["max_new_tokens"]) if description else None
    start = time.perf_counter()
    output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             streamer=streamer, **kwargs)  # fmt: skip
    return output, time.perf_counter() - start


def shorten(text: str, max_lines: int) -> str:
    lines = text.strip("\n").splitlines()
    more = [f"[... {len(lines) - max_lines} more lines]"] if len(lines) > max_lines else []
    return "\n".join(lines[:max_lines] + more)


def explain(speedup: float, tau: float, long_prefix: bool, plain_rounds: int = 0, rounds: int = 0) -> str:
    """One line on why LongSpark is faster or slower in this case, and where to read more."""
    if speedup < 0.97:
        return (f"LongSpark is slower here: {tau:.2f} tokens per round do not yet pay for drafting and verifying each "
                f"block on this machine ({README_SECTION}).")  # fmt: skip
    pace = "faster" if speedup > 1.03 else "about as fast"
    if rounds and plain_rounds > rounds / 2:
        extra = round((tau - 1.0) * rounds)
        return (f"LongSpark is {pace} here, but {plain_rounds} of its {rounds} rounds were plain decoding steps: on "
                f"this answer neither source repays most rounds on this machine, and the {rounds - plain_rounds} "
                f"rounds that proposed gained {extra} tokens ({README_SECTION}).")  # fmt: skip
    if long_prefix:
        return (
            f"LongSpark is {pace} here with {tau:.2f} tokens per round, much of it from its fast verification "
            f"path (no cache copies at long prefixes), which plain generate can use too ({README_SECTION})."
        )
    return f"LongSpark is {pace} here: {tau:.2f} tokens per round against the cost of a round ({README_SECTION})."


def compare(title: str, target, tokenizer, drafter, input_ids, max_new_tokens: int, max_lines: int | None = None,
            long_prefix: bool = False) -> float:  # fmt: skip
    """Plain greedy `generate`, then LongSpark on the same prompt; prints the comparison, returns the speedup.
    With `max_lines`, the prompt's last lines are shown and the generated text is cut to `max_lines` lines."""
    import torch

    prompt_length = input_ids.shape[1]
    print(f"\n=== {title} ({prompt_length} prompt tokens) ===", flush=True)
    plain, plain_seconds = timed_generate(target, input_ids, "plain generate", max_new_tokens=max_new_tokens)
    assisted, assisted_seconds = timed_generate(target, input_ids, "LongSpark", max_new_tokens=max_new_tokens,
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
    stats = drafter.drafting_stats
    sources = (f"{stats.lookup_rounds} lookup, {rounds - stats.lookup_rounds - stats.plain_rounds} drafter, "
               f"{stats.plain_rounds} plain steps where no source paid")  # fmt: skip
    print(f"accepted length tau: {tau:.2f}  ({new_tokens - 1} tokens after the first, {rounds} rounds: {sources})")
    print(f"tokens/s: plain generate {plain_speed:.1f}, LongSpark {longspark_speed:.1f}  (speedup {speedup:.2f}x)")
    print(explain(speedup, tau, long_prefix, stats.plain_rounds, rounds))
    return speedup


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the chat question")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per case")
    parser.add_argument("--long-prompt-tokens", type=int, default=4096, help="length of the long-code prompt")
    parser.add_argument("--skip-long", action="store_true", help="run the chat case only")
    parser.add_argument("--drafter", type=Path, help="drafter folder (default: the shipped SmolLM2 drafter)")
    parser.add_argument(
        "--num-threads",
        type=int,
        help="torch CPU threads (default: torch's default minus the cores other processes keep busy)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from transformers_longspark.files import DRAFTER_FOLDER_FIX, require_folder

    if args.drafter is not None:
        try:
            require_folder(args.drafter, "Drafter", DRAFTER_FOLDER_FIX)  # before anything loads
        except FileNotFoundError as error:
            raise SystemExit(f"quickstart: error: {error}") from None
    import torch

    from transformers_longspark.benchmarks.prompts import long_context_prompts
    from transformers_longspark.loading import load_drafter, load_target

    threads = args.num_threads or default_num_threads(torch.get_num_threads())
    torch.set_num_threads(threads)
    how = "--num-threads" if args.num_threads else "chosen from the idle cores; change it with --num-threads"
    print(f"torch threads: {threads} ({how})", flush=True)

    target, tokenizer = load_target()  # SmolLM2-135M-Instruct, offline
    drafter, _ = load_drafter(target, args.drafter)  # building a drafter routes generate(assistant_model=drafter)
    messages = [{"role": "user", "content": args.prompt}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]  # fmt: skip
    warmup = min(8, args.max_new_tokens)  # the first generate() calls pay one-time costs; keep them out of the timing
    timed_generate(target, chat_ids, "warm-up (untimed)", max_new_tokens=warmup)
    timed_generate(target, chat_ids, "warm-up (untimed)", max_new_tokens=warmup, assistant_model=drafter)

    speedups = {"chat": compare(f"chat: {args.prompt!r}", target, tokenizer, drafter, chat_ids, args.max_new_tokens)}
    if not args.skip_long:
        reserve = args.max_new_tokens + drafter.config.block_size + 1
        max_positions = target.config.get_text_config().max_position_embeddings
        (code,) = long_context_prompts(tokenizer, [args.long_prompt_tokens], 1, max_positions, reserve)
        code_ids = torch.tensor([code["input_ids"]])
        title = f"long code: continue {code['name']} from the Python standard library, no chat template"
        speedups["long code"] = compare(title, target, tokenizer, drafter, code_ids, args.max_new_tokens,
                                        max_lines=12, long_prefix=True)  # fmt: skip
    print("\nspeedup of LongSpark over plain generate: " + ", ".join(f"{k} {v:.2f}x" for k, v in speedups.items()))


if __name__ == "__main__":
    main()
