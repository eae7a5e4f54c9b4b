"""Benchmarks: decoding speed side by side, drafting and verification cost vs prefix length, drafter peak memory.

Each is a Python function and a `longspark bench` subcommand (what each measures: its module's docstring):

* `run_speed_benchmark` (`longspark bench` / `bench speed`, `speed.py`): the plain paths, prompt lookup, LongSpark (and
  what each of its sources adds, and A/B variants) and the full-prefix drafter on the same prompts, interleaved.
* `run_batched_benchmark` (`bench --batch-sizes 1 2 4 8`, `batched.py`): plain vs LongSpark batched `generate`.
* `run_drafting_cost` (`bench drafting-cost`, `drafting_cost.py`): drafting time per round and drafter context-state
  bytes vs prefix length, LongSpark (fixed) vs the full-prefix baseline (grows), up to 128K on synthetic caches.
* `run_verify_cost` (`bench verify-cost`, `verify_cost.py`): one cached target forward of `k` tokens vs prefix
  length, transformers' stock path vs `verification.fast_verification`.
* `run_tau_benchmark` (`bench tau`, `tau.py`): held-out greedy tau and per-position acceptance of several drafters.
* `run_memory_benchmark` (`bench memory`, `memory.py`): peak RSS of plain vs assisted `generate`, fresh processes.

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
