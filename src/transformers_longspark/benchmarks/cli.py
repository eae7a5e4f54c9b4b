"""`longspark bench ...`: the options of the speed comparison (the default command) and of its subcommands, and their
dispatch (what each runs: `runners.py`). An option is a field of the command's settings (`settings.option`) or one of
what the command loads and writes (`RUN_OPTIONS`). Parsing imports nothing heavy; the benchmark modules are imported
at one point, `runners_module()`, once every path given has been checked.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from types import ModuleType
from typing import Any

from ..files import DRAFTER_FOLDER_FIX, TARGET_FOLDER_FIX, require_folder, require_path
from .settings import (
    DEFAULT_LONG_LENGTHS,
    HELD_OUT_DIR,
    SHORT_SOURCES,
    SYNTHETIC_TARGETS,
    BatchedSettings,
    DraftingCostSettings,
    MemorySettings,
    SpeedSettings,
    TauSettings,
    VerifyCostSettings,
)

DESCRIPTION = (
    "Benchmarks: decoding speed side by side, held-out tau of several drafters, drafting cost and verification cost vs "
    "prefix, peak memory."
)

# The options that are no settings field: `add_argument`'s arguments (and `flag` where it is not `--name`).
RUN_OPTIONS: dict[str, dict[str, Any]] = {
    "target": dict(help="local path of the target model (default: the SmolLM2-135M demo target)"),
    "drafter": dict(help="LongSpark drafter folder (default: the shipped SmolLM2 drafter if it fits the target, else "
                    "a random one)"),
    "drafters": dict(flag="--drafter", dest="drafter", action="append", metavar="NAME=SOURCE", help="a drafter to "
                     "compare, repeatable: NAME=FOLDER, or NAME=warm-start / NAME=random for an untrained drafter of "
                     "the shipped architecture (default: the shipped SmolLM2 drafter if it fits the target)"),
    "dtype": dict(default="float32", choices=["float32", "bfloat16", "float16"],
                  help="dtype of the target and drafter weights (default: float32)"),
    "device": dict(default="cpu", help="torch device (default: cpu)"),
    "num_threads": dict(type=int, help="torch CPU threads (default: torch's choice, one per core; on a busy machine "
                        "fewer, e.g. 1, can be many times faster)"),
    "json": dict(type=Path, help="write the report as JSON to this file"),
    "quiet": dict(action="store_true", help="no progress bars on stderr"),
    "progress": dict(action="store_true", help="show progress bars (the default; for old scripts)"),
    "markdown": dict(type=Path, help="write the Markdown table to this file"),
    "plot": dict(type=Path, help="write the two-panel figure (PNG) to this file"),
    "curve_plot": dict(flag="--plot", dest="plot", type=Path,
                       help="with --by-length: draw tau vs prefix length (PNG) to this file"),
    "workloads": dict(nargs="+", default=["short", "long"], choices=["short", "long"],
                      help="held-out chat/maths/code prompts (short) and stdlib code files (long)"),
    "num_short_prompts": dict(type=int, default=6, help="short prompts (cycled through the sources)"),
    "short_sources": dict(nargs="+", default=list(SHORT_SOURCES), choices=list(SHORT_SOURCES),
                          help="the sources the short prompts cycle through (default: all), e.g. stdlib-code alone"),
    "num_long_prompts": dict(type=int, default=3, help="long-context prompts (held-out stdlib files)"),
    "long_lengths": dict(type=int, nargs="+", default=list(DEFAULT_LONG_LENGTHS), help="long-context prompt lengths "
                         "in tokens, cycled over the prompts (capped to fit the target's positions)"),
    "held_out": dict(type=Path, help=f"folder of held-out *.jsonl records for the short prompts (default: "
                     f"{HELD_OUT_DIR} if it exists, else prompts held out of the builtin sources)"),
    "by_length": dict(action="store_true", help="acceptance vs context length: each long prompt's file cut at every "
                      "--long-lengths, one row per length"),
    "synthetic_target": dict(choices=list(SYNTHETIC_TARGETS), help="a random-weight target of these shapes, built on "
                             "--device in --dtype, instead of --target (with a random drafter unless --drafter is "
                             "given): costs depend on shapes alone"),
    "prefix": dict(choices=["code", "random"], help="prefix tokens: Python stdlib code (needs the target's tokenizer; "
                   "the default when there is one) or seeded random ids"),
}  # fmt: skip
RUN = ("target", "drafter", "dtype", "device", "num_threads", "seed", "json", "quiet", "progress")
PROMPTS = ("markdown", "workloads", "num_short_prompts", "short_sources", "num_long_prompts", "long_lengths",
           "held_out")  # fmt: skip
COSTS = ("synthetic_target", "plot", "markdown", "prefix_lengths", "prefill_chunk")
# Each command: its help, the settings whose fields are its options, its options in --help order, other defaults.
COMMANDS: dict[str, tuple[str, tuple[type, ...], tuple[str, ...], dict[str, Any]]] = {
    "speed": ("plain generate vs prompt lookup vs LongSpark vs full-prefix drafter", (SpeedSettings, BatchedSettings),
              (*RUN, *PROMPTS, "modes", "methods", "variants", "max_new_tokens", "temperature",
               "prompt_lookup_num_tokens", "ignore_eos", "warmup", "batch_sizes", "repeats"), {}),
    "drafting-cost": ("drafting time per round and context-state bytes vs prefix", (DraftingCostSettings,),
                      (*RUN, *COSTS, "synthetic_prefix_lengths", "rounds", "warmup", "prefix", "allow_extrapolation"),
                      {}),
    "tau": ("held-out greedy tau and per-position acceptance of several drafters", (TauSettings,),
            (*RUN[:1], "drafters", *RUN[2:], *PROMPTS, "max_new_tokens", "whole_blocks", "drafter_alone", "by_length",
             "curve_plot"), {"num_long_prompts": 2, "long_lengths": [4096]}),
    "verify-cost": ("cached target forward of k tokens vs prefix: stock vs fast", (VerifyCostSettings,),
                    (*RUN, *COSTS, "num_tokens", "repeats", "warmup"), {}),
    "memory": ("peak RSS of plain vs assisted generate (fresh process each)", (MemorySettings,),
               (*RUN, "prompt_lengths", "max_new_tokens"), {"num_threads": 1}),
}  # fmt: skip


def _add_options(parser: argparse.ArgumentParser, command: str) -> None:
    """Adds `command`'s options to `parser`: each from the first of its settings with that field, else `RUN_OPTIONS`."""
    _, settings, names, defaults = COMMANDS[command]
    declared = {
        item.name: item.metadata for cls in reversed(settings) for item in fields(cls) if "help" in item.metadata
    }
    for name in names:
        spec = dict(declared.get(name) or RUN_OPTIONS[name])
        spec.pop("minimum", None)
        flag = spec.pop("flag", None) or "--" + name.replace("_", "-")
        spec.setdefault("dest", name)
        if name in defaults:
            spec["default"] = defaults[name]
        parser.add_argument(flag, **spec)


