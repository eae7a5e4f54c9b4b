"""`longspark bench ...`: dispatch of the benchmark subcommands (their arguments: `arguments.py`, what each runs:
`runners.py`).

Parsing imports nothing heavy (`longspark bench --help` answers without torch). The benchmark modules are imported at
one point, `_runners()`: when a benchmark runs, after every path given has been checked, or on first access to one of
their names as an attribute of this module (e.g. `cli.run_speed_benchmark`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from ..files import DRAFTER_FOLDER_FIX, TARGET_FOLDER_FIX, require_folder, require_path
from .arguments import DESCRIPTION, add_bench_arguments


def _runners() -> ModuleType:
    """The one lazy-import point of the benchmark modules (torch, transformers)."""
    return importlib.import_module(f"{__package__}.runners")


def __getattr__(name: str) -> Any:
    """The entry points and what the runners use (`cli.run_speed_benchmark`, ...), imported on first access."""
    if name.startswith("_") or not hasattr(_runners(), name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(_runners(), name)


def parse_variants(specs: Sequence[Sequence[str]]) -> dict[str, dict[str, Any]]:
    """`--variant NAME KEY=VALUE ...` (repeated) -> `{NAME: {KEY: VALUE}}`; VALUE is read as JSON, else kept as text."""
    variants: dict[str, dict[str, Any]] = {}
    for name, *pairs in specs:
        if name in variants or "=" in name or not pairs or any("=" not in pair for pair in pairs):
            raise ValueError(
                f"--variant {' '.join([name, *pairs])}: give a new name, then one or more KEY=VALUE settings, e.g. "
                "--variant whole_blocks assistant_confidence_threshold=0 block_confidence_threshold=0."
            )
        variants[name] = {key: _setting_value(value) for key, value in (pair.split("=", 1) for pair in pairs)}
    return variants


def _setting_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def check_paths(args: argparse.Namespace) -> None:
    """Rejects bad paths and conflicting options before any model loads: a missing target, drafter or held-out
    folder, and an output file whose folder cannot be made or that is a folder."""
    if getattr(args, "synthetic_target", None) and args.target:
        raise ValueError("Pass either --target or --synthetic-target, not both.")
    if args.target:
        require_folder(args.target, "Target", TARGET_FOLDER_FIX)
    if isinstance(args.drafter, list):  # `bench tau`: NAME=SOURCE, repeatable
        for spec in args.drafter:
            name, _, source = spec.partition("=")
            if not name or not source:
                raise ValueError(f"--drafter {spec}: pass NAME=FOLDER, NAME=warm-start or NAME=random.")
            if source not in ("warm-start", "random"):
                require_folder(source, "Drafter", DRAFTER_FOLDER_FIX)
    elif args.drafter:
        require_folder(args.drafter, "Drafter", DRAFTER_FOLDER_FIX)
    if getattr(args, "held_out", None) is not None:
        fix = "pass a folder of *.jsonl records written by `longspark regenerate --held-out`, or no --held-out for "
        require_path(args.held_out, "Held-out folder", fix + "the default.")
    for flag in ("json", "markdown", "plot"):
        path = getattr(args, flag, None)
        if path is None:
            continue
        if path.is_dir():
            raise IsADirectoryError(f"--{flag} {path} is a folder; pass a file name.")
        path.parent.mkdir(parents=True, exist_ok=True)


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the `longspark bench` subcommand in `args` (speed when none), prints its table, writes its files."""
    check_paths(args)
    return _runners().run(getattr(args, "bench_command", None) or "speed", args)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m transformers_longspark.benchmarks ...`: the same as `longspark bench ...`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="longspark bench", description=DESCRIPTION)
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["longspark", "bench", *argv])
    run_bench(args)


__all__ = ["add_bench_arguments", "main", "parse_variants", "run_bench"]
