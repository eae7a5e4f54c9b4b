"""Benchmarks, each a Python function taking the models, the prompts and one frozen settings object (`.settings`),
and a `longspark bench` subcommand:

* `run_speed_benchmark` (`longspark bench` / `bench speed`, `speed.py`): decoding speed side by side;
* `run_batched_benchmark` (`bench --batch-sizes 1 2 4 8`, `batched.py`): plain vs LongSpark batched `generate`;
* `run_drafting_cost` (`bench drafting-cost`, `drafting_cost.py`): drafting time and drafter state vs prefix length;
* `run_verify_cost` (`bench verify-cost`, `verify_cost.py`): a cached target forward of `k` tokens vs prefix length;
* `run_tau_benchmark` (`bench tau`, `tau.py`): held-out greedy tau and per-position acceptance of several drafters;
* `run_memory_benchmark` (`bench memory`, `memory.py`): peak RSS of plain vs assisted `generate`, fresh processes.

The entry points are imported on first use (`cli.runners_module`, the one lazy-import point), so that `longspark --help`
imports neither torch nor transformers; everything else lives in its submodule.
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
        return getattr(cli.runners_module(), name)  # imported on first use
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *ENTRY_POINTS})


__all__ = ["add_bench_arguments", "main", "run_bench", *ENTRY_POINTS, "BatchedSettings", "DraftingCostSettings",
           "MemorySettings", "SpeedSettings", "TauSettings", "VerifyCostSettings"]  # fmt: skip
