"""What each `longspark bench` subcommand runs: its settings object from the options, the models and prompts loaded,
the entry point called, the table printed and the files written. Imports the benchmark modules (torch,
transformers): `cli` imports this module only once a benchmark runs."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

import transformers_longspark

from .. import loading
from .batched import format_batched, run_batched_benchmark
from .cli import parse_variants
from .drafting_cost import format_drafting_cost, plot_drafting_cost, run_drafting_cost
from .memory import format_memory, run_memory_benchmark
from .models import build_random_drafter, build_synthetic_target
from .prompts import long_context_prompts, short_prompts, stdlib_token_ids
from .settings import (
    HELD_OUT_DIR,
    BatchedSettings,
    DraftingCostSettings,
    MemorySettings,
    SpeedSettings,
    TauSettings,
    VerifyCostSettings,
)
from .speed import run_speed_benchmark
from .speed_summary import format_markdown
from .tau import FRESH_DRAFTERS, format_tau, format_tau_curve, fresh_drafter, plot_tau_curve, run_tau_benchmark
from .verify_cost import format_verify_cost, plot_verify_cost, run_verify_cost


def _load_target(args: argparse.Namespace):
    """`(target, tokenizer)`: the synthetic target of `--synthetic-target`, else `--target` (default SmolLM2)."""
    dtype = getattr(torch, args.dtype)
    if getattr(args, "synthetic_target", None):
        return build_synthetic_target(args.synthetic_target, args.device, dtype, args.seed), None
    return loading.load_target(args.target, dtype, args.device)


def _target_name(args: argparse.Namespace) -> str:
    if getattr(args, "synthetic_target", None):
        return f"synthetic:{args.synthetic_target}"
    return args.target or "smollm2"


def _load_drafter(args: argparse.Namespace, target, path):
    """`(drafter, info)`: the drafter at `path` (None: the default one; a random one for a synthetic target)."""
    if getattr(args, "synthetic_target", None) and not path:
        drafter = build_random_drafter(target, args.seed)
        return drafter, {"path": None, "trained": False, "seed": args.seed, "synthetic_target": args.synthetic_target}
    return loading.load_drafter(target, path, seed=args.seed)


def _write_outputs(args, result: dict[str, Any], format: Callable, plot: Callable | None = None, **fields: Any):
    """Adds `fields` to `result`, prints its table (`format`), writes the files asked for; returns `result`."""
    result.update(fields)
    table = format(result)
    print(table)
    if args.json:  # `cli.check_paths` made its folder
        report = {**result, "command": getattr(args, "command_line", None)}
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if getattr(args, "markdown", None):
        args.markdown.write_text(table, encoding="utf-8")
    if plot is not None and getattr(args, "plot", None):
        plot(result, args.plot)
    return result


def _run_drafting_cost(args: argparse.Namespace) -> dict[str, Any]:
    settings = DraftingCostSettings.from_args(args)
    target, tokenizer = _load_target(args)
    drafter, drafter_info = _load_drafter(args, target, args.drafter)
    prefix_ids = None
    if (args.prefix or ("code" if tokenizer is not None else "random")) == "code":
        if tokenizer is None:
            raise ValueError("--prefix code needs the target's tokenizer; use --prefix random.")
        longest = max(args.prefix_lengths)
        if not args.allow_extrapolation:
            longest = min(longest, target.config.get_text_config().max_position_embeddings)
        prefix_ids = stdlib_token_ids(tokenizer, longest + 1)
    result = run_drafting_cost(target, drafter, settings, prefix_ids=prefix_ids)
    prefix_source = "stdlib-code" if prefix_ids is not None else "random"
    fields = dict(prefix_source=prefix_source, drafter=drafter_info, target=_target_name(args))
    return _write_outputs(args, result, format_drafting_cost, plot_drafting_cost, **fields)


def _run_verify_cost(args: argparse.Namespace) -> dict[str, Any]:
    settings = VerifyCostSettings.from_args(args)
    result = run_verify_cost(_load_target(args)[0], settings)
    return _write_outputs(args, result, format_verify_cost, plot_verify_cost, target=_target_name(args))


def _load_prompts(args, target, tokenizer, num_short: int, block_size: int) -> dict[str, list[dict[str, Any]]]:
    """The `--workloads` prompts: `num_short` held-out short prompts, and long code capped to the target's positions
    less room for the new tokens and one block of `block_size` drafts."""
    prompts: dict[str, list[dict[str, Any]]] = {}
    if "short" in args.workloads:
        prompts["short"] = short_prompts(tokenizer, num_short, args.held_out or HELD_OUT_DIR, args.short_sources)
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
    settings = TauSettings.from_args(args)
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
            drafters[name], infos[name] = _load_drafter(args, target, source or None)
    block_size = max(drafter.config.block_size for drafter in drafters.values())
    prompts = _load_prompts(args, target, tokenizer, args.num_short_prompts, block_size)
    result = run_tau_benchmark(target, drafters, prompts, settings)
    table = format_tau_curve if args.by_length else format_tau
    return _write_outputs(args, result, table, plot_tau_curve, drafters=infos, target=_target_name(args))


def _run_speed(args: argparse.Namespace) -> dict[str, Any]:
    variants = parse_variants(args.variant)
    if variants and args.batch_sizes:
        raise ValueError("--variant runs in the batch-1 speed benchmark only; drop it or --batch-sizes.")
    if args.batch_sizes:
        settings = BatchedSettings.from_args(args, warmup=int(args.warmup))
    else:
        settings = SpeedSettings.from_args(args, variants=variants)
    target, tokenizer = _load_target(args)
    drafter, drafter_info = _load_drafter(args, target, args.drafter)
    if tokenizer is None:
        raise ValueError("The speed benchmark builds its prompts with the target's tokenizer; none was found.")
    num_short = max([args.num_short_prompts, *(args.batch_sizes or [])])
    prompts = _load_prompts(args, target, tokenizer, num_short, drafter.config.block_size)
    if args.batch_sizes:
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        settings = dataclasses.replace(settings, pad_token_id=pad_token_id)
        token_ids = {name: [p["input_ids"] for p in items] for name, items in prompts.items()}
        result = run_batched_benchmark(target, drafter, token_ids, settings, drafter_info=drafter_info)
        return _write_outputs(args, result, format_batched, target=_target_name(args))
    result = run_speed_benchmark(target, drafter, prompts, settings, drafter_info=drafter_info)
    return _write_outputs(args, result, format_markdown)


def _run_memory(args: argparse.Namespace) -> dict[str, Any]:
    if args.device != "cpu":
        raise ValueError("The memory benchmark measures CPU peak RSS; run it with --device cpu.")
    result = run_memory_benchmark(args.target, args.drafter, MemorySettings.from_args(args))
    return _write_outputs(args, result, format_memory)


RUNNERS: Mapping[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "speed": _run_speed,
    "tau": _run_tau,
    "drafting-cost": _run_drafting_cost,
    "verify-cost": _run_verify_cost,
    "memory": _run_memory,
}


def run(command: str, args: argparse.Namespace) -> dict[str, Any]:
    """Runs the `longspark bench` subcommand `command` with the parsed `args`."""
    if command != "memory":  # the memory benchmark runs its workers in fresh processes with their own settings
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        transformers_longspark.register()  # the generate() hook
    return RUNNERS[command](args)