class _KeepOptionsBefore(argparse._SubParsersAction):
    """`longspark bench --num-threads 1 tau`: argparse lets the command's defaults overwrite the options parsed before
    it, so those would be silently lost. Here an option given before the command (a value other than `bench`'s
    default) is kept where the command left its own default, and one the command does not take is an error."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = {dest: value for dest, value in vars(namespace).items() if value != parser.get_default(dest)}
        super().__call__(parser, namespace, values, option_string)
        command = self._name_parser_map[values[0]]
        accepted = {action.dest: action for action in command._actions}
        for dest, value in before.items():
            if dest not in accepted:
                option = next(a.option_strings[0] for a in parser._actions if a.dest == dest and a.option_strings)
                parser.error(f"{option} is an option of the speed comparison, not of `bench {values[0]}`; drop it.")
            if getattr(namespace, dest) == command.get_default(dest):
                setattr(namespace, dest, value)


def add_bench_arguments(subparsers_or_parser) -> argparse.ArgumentParser:
    """Adds `bench` (`longspark bench [speed options]`, or `bench --batch-sizes 1 2 4 8 ...`, or `bench COMMAND ...`):
    a subparser named `bench` when given `parser.add_subparsers()`'s result, else the arguments are added to the given
    parser. Returns the `bench` parser; dispatch with `run_bench`."""
    parser = subparsers_or_parser
    if isinstance(subparsers_or_parser, argparse._SubParsersAction):
        help = f"benchmarks: {', '.join(COMMANDS)} (speed by default)"
        parser = subparsers_or_parser.add_parser("bench", help=help, description=DESCRIPTION)
    _add_options(parser, "speed")
    metavar = "{" + ",".join(COMMANDS) + "}"
    commands = parser.add_subparsers(dest="bench_command", metavar=metavar, action=_KeepOptionsBefore)
    for name, (help, *_) in COMMANDS.items():
        _add_options(commands.add_parser(name, help=help), name)
    return parser


def runners_module() -> ModuleType:
    """The one lazy-import point of the benchmark modules (torch, transformers)."""
    return importlib.import_module(f"{__package__}.runners")


def parse_variants(specs: Sequence[Sequence[str]]) -> dict[str, dict[str, Any]]:
    """`--variant NAME KEY=VALUE ...` (repeated) -> `{NAME: {KEY: VALUE}}`; VALUE is read as JSON, else kept as text."""
    variants: dict[str, dict[str, Any]] = {}
    for name, *pairs in specs:
        if name in variants or "=" in name or not pairs or any("=" not in pair for pair in pairs):
            raise ValueError(
                f"--variant {' '.join([name, *pairs])}: give a new name, then one or more KEY=VALUE settings, e.g. "
                "--variant whole_blocks assistant_confidence_threshold=0 block_confidence_threshold=0."
            )
        variants[name] = dict(pair.split("=", 1) for pair in pairs)
        for key, value in variants[name].items():
            with contextlib.suppress(json.JSONDecodeError):
                variants[name][key] = json.loads(value)
    return variants


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
        if path is not None and path.is_dir():
            raise IsADirectoryError(f"--{flag} {path} is a folder; pass a file name.")
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the `longspark bench` subcommand in `args` (speed when none), prints its table, writes its files."""
    check_paths(args)
    return runners_module().run(getattr(args, "bench_command", None) or "speed", args)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m transformers_longspark.benchmarks ...`: the same as `longspark bench ...`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="longspark bench", description=DESCRIPTION)
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["longspark", "bench", *argv])
    run_bench(args)
