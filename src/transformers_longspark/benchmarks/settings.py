"""The benchmarks' choices, defaults and settings: one frozen settings object per entry point, whose fields also
declare `longspark bench`'s options (`option`). Imports nothing heavy, so that `longspark bench --help` answers without
torch. Each object checks its values when built (a `ValueError` naming the field, its option and the fix), before any
model loads.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

# speed.py: the methods and their labels in the report. The plain paths are stock `generate`, the same on the fast
# verification path (reserved cache rows, grouped-head attention) and with transformers' static cache: every speedup
# is reported over `plain` and over the fastest of these.
MODES = ("greedy", "sampled")
METHOD_LABELS = {
    "plain": "plain generate",
    "plain_fast": "plain generate (fast verification)",
    "plain_static": "plain generate (static cache)",
    "prompt_lookup": "prompt lookup",
    "prompt_lookup_fast": "prompt lookup (fast verification)",
    "longspark": "LongSpark",
    "longspark_drafter_only": "LongSpark drafter alone (no lookup, every round drafts)",
    "longspark_drafter_planned": "LongSpark drafter alone, lengths planned (no lookup, its round unpriced)",
    "longspark_lookup_only": "LongSpark lookup alone (drafter priced out)",
    "longspark_no_proposals": "LongSpark, no proposals (every round a plain step)",
    "full_prefix": "full-prefix drafter",
}
METHODS = tuple(METHOD_LABELS)
PLAIN_METHODS = ("plain", "plain_fast", "plain_static")
# Which methods run in which decoding mode by default (the full-prefix baseline is measured greedily).
DEFAULT_METHODS = {"greedy": METHODS, "sampled": tuple(m for m in METHODS if m != "full_prefix")}
# Generation-config settings of the attribution methods: the cost model off (every round proposes), and the drafter
# alone (lookup off too: every round drafts a block cut by its confidence only), as `longspark_drafter_only` and
# `bench tau --drafter-alone` run it. `DRAFTER_PLANNED` is the drafter alone under the calibrated cost model with its
# own round priced at 0 (`knobs.pinned_costs`): never priced out, it still proposes only the drafts worth verifying.
COSTS_OFF = {"calibrate_costs": False, "draft_round_cost": 0.0, "verify_round_cost": 0.0, "verify_token_cost": 0.0}
DRAFTER_ALONE = {"lookup_min_match": 0, **COSTS_OFF}
DRAFTER_PLANNED = {"lookup_min_match": 0, "draft_round_cost": 0.0}
WHOLE_BLOCKS = {"assistant_confidence_threshold": 0.0, "block_confidence_threshold": 0.0}
# Drafter methods and what each changes on the drafter for its runs (`speed.drafter_settings`); any other setting is
# an A/B variant (`--variant`).
DRAFTER_METHODS: dict[str, dict[str, Any]] = {
    "longspark": {},
    "longspark_drafter_only": DRAFTER_ALONE,
    "longspark_drafter_planned": DRAFTER_PLANNED,
    "longspark_lookup_only": {"use_drafter": False},
    "longspark_no_proposals": {"lookup_min_match": 0, "use_drafter": False},
    "full_prefix": {},
}
# The drafter attributes a variant may set besides its generation config, with what they are outside one.
DRAFTER_SWITCHES = {
    "fast_verification": True,
    "packed_weights": True,
    "lean_layers": True,
    "linear_dtype": "auto",
}

# prompts.py
DEFAULT_LONG_LENGTHS = (2048, 4096, 8192)
SHORT_SOURCES = ("gsm8k", "mmath-en", "stdlib-code")
HELD_OUT_DIR = Path("data") / "smollm2" / "held_out"

# models.py
_QWEN3 = dict(vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, num_attention_heads=32,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6}, num_key_value_heads=8, head_dim=128,
              num_hidden_layers=36, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)  # fmt: skip
SYNTHETIC_TARGETS: dict[str, dict[str, Any]] = {
    "qwen3-4b": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False},
    "qwen3-14b": {**_QWEN3, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
                  "num_attention_heads": 40, "tie_word_embeddings": False},
    # For tests: Qwen3 layout (grouped K/V heads, QK-norm) at toy sizes.
    "tiny": {**_QWEN3, "vocab_size": 512, "max_position_embeddings": 4096, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None},
}  # fmt: skip
"""Qwen3 configs by name (hidden size, layers, heads, KV heads, head dim, MLP width as published)."""

_SAME = object()
_METHODS_HELP = "; ".join(f"{name}: {label}" for name, label in METHOD_LABELS.items())


def option(
    default: Any,
    help: str | None = None,
    *,
    minimum: int | None = None,
    cli: Any = _SAME,
    flag: str | None = None,
    **arguments: Any,
) -> Any:
    """A settings field (default `default`; each integer of it checked to be >= `minimum`, if given) that is also a
    `longspark bench` option if it has a `help`: its `flag` (default `--field-name`), its default on the command line
    `cli` (if not `default`) and `add_argument`'s other arguments, which the default implies when not given: a bool is
    a switch, a tuple `nargs="+"`, an int or float its type."""
    if help is None:
        return field(default=default, metadata={"minimum": minimum})
    value = default if cli is _SAME else cli
    sample = default if value is None else value
    if isinstance(sample, bool):
        arguments.setdefault("action", "store_false" if value else "store_true")
    elif isinstance(sample, tuple):
        arguments.setdefault("nargs", "+")
        sample = sample[0] if sample else None
    if isinstance(sample, (int, float)) and not isinstance(sample, bool):
        arguments.setdefault("type", type(sample))
    cli_default = list(value) if isinstance(value, tuple) else value
    metadata = {"minimum": minimum, "flag": flag, "help": help, "default": cli_default, **arguments}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What every benchmark takes: the seed of its random ids and sampling, and progress bars on stderr. Fields given
    as lists are kept as tuples (frozen)."""

    seed: int = option(0, "seed of random prompts, drafters and sampling")
    progress: bool = False

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, list):
                value = tuple(value)
                object.__setattr__(self, item.name, value)
            minimum, optional = item.metadata.get("minimum"), "None" in str(item.type)
            if minimum is None or (value is None and optional):
                continue
            values = value if isinstance(value, tuple) else (value,)
            valid = bool(values) and all(isinstance(v, int) and v >= minimum for v in values)
            kind = "integers" if isinstance(value, tuple) else "None or a count" if optional else "an integer"
            self._require(valid, item.name, f"pass {kind} >= {minimum}")

    def _require(self, ok: bool, name: str, fix: str) -> None:
        """Raises `ValueError` naming the field, its option, its value and `fix`, unless `ok`."""
        if not ok:
            flag = next(item.metadata.get("flag") for item in fields(self) if item.name == name)
            option = flag or "--" + name.replace("_", "-")
            raise ValueError(f"{type(self).__name__}.{name}={getattr(self, name)!r} ({option}): {fix}.")

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any):
        """The settings of `longspark bench`'s parsed options: each field from the option of the same name
        (`progress` from `--quiet`), then `overrides`."""
        values = {item.name: getattr(args, item.name) for item in fields(cls) if hasattr(args, item.name)}
        values["progress"] = not getattr(args, "quiet", False)
        return cls(**{**values, **overrides})


