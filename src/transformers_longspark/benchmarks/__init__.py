"""Benchmarks: decoding speed side by side, drafting and verification cost vs prefix length, drafter peak memory.

Each is a Python function and a `longspark bench` subcommand:

* `run_speed_benchmark` (`longspark bench` / `longspark bench speed`): plain greedy and sampled `generate` (stock,
  on the fast verification path and with a static cache), prompt lookup (stock and on the fast verification path),
  LongSpark (as shipped, lookup source off and on, fast and stock verification) and the full-prefix baseline drafter
  on the same prompts in one process, interleaved per prompt so that machine noise hits every method alike. Reports
  tau, tokens/s, speedup over plain `generate` of the same mode and over the fastest plain path, time per output
  token, drafting and verification time per round, lookup rounds, per-position acceptance and greedy losslessness.
* `run_drafting_cost` (`longspark bench drafting-cost`): per-round drafting time and persistent drafter context-state
  bytes vs prefix length, LongSpark (fixed) vs the full-prefix baseline (grows), on real-target prefixes and on
  synthetic caches up to 128K; with `--lookup`, also the round with the lookup source's index update and query, and
  the index bytes per request.
* `run_verify_cost` (`longspark bench verify-cost`): one cached target forward of `k` tokens vs prefix length,
  transformers' stock path vs `verification.fast_verification`.
* `run_batched_benchmark` (`longspark bench --batch-sizes 1 2 4 8`): plain batched `generate` vs LongSpark batched
  `generate` (`inference/batched.py`) per batch size, on left-padded batches of the short and long prompts.
* `run_memory_benchmark` (`longspark bench memory`): peak RSS of plain vs assisted `generate` at several prompt
  lengths, each measured in a fresh subprocess.

`--synthetic-target qwen3-8b` (also 4b, 14b) times drafting and verification on a random-weight target of the real
shapes, built directly on `--device` in `--dtype`: see `scripts/gpu_benchmarks.sh`.
"""

from __future__ import annotations

import importlib
from typing import Any

from .cli import add_bench_arguments, main, run_bench

# Public name -> the submodule that defines it, imported on first use (the CLI's argument parsing needs none of them).
_LAZY_NAMES = {
    "format_batched": "batched",
    "left_pad_batch": "batched",
    "new_token_counts": "batched",
    "run_batched_benchmark": "batched",
    "Timings": "common",
    "count_forward_calls": "common",
    "generation_config_fields": "common",
    "machine_info": "common",
    "measure": "common",
    "prefill": "common",
    "synchronize": "common",
    "time_forward_calls": "common",
    "timed_call": "common",
    "write_json": "common",
    "DEFAULT_PREFIX_LENGTHS": "defaults",
    "DEFAULT_SYNTHETIC_PREFIX_LENGTHS": "defaults",
    "SelectedLayersCache": "drafting_cost",
    "full_prefix_state_bytes": "drafting_cost",
    "run_drafting_cost": "drafting_cost",
    "synthetic_cache": "drafting_cost",
    "run_memory_benchmark": "memory",
    "SYNTHETIC_TARGETS": "defaults",
    "build_random_drafter": "models",
    "build_synthetic_target": "models",
    "make_full_prefix_drafter": "models",
    "synthetic_target_config": "models",
    "DEFAULT_LONG_LENGTHS": "defaults",
    "HELD_OUT_DIR": "defaults",
    "SHORT_SOURCES": "defaults",
    "chat_prompt_ids": "prompts",
    "long_context_prompts": "prompts",
    "short_prompts": "prompts",
    "stdlib_token_ids": "prompts",
    "format_drafting_cost": "report",
    "format_markdown": "report",
    "format_memory": "report",
    "format_verify_cost": "report",
    "plot_drafting_cost": "report",
    "plot_verify_cost": "report",
    "DEFAULT_METHODS": "speed",
    "DRAFTER_METHODS": "speed",
    "drafter_method_settings": "speed",
    "run_speed_benchmark": "speed",
    "METHODS": "defaults",
    "MODES": "defaults",
    "PLAIN_METHODS": "defaults",
    "DEFAULT_LOOKUP_MIN_MATCH": "defaults",
    "DEFAULT_LOOKUP_NUM_TOKENS": "defaults",
    "METHOD_LABELS": "speed_summary",
    "accepted_length": "speed_summary",
    "add_speedups": "speed_summary",
    "best_plain_method": "speed_summary",
    "merge_histograms": "speed_summary",
    "new_tokens_from_round_log": "speed_summary",
    "summarize_runs": "speed_summary",
    "DEFAULT_NUM_TOKENS": "defaults",
    "DEFAULT_VERIFY_PREFIX_LENGTHS": "defaults",
    "reserved_copy": "verify_cost",
    "run_verify_cost": "verify_cost",
}


def __getattr__(name: str) -> Any:
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_NAMES})


__all__ = [
    "DEFAULT_LONG_LENGTHS",
    "DEFAULT_LOOKUP_MIN_MATCH",
    "DEFAULT_LOOKUP_NUM_TOKENS",
    "DEFAULT_METHODS",
    "DEFAULT_NUM_TOKENS",
    "DEFAULT_PREFIX_LENGTHS",
    "DEFAULT_SYNTHETIC_PREFIX_LENGTHS",
    "DEFAULT_VERIFY_PREFIX_LENGTHS",
    "DRAFTER_METHODS",
    "HELD_OUT_DIR",
    "METHODS",
    "METHOD_LABELS",
    "MODES",
    "PLAIN_METHODS",
    "SHORT_SOURCES",
    "SYNTHETIC_TARGETS",
    "SelectedLayersCache",
    "Timings",
    "accepted_length",
    "add_speedups",
    "add_bench_arguments",
    "best_plain_method",
    "build_random_drafter",
    "build_synthetic_target",
    "chat_prompt_ids",
    "count_forward_calls",
    "drafter_method_settings",
    "format_batched",
    "format_drafting_cost",
    "format_markdown",
    "format_memory",
    "format_verify_cost",
    "full_prefix_state_bytes",
    "generation_config_fields",
    "left_pad_batch",
    "long_context_prompts",
    "machine_info",
    "main",
    "make_full_prefix_drafter",
    "measure",
    "merge_histograms",
    "new_token_counts",
    "new_tokens_from_round_log",
    "plot_drafting_cost",
    "plot_verify_cost",
    "prefill",
    "reserved_copy",
    "run_batched_benchmark",
    "run_bench",
    "run_drafting_cost",
    "run_memory_benchmark",
    "run_speed_benchmark",
    "run_verify_cost",
    "short_prompts",
    "stdlib_token_ids",
    "summarize_runs",
    "synchronize",
    "synthetic_cache",
    "synthetic_target_config",
    "time_forward_calls",
    "timed_call",
    "write_json",
]
