#!/usr/bin/env python
"""How much can a lookup source add on held-out long code? An upper bound from plain decoding, no drafter involved.

Decodes each held-out long-code prompt with plain `generate` (greedy, and sampled at T=1 with several seeds) and
records the target's law at every new position. At each round after the first token it queries the package's
`SuffixIndex` over the prompt and the tokens so far, as the lookup source would: the share of rounds with a match of
at least `--min-match` tokens, and the target probability `p` of the first copied token (the chance that speculative
sampling keeps a point-mass proposal of it; greedy: whether it is the argmax). With `a` the mean of `p`, a lookup
round proposing its best `k` tokens (geometric continuation at rate `a`, the shipped cost model) yields
`RoundCosts.lookup_value(a)` tokens per step, and a plain step 1; so over all rounds lookup can raise tokens per step by
at most `share * (value - 1)`, whatever the drafter does on the other rounds.

    python scripts/lookup_bound.py [--num-threads 2] [--seeds 3] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json

import torch


def first_copy_probabilities(target, prompt_ids: list[int], sampled: bool, seed: int, args) -> list[float | None]:
    """Per round after the first new token: `p` of the first copied token, or None where no suffix matches."""
    from transformers_longspark.inference.lookup import SuffixIndex

    torch.manual_seed(seed)
    ids = torch.tensor([prompt_ids])
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sampled else dict(do_sample=False)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                          output_logits=True, return_dict_in_generate=True, **sampling)  # fmt: skip
    new = out.sequences[0, ids.shape[1] :].tolist()
    laws = torch.stack(out.logits, 1)[0].float().softmax(-1)  # (new tokens, V): the law of each new token
    index, rows = SuffixIndex(args.min_match, 6), []
    index.extend(prompt_ids)
    for i in range(1, len(new)):
        index.extend([new[i - 1]])  # the anchor of round i
        continuation, matched = index.continuation(1)
        if not matched:
            rows.append(None)
        elif sampled:
            rows.append(float(laws[i, continuation[0]]))
        else:
            rows.append(float(laws[i].argmax() == continuation[0]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=3, help="sampled continuations per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--min-match", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)

    from transformers_longspark import LongSparkDrafterModel
    from transformers_longspark.benchmarks.prompts import long_context_prompts
    from transformers_longspark.inference.calibration import calibrated
    from transformers_longspark.loading import SHIPPED_DRAFTER_DIR, load_smollm2

    target, tokenizer = load_smollm2()
    drafter = LongSparkDrafterModel.from_pretrained(SHIPPED_DRAFTER_DIR, dtype=target.dtype)
    costs = calibrated(target, drafter).costs  # the verification costs of this machine
    prompts = long_context_prompts(tokenizer, args.lengths, len(args.lengths))
    min_matches = args.min_match
    for sampled in (False, True):
        for min_match in min_matches:
            args.min_match = min_match
            rows = [row for p in prompts for seed in range(args.seeds if sampled else 1)
                    for row in first_copy_probabilities(target, p["input_ids"], sampled, seed, args)]  # fmt: skip
            matched = [p for p in rows if p is not None]
            share, rate = len(matched) / len(rows), sum(matched) / max(1, len(matched))
            value, k = costs.lookup_value(rate, 10)
            print(json.dumps({"mode": "T=1" if sampled else "greedy", "min_match": min_match, "rounds": len(rows),
                              "matched_share": round(share, 3), "first_copy_acceptance": round(rate, 3),
                              "best_k": k, "lookup_round_tokens_per_step": round(value, 3),
                              "bound": round(1 + share * max(0.0, value - 1), 3)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