@dataclass(frozen=True, kw_only=True)
class DecodingSettings(Settings):
    """What the speed and batched benchmarks share (and their options): the decoding modes, `max_new_tokens`, the
    temperature of sampled runs; `ignore_eos` forces exactly `max_new_tokens` tokens (`min_new_tokens`)."""

    modes: tuple[str, ...] = option(MODES, "greedy decoding and/or sampling at --temperature", choices=list(MODES))
    max_new_tokens: int = option(128, "new tokens per generate call", minimum=1)
    temperature: float = option(1.0, "temperature of the sampled mode")
    ignore_eos: bool = option(False, "always generate --max-new-tokens tokens")

    def __post_init__(self) -> None:
        super().__post_init__()
        modes = self.modes
        self._require(bool(modes) and set(modes) <= set(MODES), "modes", f"choose from {', '.join(MODES)}")
        self._require("sampled" not in modes or self.temperature > 0, "temperature", "pass a temperature > 0")


@dataclass(frozen=True, kw_only=True)
class SpeedSettings(DecodingSettings):
    """`run_speed_benchmark`'s settings. `variants` is `{name: settings}` (`speed.drafter_settings`); sampled runs of
    prompt `i` start from the RNG seed `seed + i` for every method."""

    methods: Sequence[str] | None = option(
        None,
        f"methods for every mode, of: {_METHODS_HELP}; and the --variant names. plain is always added (default: all "
        "in greedy mode, all but full_prefix in sampled mode, and every variant). The LongSpark methods and "
        "full_prefix verify on the fast path (reserved cache rows, grouped-head attention) with the drafter's own "
        "generation config; speedups are also reported over the fastest plain path measured",
        nargs="+",
        metavar="METHOD",
    )
    variants: Mapping[str, Mapping[str, Any]] = option(
        {},
        "one more method: LongSpark with these settings changed, for an A/B in one run (repeatable), e.g. --variant "
        "whole_blocks assistant_confidence_threshold=0 block_confidence_threshold=0 --variant fp32_drafter "
        "linear_dtype=float32. KEY is a field of the drafter's generation config, or fast_verification, "
        "packed_weights, lean_layers or linear_dtype; VALUE is JSON (true, 0.3) or a string",
        cli=[],
        flag="--variant",
        dest="variant",
        nargs="+",
        action="append",
        metavar="NAME KEY=VALUE",
    )
    prompt_lookup_num_tokens: int = option(7, "tokens prompt lookup proposes", minimum=1)
    warmup: bool = option(True, "skip the untimed warm-up run of every method", flag="--no-warmup")

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "variants", {name: check_variant(name, s) for name, s in self.variants.items()})
        for names in self.methods_per_mode().values():
            unknown = [m for m in names if m not in METHODS and m not in self.variants]
            if unknown:
                raise ValueError(f"Unknown methods {unknown}; choose from {', '.join([*METHODS, *self.variants])}.")

    def methods_per_mode(self) -> dict[str, list[str]]:
        """The methods of each mode: the defaults (and every variant), or the given ones, with `plain` first."""
        if self.methods is None:
            per_mode = {mode: [*DEFAULT_METHODS[mode], *self.variants] for mode in self.modes}
        else:
            per_mode = {mode: list(self.methods) for mode in self.modes}
        for names in per_mode.values():
            if "plain" not in names:
                names.insert(0, "plain")  # the reference of speedups and of greedy losslessness
        return per_mode


