#!/usr/bin/env python
"""Sampled drafting with `inference/sampling.sample_from` against `torch.multinomial`, interleaved call by call.

At T=1 (no top-k/top-p), on held-out short prompts: the drafter alone (lookup off, costs 0: every round drafts a
block, one draw per position), timing each round's token loop (the drafter round minus its forward); and the batched
loop's verification (`batched.speculative_sampling`, which draws each row's next token over the target's vocabulary)
on random logits of 4 rows of 3 drafts, the median of 50 calls. Prints and writes (`--json`) the milliseconds of
each for each sampler.

    python scripts/sampler_ab.py --num-threads 2 --json results/sampler_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from transformers_longspark.benchmarks.common import machine_info
from transformers_longspark.benchmarks.prompts import short_prompts
from transformers_longspark.benchmarks.settings import DRAFTER_ALONE
from transformers_longspark.benchmarks.speed import drafter_settings
from transformers_longspark.inference import batched, drafting
from transformers_longspark.loading import load_drafter, load_target

SAMPLERS = {"sample_from": drafting.sample_from, "multinomial": lambda p: torch.multinomial(p, num_samples=1)[:, 0]}


def use(name: str) -> None:
    drafting.sample_from = batched.sample_from = SAMPLERS[name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-threads", type=int)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    target, tokenizer = load_target()
    drafter, _ = load_drafter(target)
    prompts = short_prompts(tokenizer, args.num_prompts)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  pad_token_id=tokenizer.eos_token_id)  # fmt: skip
    loop_ms: dict[str, list[float]] = {name: [] for name in SAMPLERS}
    verify_ms: dict[str, float] = {}
    current = [""]
    draft_tokens = drafting.draft_tokens

    def timed_draft_tokens(*inputs):
        start = time.perf_counter()
        proposal = draft_tokens(*inputs)
        loop_ms[current[0]].append(1e3 * (time.perf_counter() - start - proposal.forward_seconds))
        return proposal

    drafting.draft_tokens = timed_draft_tokens
    try:
        for index, prompt in enumerate([prompts[0], *prompts]):  # the first pass is a warm-up
            for name in list(SAMPLERS)[:: 1 if index % 2 else -1]:
                use(name)
                current[0] = name
                with drafter_settings(drafter, DRAFTER_ALONE):
                    target.generate(torch.tensor([prompt["input_ids"]]), assistant_model=drafter, **kwargs)
                if not index:
                    loop_ms[name].clear()
        vocab = target.config.vocab_size
        generator = torch.Generator().manual_seed(0)
        drafted = torch.randint(vocab, (4, 3), generator=generator)
        draft_logits, target_logits = torch.randn(4, 3, vocab, generator=generator), torch.randn(4, 4, vocab)
        for name in SAMPLERS:
            use(name)
            times = []
            for _ in range(50):
                start = time.perf_counter()
                batched.speculative_sampling(drafted, draft_logits, target_logits, torch.full((4,), 3))
                times.append(1e3 * (time.perf_counter() - start))
            verify_ms[name] = statistics.median(times)
    finally:
        drafting.draft_tokens = draft_tokens
        use("sample_from")
    report = {"benchmark": "sampler_ab", "machine": machine_info(), "prompts": len(prompts), "samplers": {}}
    for name in SAMPLERS:
        row = {"token_loop_ms": statistics.median(loop_ms[name]), "rounds": len(loop_ms[name]),
               "batched_verification_ms": verify_ms[name]}  # fmt: skip
        report["samplers"][name] = row
        print(f"{name}: token loop {row['token_loop_ms']:.2f} ms a drafter round (median of {row['rounds']}), "
              f"batched verification {row['batched_verification_ms']:.2f} ms (4 rows x 3 drafts)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
