"""`longspark bench` arguments: the speed comparison (the default command) and the `tau`, `drafting-cost`,
`verify-cost` and `memory` subcommands. Imports nothing heavy, so that `longspark bench --help` answers without
torch."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from .settings import (
    DEFAULT_LONG_LENGTHS,
    DEFAULT_LOOKUP_MIN_MATCH,
    DEFAULT_LOOKUP_NUM_TOKENS,
    DEFAULT_NUM_TOKENS,
    DEFAULT_PREFIX_LENGTHS,
    DEFAULT_SYNTHETIC_PREFIX_LENGTHS,
    DEFAULT_VERIFY_PREFIX_LENGTHS,
    HELD_OUT_DIR,
    METHODS,
    MODES,
    SYNTHETIC_TARGETS,
)

DESCRIPTION = (
    "Benchmarks: decoding speed side by side, held-out tau of several drafters, drafting cost and verification cost vs "
    "prefix, peak memory."
)


def _add_common_arguments(parser: argparse.ArgumentParser, several_drafters: bool = False) -> None:
    parser.add_argument("--target", help="local path of the target model (default: the SmolLM2-135M demo target)")
    if several_drafters:
        parser.add_argument(
            "--drafter",
            action="append",
            metavar="NAME=SOURCE",
            help="a drafter to compare, repeatable: NAME=FOLDER, or NAME=warm-start / NAME=random for an untrained "
            "drafter of the shipped architecture (default: the shipped SmolLM2 drafter if it fits the target)",
        )
    else:
        parser.add_argument(
            "--drafter",
            help="LongSpark drafter folder (default: the shipped SmolLM2 drafter if it fits the target, else a random "
            "one)",
        )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the target and drafter weights (default: float32)",
    )
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument(
        "--num-threads",
        type=int,
        help="torch CPU threads (default: torch's choice, one per core; on a busy machine fewer, "
        "e.g. 1, can be many times faster)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of random prompts, drafters and sampling")
    parser.add_argument("--json", type=Path, help="write the report as JSON to this file")
    parser.add_argument("--quiet", action="store_true", help="no progress bars on stderr")
    parser.add_argument("--progress", action="store_true", help="show progress bars (the default; for old scripts)")


def _add_cost_arguments(parser: argparse.ArgumentParser, prefix_lengths: Sequence[int], chunk: int) -> None:
    _add_common_arguments(parser)
    parser.add_argument(
        "--synthetic-target",
        choices=list(SYNTHETIC_TARGETS),
        help="a random-weight target of these shapes, built on --device in --dtype, instead of --target "
        "(with a random drafter unless --drafter is given): costs depend on shapes alone",
    )
    parser.add_argument("--plot", type=Path, help="write the two-panel figure (PNG) to this file")
    parser.add_argument("--markdown", type=Path, help="write the Markdown table to this file")
    parser.add_argument(
        "--prefix-lengths", type=int, nargs="+", default=list(prefix_lengths), help="prefix lengths in tokens"
    )
    parser.add_argument("--prefill-chunk", type=int, default=chunk, help="tokens per prefill forward")


def _add_lookup_arguments(parser: argparse.ArgumentParser, used_by: str) -> None:
    parser.add_argument(
        "--lookup-min-match",
        type=int,
        default=DEFAULT_LOOKUP_MIN_MATCH,
        help=f"{used_by}: the lookup source proposes where the request's last N (or more) tokens occurred before "
        f"(the drafter's generation_config.lookup_min_match; default {DEFAULT_LOOKUP_MIN_MATCH})",
    )
    parser.add_argument(
        "--lookup-num-tokens",
        type=int,
        default=DEFAULT_LOOKUP_NUM_TOKENS,
        help=f"{used_by}: tokens the lookup continuation proposes (generation_config.lookup_num_tokens; default "
        f"{DEFAULT_LOOKUP_NUM_TOKENS})",
    )


def _add_prompt_arguments(parser: argparse.ArgumentParser, num_long: int, long_lengths: Sequence[int]) -> None:
    parser.add_argument("--markdown", type=Path, help="write the Markdown table to this file")
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["short", "long"],
        choices=["short", "long"],
        help="held-out chat/maths/code prompts (short) and stdlib code files (long)",
    )
    parser.add_argument("--num-short-prompts", type=int, default=6, help="short prompts (cycled through the sources)")
    parser.add_argument(
        "--num-long-prompts", type=int, default=num_long, help="long-context prompts (held-out stdlib files)"
    )
    parser.add_argument(
        "--long-lengths",
        type=int,
        nargs="+",
        default=list(long_lengths),
        help="long-context prompt lengths in tokens, cycled over the prompts (capped to fit the target's positions)",
    )
    parser.add_argument(
        "--held-out",
        type=Path,
        help=f"folder of held-out *.jsonl records for the short prompts (default: {HELD_OUT_DIR} if it exists, else "
        "prompts held out of the builtin sources)",
    )


def _add_tau_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common_arguments(parser, several_drafters=True)
    _add_prompt_arguments(parser, 2, [4096])
    parser.add_argument("--max-new-tokens", type=int, default=64, help="greedy new tokens per prompt")
    parser.add_argument(
        "--whole-blocks",
        action="store_true",
        help="draft whole blocks (confidence thresholds 0) instead of each drafter's own generation config",
    )
    parser.add_argument(
        "--drafter-alone",
        action="store_true",
        help="the drafter alone: lookup off and costs 0, so that every round drafts (tau is the drafter's own)",
    )
    parser.add_argument(
        "--by-length",
        action="store_true",
        help="acceptance vs context length: each long prompt's file cut at every --long-lengths, one row per length",
    )
    parser.add_argument("--plot", type=Path, help="with --by-length: draw tau vs prefix length (PNG) to this file")


def _add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common_arguments(parser)
    _add_prompt_arguments(parser, 3, DEFAULT_LONG_LENGTHS)
    parser.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=list(MODES),
        help="greedy decoding and/or sampling at --temperature",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        metavar="METHOD",
        help=f"methods for every mode, of: {', '.join(METHODS)}, and the --variant names. plain is always added "
        "(default: all in greedy mode, all but full_prefix in sampled mode, and every variant). plain_fast is plain "
        "generate on the fast verification path (reserved cache rows, grouped-head attention), plain_static with "
        "transformers' static cache: speedups are also reported over the fastest plain path measured. longspark and "
        "full_prefix verify on the fast path with the drafter's own generation config; attribution: "
        "longspark_drafter_only (the drafter alone, every round drafts), longspark_lookup_only (the drafter priced "
        "out), longspark_no_proposals (every round a plain step); prompt_lookup_fast is prompt lookup on the fast path",
    )
    parser.add_argument(
        "--variant",
        nargs="+",
        action="append",
        default=[],
        metavar="NAME KEY=VALUE",
        help="one more method: LongSpark with these settings changed, for an A/B in one run (repeatable), e.g. "
        "--variant whole_blocks assistant_confidence_threshold=0 block_confidence_threshold=0 --variant "
        "fp32_drafter linear_dtype=float32. KEY is a field of the drafter's generation config, or "
        "fast_verification, packed_weights or linear_dtype; VALUE is JSON (true, 0.3) or a string",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per generate call")
    parser.add_argument("--temperature", type=float, default=1.0, help="temperature of the sampled mode")
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=7, help="tokens prompt lookup proposes")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    parser.add_argument(
        "--no-warmup", dest="warmup", action="store_false", help="skip the untimed warm-up run of every method"
    )
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        help="instead of the method comparison, time plain batched generate vs LongSpark batched at these batch "
        "sizes (left-padded batches of the short and long prompts, cycled to fill them)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per method and batch (--batch-sizes)")


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
    """Adds `bench`: a subparser named `bench` when given `parser.add_subparsers()`'s result, else the arguments
    are added to the given parser. Returns the `bench` parser; dispatch with `run_bench`.

    * `longspark bench [speed options]` or `longspark bench speed ...`: the speed comparison;
    * `longspark bench --batch-sizes 1 2 4 8 [speed options]`: plain vs LongSpark batched `generate`;
    * `longspark bench tau --drafter NAME=FOLDER ...`: held-out greedy tau of several drafters;
    * `longspark bench drafting-cost --json FILE --plot FILE.png`;
    * `longspark bench verify-cost --json FILE --plot FILE.png`;
    * `longspark bench memory --json FILE`.
    """
    if isinstance(subparsers_or_parser, argparse._SubParsersAction):
        parser = subparsers_or_parser.add_parser(
            "bench",
            help="benchmarks: speed (default), tau, drafting-cost, verify-cost, memory",
            description=DESCRIPTION,
        )
    else:
        parser = subparsers_or_parser
    _add_speed_arguments(parser)
    commands = parser.add_subparsers(
        dest="bench_command", metavar="{speed,tau,drafting-cost,verify-cost,memory}", action=_KeepOptionsBefore
    )
    speed = commands.add_parser("speed", help="plain generate vs prompt lookup vs LongSpark vs full-prefix drafter")
    _add_speed_arguments(speed)

    cost = commands.add_parser("drafting-cost", help="drafting time per round and context-state bytes vs prefix")
    _add_cost_arguments(cost, DEFAULT_PREFIX_LENGTHS, 1024)
    cost.add_argument(
        "--synthetic-prefix-lengths",
        type=int,
        nargs="*",
        default=list(DEFAULT_SYNTHETIC_PREFIX_LENGTHS),
        help="also time these prefixes on a synthetic cache (random K/V in the selected layers only, any length); "
        "pass the flag with no value to skip them",
    )
    cost.add_argument("--rounds", type=int, default=20, help="measured rounds per length (median)")
    cost.add_argument("--warmup", type=int, default=3, help="untimed rounds per length first")
    cost.add_argument(
        "--prefix",
        choices=["code", "random"],
        help="prefix tokens: Python stdlib code (needs the target's tokenizer; the default when there is one) or "
        "seeded random ids",
    )
    cost.add_argument(
        "--allow-extrapolation", action="store_true", help="also time prefixes beyond max_position_embeddings"
    )
    # Not `--lookup`: argparse would reject it as an ambiguous abbreviation of `--lookup-min-match` and
    # `--lookup-num-tokens`.
    cost.add_argument(
        "--with-lookup",
        action="store_true",
        help="also time the round with the lookup source on: per length, a seeded synthetic token history (random "
        "tokens with repeated stretches) is indexed, and each round adds --lookup-new-tokens fresh tokens to the "
        "index and queries it before drafting the block (the round's full cost); reports the index bytes per request",
    )
    _add_lookup_arguments(cost, "--with-lookup")
    cost.add_argument(
        "--lookup-new-tokens",
        type=int,
        help="--with-lookup: tokens committed per round, added to the index before each query (default: the block "
        "size + 1, what a round that accepts a whole block commits, as the timed summary update assumes)",
    )

    tau = commands.add_parser("tau", help="held-out greedy tau and per-position acceptance of several drafters")
    _add_tau_arguments(tau)

    verify = commands.add_parser("verify-cost", help="cached target forward of k tokens vs prefix: stock vs fast")
    _add_cost_arguments(verify, DEFAULT_VERIFY_PREFIX_LENGTHS, 2048)
    verify.add_argument(
        "--num-tokens", type=int, nargs="+", default=list(DEFAULT_NUM_TOKENS), help="tokens per verification forward"
    )
    verify.add_argument("--repeats", type=int, default=7, help="timed forwards per (prefix, k, path), median")
    verify.add_argument("--warmup", type=int, default=2, help="untimed forwards per (prefix, k, path) first")

    memory = commands.add_parser("memory", help="peak RSS of plain vs assisted generate (fresh process each)")
    _add_common_arguments(memory)
    memory.add_argument(
        "--prompt-lengths",
        type=int,
        nargs="+",
        default=[1024, 8192],
        help="prompt lengths in tokens (seeded random ids), one plain and one assisted run each",
    )
    memory.add_argument("--max-new-tokens", type=int, default=16, help="new tokens per generate call")
    memory.set_defaults(num_threads=1)
    return parser


__all__ = ["DESCRIPTION", "add_bench_arguments"]