def check_variant(name: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """`settings` of the variant `name`, checked before any forward: a new name, known keys, valid knob values."""
    from ..inference.knobs import DraftingKnobs  # imports torch: only once a benchmark runs

    if name in METHODS:
        raise ValueError(f"Variant name {name!r} is a method already; name the variant for what it changes.")
    knobs = {item.name for item in fields(DraftingKnobs)}
    unknown = sorted(set(settings) - knobs - set(DRAFTER_SWITCHES))
    if unknown:
        raise ValueError(
            f"Variant {name!r}: unknown settings {unknown}; use fields of the drafter's generation config "
            f"({', '.join(sorted(knobs))}) or {', '.join(DRAFTER_SWITCHES)}."
        )
    DraftingKnobs(**{key: value for key, value in settings.items() if key in knobs})  # raises naming a bad value
    return dict(settings)


@dataclass(frozen=True, kw_only=True)
class BatchedSettings(DecodingSettings):
    """`run_batched_benchmark`'s settings: `pad_token_id` is the left-padding id (None: the target's pad, else its
    EOS, else 0), `warmup` the untimed calls before the `repeats` (`common.measure`, interleaved)."""

    batch_sizes: tuple[int, ...] = option(
        (1, 2, 4, 8),
        "instead of the method comparison, time plain batched generate vs LongSpark batched at these batch sizes "
        "(left-padded batches of the short and long prompts, cycled to fill them)",
        minimum=1,
        cli=None,
    )
    repeats: int = option(1, "timed calls per method and batch (--batch-sizes)", minimum=1)
    modes: tuple[str, ...] = ("greedy",)
    pad_token_id: int | None = None
    warmup: int = option(1, minimum=0)


@dataclass(frozen=True, kw_only=True)
class DraftingCostSettings(Settings):
    """`run_drafting_cost`'s settings (what each measures: its docstring). The Python defaults time no synthetic
    prefix."""

    prefix_lengths: tuple[int, ...] = option((512, 1024, 2048, 4096, 8192), "prefix lengths in tokens")
    prefill_chunk: int = option(1024, "tokens per prefill forward", minimum=1)
    synthetic_prefix_lengths: tuple[int, ...] = option(
        (),
        "also time these prefixes on a synthetic cache (random K/V in the selected layers only, any length); pass the "
        "flag with no value to skip them",
        cli=(32768, 65536, 131072),
        nargs="*",
    )
    rounds: int = option(20, "measured rounds per length (median)", minimum=1)
    warmup: int = option(3, "untimed rounds per length first", minimum=0)
    allow_extrapolation: bool = option(False, "also time prefixes beyond max_position_embeddings")


@dataclass(frozen=True, kw_only=True)
class VerifyCostSettings(Settings):
    """`run_verify_cost`'s settings: `prefix_lengths` x `num_tokens`, medians of `repeats` forwards after `warmup`."""

    prefix_lengths: tuple[int, ...] = option((512, 1024, 2048, 4096, 8192), "prefix lengths in tokens", minimum=1)
    prefill_chunk: int = option(2048, "tokens per prefill forward", minimum=1)
    num_tokens: tuple[int, ...] = option((1, 2, 4, 8, 16), "tokens per verification forward", minimum=1)
    repeats: int = option(7, "timed forwards per (prefix, k, path), median", minimum=1)
    warmup: int = option(2, "untimed forwards per (prefix, k, path) first", minimum=0)


@dataclass(frozen=True, kw_only=True)
class MemorySettings(Settings):
    """`run_memory_benchmark`'s settings: each process generates in `dtype` on `num_threads` torch threads (None:
    torch's choice; the command's --dtype and --num-threads), and is given `timeout` seconds (None: no limit)."""

    prompt_lengths: tuple[int, ...] = option(
        (1024, 8192), "prompt lengths in tokens (seeded random ids), one plain and one assisted run each", minimum=1
    )
    max_new_tokens: int = option(16, "new tokens per generate call", minimum=1)
    dtype: str = "float32"
    num_threads: int | None = option(1, minimum=1)
    timeout: float | None = 1800

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(self.dtype in ("float32", "bfloat16", "float16"), "dtype", "pass float32, bfloat16 or float16")
        self._require(self.timeout is None or self.timeout > 0, "timeout", "pass None or seconds > 0")


@dataclass(frozen=True, kw_only=True)
class TauSettings(Settings):
    """`run_tau_benchmark`'s settings."""

    max_new_tokens: int = option(64, "greedy new tokens per prompt", minimum=1)
    whole_blocks: bool = option(
        False, "draft whole blocks (confidence thresholds 0) instead of each drafter's own generation config"
    )
    drafter_alone: bool = option(
        False, "the drafter alone: lookup off and costs 0, so that every round drafts (tau is the drafter's own)"
    )

    def drafter_fields(self) -> dict[str, Any]:
        """The generation-config fields these settings set on every drafter."""
        return {**(WHOLE_BLOCKS if self.whole_blocks else {}), **(DRAFTER_ALONE if self.drafter_alone else {})}
