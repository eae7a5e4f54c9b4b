"""Held-out greedy tau and per-position acceptance of several SmolLM2 drafters, on the same prompts.

Short chat/maths/code prompts (the benchmark's held-out set) and long code (held-out standard-library files cut to
`--long-lengths` tokens), `--max-new-tokens` greedy tokens each. Every drafter decodes every prompt; greedy outputs
must be identical (decoding is lossless), and the script checks it. Figures come from `drafter.drafting_stats`:
`tau = (new tokens - 1) / rounds` summed over prompts, and the per-position acceptance `P(drafts 1..i accepted)`.

    python scripts/compare_tau.py --drafter shipped=model_cards/longspark-smollm2-135m-instruct \
        --drafter warm-0=warm-start --drafter random-0=random --json runs/tau.json

A drafter is a saved folder, or `warm-start` / `random` for a fresh drafter of the shipped architecture (step 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def fresh_drafter(kind: str, target):
    from transformers_longspark import LongSparkConfig, LongSparkDrafterModel
    from transformers_longspark.loading import SHIPPED_DRAFTER_DIR
    from transformers_longspark.training.warm_start import init_from_target, warm_start_config

    shipped = LongSparkConfig.from_pretrained(SHIPPED_DRAFTER_DIR)
    fields = dict(target_layer_ids=shipped.target_layer_ids, markov_rank=shipped.markov_rank)
    if kind == "warm-start":
        drafter = init_from_target(LongSparkDrafterModel(warm_start_config(target, **fields)), target)
    else:
        torch.manual_seed(0)
        drafter = LongSparkDrafterModel(LongSparkConfig.from_target_config(target.config, **fields))
    drafter.generation_config = LongSparkDrafterModel.from_pretrained(SHIPPED_DRAFTER_DIR).generation_config
    return drafter.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", action="append", required=True, help="NAME=FOLDER, or NAME=warm-start|random")
    parser.add_argument("--num-short-prompts", type=int, default=6, help="held-out chat/maths/code prompts")
    parser.add_argument("--long-lengths", type=int, nargs="*", default=[4096], help="long-code prefix lengths")
    parser.add_argument("--num-long-prompts", type=int, default=2, help="held-out code files")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--num-threads", type=int, default=2, help="torch threads")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)

    from transformers_longspark import DraftingStats, LongSparkDrafterModel
    from transformers_longspark.benchmarks.prompts import long_context_prompts, short_prompts
    from transformers_longspark.loading import load_smollm2

    target, tokenizer = load_smollm2()
    drafters = {}
    for spec in args.drafter:
        name, _, source = spec.partition("=")
        if source in ("warm-start", "random"):
            drafters[name] = fresh_drafter(source, target)
        else:
            drafters[name] = LongSparkDrafterModel.from_pretrained(source, dtype=torch.float32).eval()
    workloads = {"short": short_prompts(tokenizer, args.num_short_prompts)}
    if args.long_lengths and args.num_long_prompts:
        workloads["long"] = long_context_prompts(tokenizer, args.long_lengths, args.num_long_prompts)
    results = {}
    for workload, prompts in workloads.items():
        for name, drafter in drafters.items():
            new_tokens, total, outputs = 0, DraftingStats(), []
            for prompt in prompts:
                ids = torch.tensor([prompt["input_ids"]])
                out = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, assistant_model=drafter)
                outputs.append(out[0, ids.shape[1] :].tolist())
                new_tokens += out.shape[1] - ids.shape[1] - 1
                total.rounds += drafter.drafting_stats.rounds
                histogram = drafter.drafting_stats.accepted_histogram
                total.record_accepted([k for k, count in enumerate(histogram) for _ in range(count)])
            rounds, acceptance = total.rounds, total.acceptance_rates()
            results.setdefault(workload, {})[name] = {"tau": new_tokens / rounds, "acceptance": acceptance,
                                                      "outputs": outputs}  # fmt: skip
            print(f"{workload:6s} {name:16s} tau {new_tokens / rounds:.3f}  acceptance "
                  + " ".join(f"{a:.2f}" for a in acceptance[:6]), flush=True)  # fmt: skip
        reference = next(iter(results[workload].values()))["outputs"]
        assert all(r["outputs"] == reference for r in results[workload].values()), "greedy outputs differ"
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
