"""`longspark bench ...`: dispatch of the benchmark subcommands (their arguments: `arguments.py`).

Parsing imports nothing heavy (`longspark bench --help` answers without torch); the benchmark modules are imported
into this module when a benchmark runs (`_import_runners`), after every path given has been checked.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..files import DRAFTER_FOLDER_FIX, TARGET_FOLDER_FIX, require_folder, require_path
from .arguments import DESCRIPTION, add_bench_arguments
from .defaults import HELD_OUT_DIR

if TYPE_CHECKING:  # imported at run time by `_import_runners`
    from .batched import format_batched, run_batched_benchmark
    from .common import write_json
    from .drafting_cost import run_drafting_cost
    from .memory import run_memory_benchmark
    from .models import build_random_drafter, build_synthetic_target
    from .prompts import long_context_prompts, short_prompts, stdlib_token_ids
    from .report import (
        format_drafting_cost,
        format_markdown,
        format_memory,
        format_verify_cost,
        plot_drafting_cost,
        plot_verify_cost,
    )
    from .speed import run_speed_benchmark
    from .tau import FRESH_DRAFTERS, format_tau, format_tau_curve, fresh_drafter, plot_tau_curve, run_tau_benchmark
    from .verify_cost import run_verify_cost

# What the runners use, by submodule: imported on the first run, or on first access as an attribute (e.g. by a test's
# monkeypatch, which a run then keeps).
_RUNNER_MODULES = {
    "FRESH_DRAFTERS": "tau",
    "build_random_drafter": "models",
    "build_synthetic_target": "models",
    "format_batched": "batched",
    "format_drafting_cost": "report",
    "format_markdown": "report",
    "format_memory": "report",
    "format_tau": "tau",
    "format_tau_curve": "tau",
    "format_verify_cost": "report",
    "fresh_drafter": "tau",
    "plot_tau_curve": "tau",
    "long_context_prompts": "prompts",
    "plot_drafting_cost": "report",
    "plot_verify_cost": "report",
    "run_batched_benchmark": "batched",
    "run_drafting_cost": "drafting_cost",
    "run_memory_benchmark": "memory",
    "run_speed_benchmark": "speed",
    "run_tau_benchmark": "tau",
    "run_verify_cost": "verify_cost",
    "short_prompts": "prompts",
    "stdlib_token_ids": "prompts",
    "write_json": "common",
}


def __getattr__(name: str) -> Any:
    module = _RUNNER_MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    globals()[name] = value
    return value


def _import_runners() -> None:
    """Imports what the runners use into this module (names already set, e.g. monkeypatched, are kept)."""
    for name in _RUNNER_MODULES:
        if name not in globals():
            __getattr__(name)


# Options that a runner takes under their command-line names (`_options`).
SPEED_OPTIONS = (
    "modes",
    "methods",
    "temperature",
    "prompt_lookup_num_tokens",
    "ignore_eos",
    "warmup",
    "seed",
)
MEMORY_OPTIONS = ("max_new_tokens", "target", "drafter", "dtype", "num_threads", "seed")


def _options(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """`{name: args.name}` for the given option names."""
    return {name: getattr(args, name) for name in names}


def _load_target(args: argparse.Namespace):
    """`(target, tokenizer)`: the synthetic target of `--synthetic-target`, else `--target` (default SmolLM2)."""
    import torch

    from ..loading import load_target

    dtype = getattr(torch, args.dtype)
    if getattr(args, "synthetic_target", None):
        return build_synthetic_target(args.synthetic_target, args.device, dtype, args.seed), None
    return load_target(args.target, dtype, args.device)


def _target_name(args: argparse.Namespace) -> str:
    if getattr(args, "synthetic_target", None):
        return f"synthetic:{args.synthetic_target}"
    return args.target or "smollm2"


def _load_drafter(args: argparse.Namespace, target):
    return _load_drafter_from(args, target, args.drafter)


def _load_drafter_from(args: argparse.Namespace, target, path):
    from ..loading import load_drafter

    if getattr(args, "synthetic_target", None) and not path:
        drafter = build_random_drafter(target, args.seed)
        return drafter, {"path": None, "trained": False, "seed": args.seed, "synthetic_target": args.synthetic_target}
    return load_drafter(target, path, seed=args.seed)


def _write_outputs(args, result: dict[str, Any], table: str, plot: Callable | None = None) -> None:
    print(table)
    if args.json:
        write_json(args.json, {**result, "command": getattr(args, "command_line", None)})
    if getattr(args, "markdown", None):
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table, encoding="utf-8")
    if plot is not None and getattr(args, "plot", None):
        plot(result, args.plot)


def _run_drafting_cost(args: argparse.Namespace) -> dict[str, Any]:
    target, tokenizer = _load_target(args)
    drafter, drafter_info = _load_drafter(args, target)
    prefix_ids = None
    if (args.prefix or ("code" if tokenizer is not None else "random")) == "code":
        if tokenizer is None:
            raise ValueError("--prefix code needs the target's tokenizer; use --prefix random.")
        longest = max(args.prefix_lengths)
        if not args.allow_extrapolation:
            longest = min(longest, target.config.get_text_config().max_position_embeddings)
        prefix_ids = stdlib_token_ids(tokenizer, longest + 1)
    result = run_drafting_cost(
        target,
        drafter,
        args.prefix_lengths,
        args.rounds,
        args.warmup,
        prefix_ids=prefix_ids,
        seed=args.seed,
        allow_extrapolation=args.allow_extrapolation,
        prefill_chunk=args.prefill_chunk,
        synthetic_prefix_lengths=args.synthetic_prefix_lengths,
        progress=not args.quiet,
        lookup_min_match=args.lookup_min_match if args.with_lookup else 0,
        lookup_num_tokens=args.lookup_num_tokens,
        lookup_new_tokens=args.lookup_new_tokens,
    )
    result["prefix_source"] = "stdlib-code" if prefix_ids is not None else "random"
    result["drafter"] = drafter_info
    result["target"] = _target_name(args)
    _write_outputs(args, result, format_drafting_cost(result), plot_drafting_cost)
    return result


def _run_verify_cost(args: argparse.Namespace) -> dict[str, Any]:
    target, _ = _load_target(args)
    result = run_verify_cost(
        target,
        args.prefix_lengths,
        args.num_tokens,
        args.repeats,
        args.warmup,
        prefill_chunk=args.prefill_chunk,
        seed=args.seed,
        progress=not args.quiet,
    )
    result["target"] = _target_name(args)
    _write_outputs(args, result, format_verify_cost(result), plot_verify_cost)
    return result


def _load_prompts(args, target, tokenizer, num_short: int, block_size: int) -> dict[str, list[dict[str, Any]]]:
    """The `--workloads` prompts: `num_short` held-out short prompts, and long code capped to the target's positions
    less room for the new tokens and one block of `block_size` drafts."""
    prompts: dict[str, list[dict[str, Any]]] = {}
    if "short" in args.workloads:
        prompts["short"] = short_prompts(tokenizer, num_short, args.held_out or HELD_OUT_DIR)
    if "long" in args.workloads:
        max_positions = target.config.get_text_config().max_position_embeddings
        reserve = args.max_new_tokens + block_size + 1
        by_length = getattr(args, "by_length", False)
        long = long_context_prompts(
            tokenizer, args.long_lengths, args.num_long_prompts, max_positions, reserve, every_length=by_length
        )
        if by_length:
            for length in sorted({p["length"] for p in long}):
                prompts[f"long@{length}"] = [p for p in long if p["length"] == length]
        else:
            prompts["long"] = long
    return prompts


def _run_tau(args: argparse.Namespace) -> dict[str, Any]:
    if args.plot and not args.by_length:
        raise ValueError("--plot draws tau vs prefix length: add --by-length.")
    target, tokenizer = _load_target(args)
    if tokenizer is None:
        raise ValueError("The tau benchmark builds its prompts with the target's tokenizer; none was found.")
    drafters, infos = {}, {}
    for spec in args.drafter or ["default="]:
        name, _, source = spec.partition("=")
        if source in FRESH_DRAFTERS:
            drafters[name] = fresh_drafter(source, target, args.seed)
            infos[name] = {"path": None, "trained": False, "fresh": source, "seed": args.seed}
        else:
            drafters[name], infos[name] = _load_drafter_from(args, target, source or None)
    block_size = max(drafter.config.block_size for drafter in drafters.values())
    prompts = _load_prompts(args, target, tokenizer, args.num_short_prompts, block_size)
    result = run_tau_benchmark(
        target, drafters, prompts, args.max_new_tokens, args.whole_blocks, args.drafter_alone, not args.quiet
    )
    result["drafters"] = infos
    result["target"] = _target_name(args)
    _write_outputs(args, result, (format_tau_curve if args.by_length else format_tau)(result), plot_tau_curve)
    return result


def _run_speed(args: argparse.Namespace) -> dict[str, Any]:
    variants = parse_variants(args.variant)
    if variants and args.batch_sizes:
        raise ValueError("--variant runs in the batch-1 speed benchmark only; drop it or --batch-sizes.")
    target, tokenizer = _load_target(args)
    drafter, drafter_info = _load_drafter(args, target)
    if tokenizer is None:
        raise ValueError("The speed benchmark builds its prompts with the target's tokenizer; none was found.")
    num_short = max([args.num_short_prompts, *(args.batch_sizes or [])])
    prompts = _load_prompts(args, target, tokenizer, num_short, drafter.config.block_size)
    if args.batch_sizes:
        return _run_batched(args, target, tokenizer, drafter, drafter_info, prompts)
    options = _options(args, *SPEED_OPTIONS)
    result = run_speed_benchmark(
        target,
        tokenizer,
        drafter,
        prompts,
        args.max_new_tokens,
        **options,
        variants=variants,
        drafter_info=drafter_info,
        progress=not args.quiet,
    )
    _write_outputs(args, result, format_markdown(result))
    return result


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


def _run_batched(args, target, tokenizer, drafter, drafter_info, prompts) -> dict[str, Any]:
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    result = run_batched_benchmark(
        target,
        drafter,
        {name: [p["input_ids"] for p in items] for name, items in prompts.items()},
        args.batch_sizes,
        args.max_new_tokens,
        modes=args.modes,
        pad_token_id=pad_token_id,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        repeats=args.repeats,
        warmup=int(args.warmup),
        seed=args.seed,
        drafter_info=drafter_info,
        progress=not args.quiet,
    )
    result["target"] = _target_name(args)
    _write_outputs(args, result, format_batched(result))
    return result


def _run_memory(args: argparse.Namespace) -> dict[str, Any]:
    if args.device != "cpu":
        raise ValueError("The memory benchmark measures CPU peak RSS; run it with --device cpu.")
    options = _options(args, *MEMORY_OPTIONS)
    result = run_memory_benchmark(args.prompt_lengths, **options, progress=not args.quiet)
    _write_outputs(args, result, format_memory(result))
    return result


RUNNERS: Mapping[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "speed": _run_speed,
    "tau": _run_tau,
    "drafting-cost": _run_drafting_cost,
    "verify-cost": _run_verify_cost,
    "memory": _run_memory,
}


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
        require_path(
            args.held_out,
            "Held-out folder",
            "pass a folder of *.jsonl records written by `longspark "
            "regenerate --held-out`, or no --held-out for the default.",
        )
    for flag in ("json", "markdown", "plot"):
        path = getattr(args, flag, None)
        if path is None:
            continue
        if path.is_dir():
            raise IsADirectoryError(f"--{flag} {path} is a folder; pass a file name.")
        path.parent.mkdir(parents=True, exist_ok=True)


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the `longspark bench` subcommand in `args` (speed when none), prints its table, writes its files."""
    command = getattr(args, "bench_command", None) or "speed"
    check_paths(args)
    _import_runners()
    if command != "memory":  # the memory benchmark runs its workers in fresh processes with their own settings
        import torch

        import transformers_longspark

        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        transformers_longspark.register()  # the generate() hook
    return RUNNERS[command](args)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m transformers_longspark.benchmarks ...`: the same as `longspark bench ...`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="longspark bench", description=DESCRIPTION)
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["longspark", "bench", *argv])
    run_bench(args)


__all__ = ["add_bench_arguments", "main", "run_bench"]
