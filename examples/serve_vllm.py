"""Serve SmolLM2-135M-Instruct with vLLM and the shipped LongSpark drafter, side by side with plain vLLM and n-gram.

    bash scripts/install_vllm.sh                           # once: vLLM for CPU in .venv-vllm/
    .venv-vllm/bin/python examples/serve_vllm.py [--max-tokens 96] [--long-prompt-tokens 2048] [--dtype float32]
                                                 [--json FILE] [--verbose]

The LongSpark part is three lines: the drafter folder in `LONGSPARK_DRAFTER`, and the proposer class as vLLM's
`custom_class` speculative method (it needs `enforce_eager=True`: it reads hidden states with forward hooks). Two
requests are served at once, a chat question and a long-code continuation (a Python standard-library file held out of
the drafter's training). For each engine it prints tokens/s (both requests, greedy) and vLLM's own acceptance counters
(`tau = 1 + accepted / drafts`), and whether the outputs are identical to plain vLLM's: the table comes last, after
LongSpark's two outputs. vLLM's own logs are cut to warnings (`--verbose` keeps them); `--json FILE` also writes the
figures. See docs/serving.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from transformers_longspark.benchmarks.common import machine_info
from transformers_longspark.loading import SHIPPED_DRAFTER_DIR, smollm2_dir
from transformers_longspark.vllm.run import DEFAULT_KV_CACHE_BYTES, spec_counters, speculative_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--long-prompt-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--drafter", default=str(SHIPPED_DRAFTER_DIR))
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=DEFAULT_KV_CACHE_BYTES,
        help="KV-cache size (default 1 GiB; vLLM's own default reserves 92%% of RAM)",
    )
    parser.add_argument("--json", type=Path, help="also write the table's figures (and the settings) to this file")
    parser.add_argument("--verbose", action="store_true", help="keep vLLM's info logs (engine start-up, shutdown)")
    args = parser.parse_args()

    # vLLM reads its log level when first imported (and its spawned workers inherit the environment): without this,
    # each of the three engines prints ~60 lines of start-up and shutdown logs around the results.
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from transformers_longspark.benchmarks.prompts import long_context_prompts

    os.environ["LONGSPARK_DRAFTER"] = args.drafter  # read by LongSparkProposer in vLLM's worker
    target = str(smollm2_dir())
    results, texts = {}, []
    for method in ("plain", "ngram", "longspark"):
        llm = LLM(
            target, dtype=args.dtype, enforce_eager=True, max_model_len=4096, disable_log_stats=False,
            kv_cache_memory_bytes=args.kv_cache_bytes, speculative_config=speculative_config(method, num_tokens=7),
        )  # fmt: skip
        if not results:  # the same two requests for every engine
            tokenizer = llm.get_tokenizer()
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}],
                add_generation_prompt=True, tokenize=True, return_dict=True,
            )["input_ids"]  # fmt: skip
            code = long_context_prompts(tokenizer, [args.long_prompt_tokens], num_prompts=1)[0]
            prompts = [TokensPrompt(prompt_token_ids=list(chat)), TokensPrompt(prompt_token_ids=code["input_ids"])]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        before = spec_counters(llm)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        counts = {k: v - before[k] for k, v in spec_counters(llm).items()}
        token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        results[method] = (token_ids, sum(map(len, token_ids)) / seconds, counts)
        if method == "longspark":
            texts = [outputs[0].outputs[0].text.strip(), outputs[1].outputs[0].text.strip()[:600]]
        del llm

    print("\n=== chat (LongSpark) ===\n" + texts[0])
    print("\n=== long-code continuation (LongSpark) ===\n" + texts[1])
    plain_ids, plain_speed, _ = results["plain"]
    table = {}
    for method, (token_ids, speed, counts) in results.items():
        table[method] = {
            "identical_to_plain": token_ids == plain_ids,
            "tokens_per_s": speed,
            "speedup": speed / plain_speed,
            "tau": 1 + counts["accepted_tokens"] / counts["drafts"] if counts["drafts"] else None,
            **counts,
        }
    print(f"\n{'engine':<12}{'identical to plain':>20}{'tokens/s':>10}{'speedup':>9}{'tau':>7}")
    for method, row in table.items():
        tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
        identical = "yes" if row["identical_to_plain"] else "NO"
        print(f"{method:<12}{identical:>20}{row['tokens_per_s']:>10.1f}{row['speedup']:>8.2f}x{tau:>7}")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "verbose")}
        report = {"benchmark": "vllm_example", "settings": settings, "engines": table, "machine": machine_info()}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nWrote {args.json}")


if __name__ == "__main__":  # vLLM spawns its workers: everything runs under this guard
    main()
