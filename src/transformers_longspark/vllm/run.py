"""Runs prompts through one vLLM engine (plain, LongSpark or n-gram speculation) and writes outputs and figures.

    python -m transformers_longspark.vllm.run --target DIR --method longspark --drafter DIR \
        --prompts prompts.json --out result.json [--dtype float32] [--max-tokens 64] [--rounds single concurrent]

`prompts.json` is a list of token-id lists. Each round runs every prompt, `single` one request at a time, `concurrent`
all at once, each for `--max-tokens` tokens (one value, or one per prompt); greedy unless `--temperature` is set.
The result holds each round's output token ids, its wall time and generated tokens, vLLM's speculative-decoding
counters (drafts, draft tokens, accepted tokens: `tau = 1 + accepted / drafts`), each position's top logprobs with
`--logprobs N`, and, for LongSpark, the proposer's per-round log (see `LONGSPARK_VLLM_DRAFT_LOG`).

With `--sampled-prompts FILE --samples N`, a last round samples, at each of `--sample-temperatures`, `N` requests of
each of those prompts at once (`--sample-tokens` tokens each, drawn from the engine's generator, seeded with `--seed`):
the result's `sampled[temperature]` holds, per prompt, the `N` outputs (for tests of the output law).

The tests and `examples/serve_vllm.py` drive it; it runs in the environment where vLLM is installed
(`scripts/install_vllm.sh`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from .cpu_sampling import fix_cpu_expand
from .proposer import DRAFT_LOG_ENV, DRAFTER_ENV

# vLLM's CPU backend otherwise reserves `gpu_memory_utilization` (default 0.92) of a memory node's RAM at start-up and
# refuses to start when anything else uses that much ("Available memory on node ... is less than desired CPU memory
# utilization"); an explicit KV-cache size skips that reservation. 1 GiB holds ~23K tokens of SmolLM2-135M in fp32.
DEFAULT_KV_CACHE_BYTES = 1 << 30

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


def speculative_config(method: str, num_tokens: int) -> dict[str, Any] | None:
    if method == "plain":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": num_tokens, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if method == "longspark":
        return {
            "method": "custom_class",
            "model": "transformers_longspark.vllm.LongSparkProposer",
            "num_speculative_tokens": num_tokens,
        }
    raise ValueError(f"Unknown method {method!r}; choose plain, longspark or ngram.")


def spec_counters(llm) -> dict[str, float]:
    counts = dict.fromkeys(SPEC_COUNTERS.values(), 0.0)
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            counts[SPEC_COUNTERS[metric.name]] += float(getattr(metric, "value", 0.0))
    return counts


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if args.method == "longspark":
        os.environ[DRAFTER_ENV] = str(Path(args.drafter).resolve())
        log = Path(tempfile.mkdtemp()) / "drafts.jsonl"
        os.environ[DRAFT_LOG_ENV] = str(log)
    engine_args = dict(
        model=args.target,
        dtype=args.dtype,
        enforce_eager=True,
        seed=args.seed,
        max_model_len=args.max_model_len,
        speculative_config=speculative_config(args.method, args.num_speculative_tokens),
        disable_log_stats=False,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_bytes,
    )
    fix_cpu_expand()  # for every method (`ngram` too); reaches the engine when it runs in this process
    start = time.perf_counter()
    llm = LLM(**{k: v for k, v in engine_args.items() if v is not None})
    result: dict[str, Any] = {"method": args.method, "dtype": args.dtype, "engine_seconds": time.perf_counter() - start}
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(Path(args.prompts).read_text())]
    if len(args.max_tokens) not in (1, len(prompts)):
        raise ValueError(f"--max-tokens takes one value or one per prompt ({len(prompts)}), got {args.max_tokens}.")
    max_tokens = args.max_tokens * len(prompts) if len(args.max_tokens) == 1 else args.max_tokens
    seed = 0 if args.temperature else None
    options = dict(temperature=args.temperature, ignore_eos=args.ignore_eos, seed=seed, logprobs=args.logprobs)
    params = [SamplingParams(max_tokens=n, **options) for n in max_tokens]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    result["rounds"] = {}
    for name in args.rounds:
        before = spec_counters(llm)
        start = time.perf_counter()
        if name == "single":
            outputs = [llm.generate([p], [q], use_tqdm=False)[0] for p, q in zip(prompts, params)]
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after = spec_counters(llm)
        token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        result["rounds"][name] = {
            "token_ids": token_ids,
            "seconds": seconds,
            "new_tokens": sum(map(len, token_ids)),
            "request_ids": [o.request_id for o in outputs],
            **{k: after[k] - before[k] for k in after},
        }
        if args.logprobs:  # per request and position: the top (token, logprob) pairs, best first
            result["rounds"][name]["top_logprobs"] = [
                [
                    sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda x: -x[1])[: args.logprobs]
                    for step in o.outputs[0].logprobs
                ]
                for o in outputs
            ]
    if args.sampled_prompts:
        result["sampled"] = sample(llm, args)
    if args.method == "longspark" and log.exists():
        result["draft_log"] = [json.loads(line) for line in log.read_text().splitlines()]
    return result


def sample(llm, args: argparse.Namespace) -> dict[str, Any]:
    """`--samples` requests of each `--sampled-prompts` prompt at each `--sample-temperatures`, all at once. Returns,
    per temperature, the outputs per prompt and the request ids (`{"token_ids": [[ids] * N] * prompts, ...}`).

    The requests draw from the engine's generator (seeded with `--seed`), not from seeds of their own: vLLM 0.32's CPU
    runner fails on seeded requests whose prefill is split into chunks ("CPU Generator does not use offset")."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampled_prompts = json.loads(Path(args.sampled_prompts).read_text())
    jobs = [(temperature, p) for temperature in args.sample_temperatures for p in range(len(sampled_prompts))]
    prompts, params = [], []
    for temperature, p in jobs:
        sampling = SamplingParams(temperature=temperature, max_tokens=args.sample_tokens, ignore_eos=True)
        prompts += [TokensPrompt(prompt_token_ids=sampled_prompts[p])] * args.samples
        params += [sampling] * args.samples
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result: dict[str, Any] = {}
    for n, (temperature, _) in enumerate(jobs):
        chunk = outputs[n * args.samples : (n + 1) * args.samples]
        entry = result.setdefault(str(temperature), {"token_ids": [], "request_ids": []})
        entry["token_ids"].append([list(o.outputs[0].token_ids) for o in chunk])
        entry["request_ids"].append([o.request_id for o in chunk])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="target model folder (safetensors)")
    parser.add_argument("--method", choices=["plain", "longspark", "ngram"], required=True)
    parser.add_argument("--drafter", help="LongSpark drafter folder (with --method longspark)")
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--out", required=True, help="result JSON")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[64], help="one value, or one per prompt")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--logprobs", type=int, help="also record each position's top-N logprobs")
    parser.add_argument("--rounds", nargs="+", default=["concurrent"], choices=["single", "concurrent"])
    parser.add_argument("--num-speculative-tokens", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0, help="the engine's seed (sampled requests draw from it)")
    parser.add_argument("--sampled-prompts", help="JSON list of token-id lists for the sampled round")
    parser.add_argument("--samples", type=int, default=100, help="sampled requests per prompt and temperature")
    parser.add_argument("--sample-temperatures", type=float, nargs="+", default=[1.0])
    parser.add_argument("--sample-tokens", type=int, default=3, help="tokens per sampled request")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, help="prefill chunk budget per step")
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=DEFAULT_KV_CACHE_BYTES,
        help="KV-cache size in bytes (default 1 GiB, instead of vLLM's 92%% of RAM; small values force preemption)",
    )
    args = parser.parse_args(argv)
    if args.method == "longspark" and not args.drafter:
        parser.error("--method longspark needs --drafter DIR")
    Path(args.out).write_text(json.dumps(run(args)))


if __name__ == "__main__":
    main()
