"""`longspark`: regenerate training data, train a drafter, calibrate its costs, benchmark it, write its card, push it.

Bad input (a missing file or folder, an unknown config field, an unreadable corpus, a drafter that does not match the
target) ends with one line, `longspark: error: ...`, and exit status 2, before any model loads where the input is a
path; `--debug` or LONGSPARK_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path

import yaml

# Only light modules at the top: `longspark --help` must not import torch or transformers. Each subcommand imports
# what it runs when it runs.
from .benchmarks.cli import add_bench_arguments, run_bench
from .files import TARGET_FOLDER_FIX, require_folder
from .training.prompt_sources import BUILTIN_SOURCES

# What bad input raises: ValueError (JSONDecodeError and UnicodeDecodeError included), OSError (FileNotFoundError,
# PermissionError, transformers' and huggingface_hub's loading errors) and YAML errors. Anything else (TypeError,
# RuntimeError, KeyError, ...) is a bug and keeps its traceback.
USER_ERRORS: tuple[type[Exception], ...] = (ValueError, OSError, yaml.YAMLError)


def _count_or_fraction(text: str) -> int | float:
    """``"40"`` -> 40 prompts, ``"0.05"`` -> 5 % of the prompts."""
    return float(text) if any(char in text for char in ".eE") else int(text)


def add_regenerate_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``longspark regenerate``."""
    parser.add_argument(
        "--prompts",
        nargs="+",
        required=True,
        help="prompt sources, interleaved round-robin: JSONL/JSON files, local datasets, or builtins "
        f"({', '.join(BUILTIN_SOURCES)})",
    )
    parser.add_argument("--prompts-split", help="split to read from a multi-split dataset (default: train)")
    parser.add_argument(
        "--output",
        required=True,
        type=Path,
        help="output directory; with --held-out it gets train/ and held_out/ subdirectories",
    )
    parser.add_argument("--target", help="local path of the target model (default: the SmolLM2-135M demo target)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the target's weights (default: float32)",
    )
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu; transformers engine)")
    parser.add_argument(
        "--engine",
        default="transformers",
        choices=("transformers", "vllm"),  # `training.response_engines` (not imported here: it loads torch)
        help="what generates: transformers' batched generate, or vLLM's offline engine (run from the environment "
        "of scripts/install_vllm.sh: .venv-vllm/bin/longspark regenerate --engine vllm ...)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=256, help="longest response, in tokens")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (vLLM: 64-256)")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=32768,
        help="vLLM: the engine's tokens per step (larger batches are generated in parts)",
    )
    parser.add_argument(
        "--samples-per-prompt",
        type=int,
        default=1,
        help="responses sampled per training prompt (each its own record and seed; held-out prompts get one)",
    )
    parser.add_argument("--temperature", type=float, default=0.7, help="0 decodes greedily")
    parser.add_argument("--top-p", type=float, default=0.8, help="nucleus sampling mass (1 disables it)")
    parser.add_argument("--top-k", type=int, default=20, help="0 disables top-k")
    parser.add_argument("--limit", type=int, help="generate only the first N training prompts (rerun with more later)")
    parser.add_argument(
        "--held-out",
        type=_count_or_fraction,
        default=0,
        help="prompts of each source held out for evaluation: a count (40) or a fraction (0.05); they are "
        "generated first, into OUTPUT/held_out",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the held-out split and of the sampling")
    parser.add_argument(
        "--archives",
        type=Path,
        help="folder of response archives (`longspark pack`): records sampled before with the same settings are "
        "rebuilt from them instead of sampled again",
    )
    parser.add_argument("--num-threads", type=int, help="torch CPU threads (default: torch's choice)")


def _add_pack_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("data", type=Path, help="a regenerate --output folder (it may still be written to)")
    parser.add_argument("archives", type=Path, help="folder of response archives; gets one new responses-NNN.jsonl.xz")


def _run_pack(args: argparse.Namespace) -> None:
    from .training.response_archive import pack_responses

    path = pack_responses(args.data, args.archives)
    print(f"Wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)." if path else f"{args.archives} already holds every "
          f"response of {args.data}.")  # fmt: skip


def _run_regenerate(args: argparse.Namespace) -> None:
    if args.target:
        require_folder(args.target, "Target", TARGET_FOLDER_FIX)  # before the prompts and the model load
    if args.output.exists() and not args.output.is_dir():
        raise NotADirectoryError(f"--output {args.output} is a file; pass a folder.")
    from .training.regenerate import run_regenerate

    run_regenerate(args)


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, help="training config (YAML/JSON), e.g. configs/*.yaml")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    parser.add_argument("--output-dir", help="override the config's output_dir")
    parser.add_argument("--max-steps", type=int, help="override the config's max_steps")


def _run_train(args: argparse.Namespace) -> None:
    from .training.run import TrainingConfig, train

    config = TrainingConfig.from_file(args.config, output_dir=args.output_dir, max_steps=args.max_steps)
    config.check_paths()  # before the target is loaded
    final = train(config, resume=args.resume)
    print(f"Saved the trained drafter to {final}")


