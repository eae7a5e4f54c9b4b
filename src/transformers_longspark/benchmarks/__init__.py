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
* `run_tau_benchmark` (`longspark bench tau`): held-out greedy tau and per-position acceptance of several drafters
  (`--drafter NAME=FOLDER`, or `NAME=warm-start` / `NAME=random`) on the same prompts; greedy outputs checked equal.
* `run_batched_benchmark` (`longspark bench --batch-sizes 1 2 4 8`): plain batched `generate` vs LongSpark batched
  `generate` (`inference/batched.py`) per batch size, on left-padded batches of the short and long prompts.
* `run_memory_benchmark` (`longspark bench memory`): peak RSS of plain vs assisted `generate` at several prompt
  lengths, each measured in a fresh subprocess.

`--synthetic-target qwen3-8b` (also 4b, 14b) times drafting and verification on a random-weight target of the real
shapes, built directly on `--device` in `--dtype`: see `scripts/gpu_benchmarks.sh`.

Each entry point takes the models and prompts, and one frozen settings object (`SpeedSettings`,
`DraftingCostSettings`, `VerifyCostSettings`, `TauSettings`, `BatchedSettings`, `MemorySettings`: `.settings`), which
checks its values when built; `longspark bench` builds it from its options.

This module's face is those entry points, their settings and the command (`main`, `run_bench`, `add_bench_arguments`);
everything else lives in its submodule (`.speed_summary`, `.report`, `.prompts`, ...). The entry points are imported
on first use through `cli` (its one lazy-import point), so that `longspark --help` imports neither torch nor
transformers.
"""

from __future__ import annotations

from typing import Any

from . import cli
from .cli import add_bench_arguments, main, run_bench
from .settings import (
    BatchedSettings,
    DraftingCostSettings,
    MemorySettings,
    SpeedSettings,
    TauSettings,
    VerifyCostSettings,
)

ENTRY_POINTS = ("run_batched_benchmark", "run_drafting_cost", "run_memory_benchmark", "run_speed_benchmark",
                "run_tau_benchmark", "run_verify_cost")  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in ENTRY_POINTS:
        return getattr(cli, name)  # `cli.__getattr__` imports it on first use
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *ENTRY_POINTS})


__all__ = ["add_bench_arguments", "main", "run_bench", *ENTRY_POINTS, "BatchedSettings", "DraftingCostSettings",
           "MemorySettings", "SpeedSettings", "TauSettings", "VerifyCostSettings"]  # fmt: skip
