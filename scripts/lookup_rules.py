#!/usr/bin/env python
"""Which continuation should the lookup source copy? The most recent occurrence of the matched suffix, or the most
frequent next token after it? Measured on held-out long code from plain decoding, no drafter involved.

Decodes the first 2 held-out long-code prompts (4K and 8K tokens) with plain `generate`, greedy and sampled at T=1
(3 seeds), 64 new tokens, and at each round after the first scores the first copied token of three rules over the
longest suffix of 2-6 tokens seen before: `recent` (what `SuffixIndex` proposes), `frequent` (the most frequent next
token among all earlier occurrences of that suffix) and `backoff` (the most frequent next token after the longest
suffix seen at least twice). The score is the target probability of the token (T=1: the chance that speculative
sampling keeps a point-mass proposal of it) or whether it is the argmax (greedy); `_nK` rows split by matched length
(4 = 4 or more). Output: `results/lookup_rules.txt`.

    python scripts/lookup_rules.py
"""

from __future__ import annotations

import collections

import torch


def score_rules(prompt_ids: list[int], new: list[int], laws: torch.Tensor, sampled: bool, scores: dict) -> None:
    """Adds, per rule, the score of its first copied token at each round after the first new token."""
    tokens = list(prompt_ids)
    counts, recent = collections.defaultdict(collections.Counter), {}

    def add(start: int, end: int) -> None:  # the n-grams that end just before positions start..end-1
        for position in range(start, end):
            for n in range(2, min(6, position) + 1):
                gram = tuple(tokens[position - n : position])
                counts[gram][tokens[position]] += 1
                recent[gram] = tokens[position]

    add(0, len(tokens))
    mode = "T=1" if sampled else "greedy"
    for i in range(1, len(new)):
        tokens.append(new[i - 1])
        add(len(tokens) - 1, len(tokens))
        grams = [tuple(tokens[len(tokens) - n :]) for n in range(6, 1, -1)]
        matched = next((gram for gram in grams if gram in recent), None)
        if matched is None:
            continue
        repeated = next((g for g in grams if g in counts and sum(counts[g].values()) >= 2), None)
        choices = {
            "recent": recent[matched],
            "frequent": counts[matched].most_common(1)[0][0],
            "backoff": recent[matched] if repeated is None else counts[repeated].most_common(1)[0][0],
        }
        for rule, token in choices.items():
            value = float(laws[i, token]) if sampled else float(laws[i].argmax() == token)
            scores[(mode, rule)].append(value)
            if rule != "backoff":
                scores[(mode, f"{rule}_n{min(len(matched), 4)}")].append(value)


def main() -> None:
    torch.set_num_threads(2)
    from transformers_longspark.benchmarks.prompts import long_context_prompts
    from transformers_longspark.loading import load_smollm2

    target, tokenizer = load_smollm2()
    prompts = long_context_prompts(tokenizer, [4096, 8192], 2)
    scores = collections.defaultdict(list)
    for sampled in (False, True):
        sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sampled else dict(do_sample=False)
        for prompt in prompts:
            for seed in range(3 if sampled else 1):
                torch.manual_seed(seed)
                ids = torch.tensor([prompt["input_ids"]])
                out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, output_logits=True,
                                      return_dict_in_generate=True, **sampling)  # fmt: skip
                laws = torch.stack(out.logits, 1)[0].float().softmax(-1)
                score_rules(prompt["input_ids"], out.sequences[0, ids.shape[1] :].tolist(), laws, sampled, scores)
    for key, values in sorted(scores.items()):
        print(key, len(values), round(sum(values) / len(values), 3))


if __name__ == "__main__":
    main()