def _add_card_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drafter_dir", type=Path, help="folder with the drafter's config.json and model.safetensors")
    parser.add_argument("--benchmark", required=True, type=Path, nargs="+", help="JSON report(s) of `longspark bench`")
    parser.add_argument(
        "--training-config",
        type=Path,
        nargs="+",
        help="the training config(s) the drafter was trained with, one per stage",
    )
    parser.add_argument("--base-model", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="Hub id of the target")
    parser.add_argument("--repo-id", help="Hub id the drafter will be pushed to (for the usage snippet)")
    parser.add_argument(
        "--training-log",
        type=Path,
        nargs="+",
        help="the trainer's log.jsonl, one per stage: adds the held-out tau curve",
    )
    parser.add_argument("--tokens-per-sequence", type=float, help="mean training sequence length, for the curve")
    parser.add_argument("--notes", type=Path, help="a Markdown file added as the card's Limits section")
    parser.add_argument(
        "--acceptance-curve", type=Path, help="a `longspark bench tau --by-length` report: tau vs prefix length"
    )


def _run_card(args: argparse.Namespace) -> None:
    from .model_card import write_model_card

    path = write_model_card(
        args.drafter_dir,
        args.benchmark,
        args.training_config,
        args.base_model,
        args.repo_id,
        args.training_log,
        args.tokens_per_sequence,
        args.notes,
        args.acceptance_curve,
    )
    print(f"Wrote {path}")


def _add_push_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drafter_dir", type=Path, help="folder with the drafter's config.json and model.safetensors")
    parser.add_argument("repo_id", help="Hub repository, e.g. your-org/longspark-smollm2-135m-instruct")
    parser.add_argument("--private", action="store_true", help="create the repository as private")


def _run_push(args: argparse.Namespace) -> None:
    from .model_card import push_drafter

    print(push_drafter(args.drafter_dir, args.repo_id, private=args.private))


def _add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="local path of the target model (default: the SmolLM2-135M demo target)")
    parser.add_argument("--drafter", help="LongSpark drafter folder (default: the shipped SmolLM2 drafter)")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="dtype of the target's weights"
    )
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument(
        "--num-threads", type=int, help="torch CPU threads, as generate will run (a calibration is per thread count)"
    )


def _run_calibrate(args: argparse.Namespace) -> None:
    if args.target:
        require_folder(args.target, "Target", TARGET_FOLDER_FIX)
    import torch

    from .inference.calibration import calibrate_and_cache
    from .loading import load_drafter, load_target

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    target, _ = load_target(args.target, getattr(torch, args.dtype), args.device)
    drafter, _ = load_drafter(target, args.drafter)
    calibration, path = calibrate_and_cache(target, drafter)
    print(json.dumps(calibration.to_json(), indent=2))
    print(f"Saved to {path}; generate() on this machine, target and thread count plans with these costs.")


def build_parser() -> argparse.ArgumentParser:
    """The `longspark` parser (it imports no torch: `--help` answers at once)."""
    parser = argparse.ArgumentParser(prog="longspark", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, add, run, help_text in [
        ("regenerate", add_regenerate_arguments, _run_regenerate, "regenerate responses with the frozen target"),
        ("pack", _add_pack_arguments, _run_pack, "archive regenerated responses, compressed, to rebuild them later"),
        ("train", _add_train_arguments, _run_train, "train a drafter (accelerate; resumable)"),
        ("calibrate", _add_calibrate_arguments, _run_calibrate, "measure the round costs on this machine (cached)"),
        ("card", _add_card_arguments, _run_card, "write a model card from a benchmark report"),
        ("push", _add_push_arguments, _run_push, "upload a drafter folder to the Hugging Face Hub"),
    ]:
        sub = commands.add_parser(name, help=help_text)
        add(sub)
        sub.set_defaults(run=run)
    add_bench_arguments(commands).set_defaults(run=run_bench)
    _add_debug_flag(parser, default=False)
    return parser


def _add_debug_flag(parser: argparse.ArgumentParser, default: bool | str) -> None:
    """`--debug` on the parser and every subcommand, so that it works before or after the subcommand's name."""
    parser.add_argument(
        "--debug",
        action="store_true",
        default=default,
        help="show the full traceback of an error (also: LONGSPARK_DEBUG=1)",
    )
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                _add_debug_flag(subparser, default=argparse.SUPPRESS)  # keeps a --debug given before the name


def unknown_options(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The `--options` of `argv` that no (sub)command of `parser` knows, even as an abbreviation."""
    known: set[str] = set()
    parsers = [parser]
    while parsers:
        current = parsers.pop()
        for action in current._actions:
            known.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    names = [arg.split("=", 1)[0] for arg in argv if arg.startswith("--") and arg != "--"]
    return [name for name in names if not any(option.startswith(name) for option in known)]


def error_line(error: BaseException) -> str:
    """The error as one line: what went wrong, and (in the library's messages) how to fix it."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        message = f"{error.filename}: {error.strerror}"  # Python's own "[Errno 2] No such file ..." messages
    else:
        message = str(error) or type(error).__name__
    return " ".join(message.split())


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    unknown = unknown_options(parser, argv)
    if unknown:  # argparse would read the option's value as a subcommand and name that instead
        names = ", ".join(unknown)
        print(f"longspark: error: unknown option(s) {names}; see `longspark COMMAND --help`", file=sys.stderr)
        raise SystemExit(2)
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["longspark", *argv])  # recorded in benchmark reports and model cards
    try:
        args.run(args)
    except USER_ERRORS as error:
        if args.debug or os.environ.get("LONGSPARK_DEBUG", "") not in ("", "0"):
            raise
        print(f"longspark: error: {error_line(error)}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    sys.exit(main())
