"""Benchmarks: decoding speed side by side, drafting and verification cost vs prefix length, drafter peak memory.

Each is a Python function and a `longspark bench` subcommand:

* `run_speed_benchmark` (`longspark bench` / `longspark bench speed`): plain greedy and sampled `generate`, prompt
  lookup (stock and on the fast verification path), LongSpark (fast and stock verification) and the full-prefix
  baseline drafter on the same prompts in one process, interleaved per prompt so that machine noise hits every
  method alike. Reports tau, tokens/s, speedup over plain `generate` of the same mode, time per output token,
  drafting and verification time per round and greedy losslessness.
* `run_drafting_cost` (`longspark bench drafting-cost`): per-round drafting time and persistent drafter context-state
  bytes vs prefix length, LongSpark (fixed) vs the full-prefix baseline (grows), on real-target prefixes and on
  synthetic caches up to 128K.
* `run_verify_cost` (`longspark bench verify-cost`): one cached target forward of `k` tokens vs prefix length,
  transformers' stock path vs `verification.fast_verification`.
* `run_batched_benchmark` (`longspark bench --batch-sizes 1 2 4 8`): plain batched `generate` vs LongSpark batched
  `generate` (`transformers_longspark.batched`) per batch size, on left-padded batches of the short and long prompts.
* `run_memory_benchmark` (`longspark bench memory`): peak RSS of plain vs assisted `generate` at several prompt
  lengths, each measured in a fresh subprocess.

`--synthetic-target qwen3-8b` (also 4b, 14b) times drafting and verification on a random-weight target of the real
shapes, built directly on `--device` in `--dtype`: see `scripts/gpu_benchmarks.sh`.
"""

from .batched import format_batched, left_pad_batch, new_token_counts, run_batched_benchmark
from .cli import add_bench_arguments, main, run_bench
from .common import (
    Timings,
    count_forward_calls,
    machine_info,
    measure,
    prefill,
    synchronize,
    time_forward_calls,
    timed_call,
    write_json,
)
from .drafting_cost import (
    DEFAULT_PREFIX_LENGTHS,
    DEFAULT_SYNTHETIC_PREFIX_LENGTHS,
    SelectedLayersCache,
    full_prefix_state_bytes,
    run_drafting_cost,
    synthetic_cache,
)
from .memory import run_memory_benchmark
from .models import (
    SYNTHETIC_TARGETS,
    build_random_drafter,
    build_synthetic_target,
    make_full_prefix_drafter,
    synthetic_target_config,
)
from .prompts import (
    DEFAULT_LONG_LENGTHS,
    HELD_OUT_DIR,
    SHORT_SOURCES,
    chat_prompt_ids,
    long_context_prompts,
    short_prompts,
    stdlib_token_ids,
)
from .report import (
    format_drafting_cost,
    format_markdown,
    format_memory,
    format_verify_cost,
    plot_drafting_cost,
    plot_verify_cost,
)
from .speed import (
    DEFAULT_METHODS,
    METHOD_LABELS,
    METHODS,
    MODES,
    accepted_length,
    add_speedups,
    new_tokens_from_round_log,
    run_speed_benchmark,
    summarize_runs,
)
from .verify_cost import DEFAULT_NUM_TOKENS, DEFAULT_VERIFY_PREFIX_LENGTHS, reserved_copy, run_verify_cost

__all__ = [
    "DEFAULT_LONG_LENGTHS",
    "DEFAULT_METHODS",
    "DEFAULT_NUM_TOKENS",
    "DEFAULT_PREFIX_LENGTHS",
    "DEFAULT_SYNTHETIC_PREFIX_LENGTHS",
    "DEFAULT_VERIFY_PREFIX_LENGTHS",
    "HELD_OUT_DIR",
    "METHODS",
    "METHOD_LABELS",
    "MODES",
    "SHORT_SOURCES",
    "SYNTHETIC_TARGETS",
    "SelectedLayersCache",
    "Timings",
    "accepted_length",
    "add_speedups",
    "add_bench_arguments",
    "build_random_drafter",
    "build_synthetic_target",
    "chat_prompt_ids",
    "count_forward_calls",
    "format_batched",
    "format_drafting_cost",
    "format_markdown",
    "format_memory",
    "format_verify_cost",
    "full_prefix_state_bytes",
    "left_pad_batch",
    "long_context_prompts",
    "machine_info",
    "main",
    "make_full_prefix_drafter",
    "measure",
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
