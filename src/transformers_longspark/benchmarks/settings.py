"""The benchmarks' choices, defaults and settings: one frozen, validated settings object per entry point.

Imports nothing heavy, so that `longspark bench --help` reads the defaults without torch. Each object checks its
values when built (a `ValueError` naming the field and the fix), so a bad value is refused before any model loads;
`longspark bench` builds them from its options (`Settings.from_args`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

# speed.py
MODES = ("greedy", "sampled")
# The plain paths: stock `generate`, the same on the fast verification path (reserved cache rows, grouped-head
# attention) and with transformers' static cache. Every speedup is reported over `plain` and over the fastest of these.
PLAIN_METHODS = ("plain", "plain_fast", "plain_static")
METHODS = (*PLAIN_METHODS, "prompt_lookup", "prompt_lookup_fast", "longspark", "longspark_drafter_only",
           "longspark_lookup_only", "longspark_no_proposals", "full_prefix")  # fmt: skip
# Which methods run in which decoding mode by default (the full-prefix baseline is measured greedily).
DEFAULT_METHODS = {"greedy": METHODS, "sampled": tuple(m for m in METHODS if m != "full_prefix")}
# Generation-config settings of the attribution methods: the cost model off (every round proposes), and the drafter
# alone (lookup off too: every round drafts), as `longspark_drafter_only` and `bench tau --drafter-alone` run it.
COSTS_OFF = {"calibrate_costs": False, "draft_round_cost": 0.0, "verify_round_cost": 0.0, "verify_token_cost": 0.0}
DRAFTER_ALONE = {"lookup_min_match": 0, **COSTS_OFF}
WHOLE_BLOCKS = {"assistant_confidence_threshold": 0.0, "block_confidence_threshold": 0.0}
# Drafter methods and what each changes on the drafter for its runs (`speed.drafter_settings`): the shipped
# configuration, and its attribution: each source alone, and neither (every round a plain step on the fast path: the
# path's own cost). Any other setting is an A/B variant of the run (`--variant NAME KEY=VALUE ...`).
DRAFTER_METHODS: dict[str, dict[str, Any]] = {
    "longspark": {},
    "longspark_drafter_only": DRAFTER_ALONE,
    "longspark_lookup_only": {"use_drafter": False},
    "longspark_no_proposals": {"lookup_min_match": 0, "use_drafter": False},
    "full_prefix": {},
}
# The drafter attributes a variant may set besides its generation config (`speed.drafter_settings`), with what they
# are outside one.
DRAFTER_SWITCHES = {"fast_verification": True, "packed_weights": True, "linear_dtype": "auto"}
# drafting_cost.py --with-lookup: the lookup source's settings.
DEFAULT_LOOKUP_MIN_MATCH = 2
DEFAULT_LOOKUP_NUM_TOKENS = 10

# prompts.py
DEFAULT_LONG_LENGTHS = (2048, 4096, 8192)
SHORT_SOURCES = ("gsm8k", "mmath-en", "stdlib-code")
HELD_OUT_DIR = Path("data") / "smollm2" / "held_out"

# drafting_cost.py and verify_cost.py
DEFAULT_PREFIX_LENGTHS = (512, 1024, 2048, 4096, 8192)
DEFAULT_SYNTHETIC_PREFIX_LENGTHS = (32768, 65536, 131072)
DEFAULT_VERIFY_PREFIX_LENGTHS = DEFAULT_PREFIX_LENGTHS
DEFAULT_NUM_TOKENS = (1, 2, 4, 8, 16)

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


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What every benchmark takes: the seed of its random ids and sampling, and progress bars on stderr."""

    seed: int = 0
    progress: bool = False

    # Fields given as lists are kept as tuples (frozen); `OPTIONS` names the command-line option of a field whose
    # option has another name (for the messages).
    OPTIONS: ClassVar[Mapping[str, str]] = {}

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, list):
                object.__setattr__(self, item.name, tuple(value))

    def _require(self, ok: bool, name: str, fix: str) -> None:
        """Raises `ValueError` naming the field, its value and `fix`, unless `ok`."""
        if not ok:
            option = self.OPTIONS.get(name, "--" + name.replace("_", "-"))
            value = getattr(self, name)
            raise ValueError(f"{type(self).__name__}.{name}={value!r} ({option}): {fix}.")

    def _require_counts(self, *names: str, minimum: int = 1) -> None:
        """Each field of `names` is an integer >= `minimum`, or a non-empty tuple of them."""
        for name in names:
            value = getattr(self, name)
            values = value if isinstance(value, tuple) else (value,)
            valid = bool(values) and all(isinstance(v, int) and v >= minimum for v in values)
            self._require(valid, name, f"pass {'integers' if isinstance(value, tuple) else 'an integer'} >= {minimum}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any):
        """The settings of `longspark bench`'s parsed options: each field from the option of the same name
        (`progress` from `--quiet`), then `overrides`."""
        values = {item.name: getattr(args, item.name) for item in fields(cls) if hasattr(args, item.name)}
        values["progress"] = not getattr(args, "quiet", False)
        return cls(**{**values, **overrides})


@dataclass(frozen=True, kw_only=True)
class SpeedSettings(Settings):
    """`run_speed_benchmark`'s settings.

    Attributes:
        max_new_tokens: new tokens per `generate` call.
        modes: `"greedy"` and/or `"sampled"` (at `temperature`, no top-k/top-p).
        methods: per mode (`{"greedy": [...], "sampled": [...]}`) or for every mode, from `METHODS` and the variants;
            None: `DEFAULT_METHODS` (the full-prefix baseline greedy only) and every variant. `"plain"` is always
            added.
        temperature: temperature of the sampled mode.
        prompt_lookup_num_tokens: tokens prompt lookup proposes.
        variants: `{name: settings}`: LongSpark with these settings changed (`speed.drafter_settings`), each one more
            method of the run: fields of the drafter's generation config, or `DRAFTER_SWITCHES`.
        ignore_eos: force exactly `max_new_tokens` tokens (`min_new_tokens`) for equal-length runs.
        warmup: run every (mode, method) once, untimed, on the first prompt before measuring.
        seed: sampled runs of prompt `i` start from the RNG seed `seed + i` for every method.
    """

    max_new_tokens: int = 128
    modes: tuple[str, ...] = MODES
    methods: Mapping[str, Sequence[str]] | Sequence[str] | None = None
    temperature: float = 1.0
    prompt_lookup_num_tokens: int = 7
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    ignore_eos: bool = False
    warmup: bool = True

    OPTIONS: ClassVar[Mapping[str, str]] = {"variants": "--variant"}

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require_counts("max_new_tokens", "prompt_lookup_num_tokens")
        _check_modes(self)
        object.__setattr__(self, "variants", {name: check_variant(name, s) for name, s in self.variants.items()})
        for names in self.methods_per_mode().values():
            unknown = [m for m in names if m not in METHODS and m not in self.variants]
            if unknown:
                raise ValueError(f"Unknown methods {unknown}; choose from {', '.join([*METHODS, *self.variants])}.")

    def methods_per_mode(self) -> dict[str, list[str]]:
        """The methods of each mode: the defaults (and every variant), or the given ones, with `plain` first."""
        if self.methods is None:
            per_mode = {mode: [*DEFAULT_METHODS[mode], *self.variants] for mode in self.modes}
        elif isinstance(self.methods, Mapping):
            per_mode = {mode: list(self.methods.get(mode, ())) for mode in self.modes}
        else:
            per_mode = {mode: list(self.methods) for mode in self.modes}
        for names in per_mode.values():
            if "plain" not in names:
                names.insert(0, "plain")  # the reference of speedups and of greedy losslessness
        return per_mode


def _check_modes(settings: SpeedSettings | BatchedSettings) -> None:
    modes = settings.modes
    settings._require(bool(modes) and set(modes) <= set(MODES), "modes", f"choose from {', '.join(MODES)}")
    settings._require("sampled" not in modes or settings.temperature > 0, "temperature", "pass a temperature > 0")


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
class BatchedSettings(Settings):
    """`run_batched_benchmark`'s settings.

    Attributes:
        batch_sizes: a batch of `b` takes the first `b` prompts of a workload, cycled.
        max_new_tokens, modes, temperature, ignore_eos: as `SpeedSettings`.
        pad_token_id: left-padding id (None: the target's pad, else its EOS, else 0).
        repeats / warmup: timed and untimed `generate` calls per method and batch (`common.measure`, interleaved).
    """

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    max_new_tokens: int = 128
    modes: tuple[str, ...] = ("greedy",)
    pad_token_id: int | None = None
    temperature: float = 1.0
    ignore_eos: bool = False
    repeats: int = 1
    warmup: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require_counts("batch_sizes", "max_new_tokens", "repeats")
        self._require_counts("warmup", minimum=0)
        _check_modes(self)


@dataclass(frozen=True, kw_only=True)
class DraftingCostSettings(Settings):
    """`run_drafting_cost`'s settings.

    Attributes:
        prefix_lengths: real-target prefixes, prefilled by the target (beyond `max_position_embeddings` skipped
            unless `allow_extrapolation`).
        rounds / warmup: measured and untimed drafting rounds per length (medians over `rounds`).
        allow_extrapolation: also time prefixes beyond the target's `max_position_embeddings`.
        prefill_chunk: tokens per prefill forward.
        synthetic_prefix_lengths: prefixes timed on a synthetic cache (`drafting_cost.synthetic_cache`), any length.
        lookup_min_match: > 0 also times the round with the lookup source on (`longspark_lookup`); 0: off.
        lookup_num_tokens: tokens the lookup continuation proposes (None: the drafter's own setting).
        lookup_new_tokens: tokens committed per lookup round, indexed before each query (None: block size + 1).
    """

    prefix_lengths: tuple[int, ...] = DEFAULT_PREFIX_LENGTHS
    rounds: int = 20
    warmup: int = 3
    allow_extrapolation: bool = False
    prefill_chunk: int = 1024
    synthetic_prefix_lengths: tuple[int, ...] = ()
    lookup_min_match: int = 0
    lookup_num_tokens: int | None = None
    lookup_new_tokens: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require_counts("rounds", "prefill_chunk")
        self._require_counts("warmup", "lookup_min_match", minimum=0)
        for name in ("lookup_num_tokens", "lookup_new_tokens"):
            self._require(getattr(self, name) is None or getattr(self, name) >= 1, name, "pass None or a count >= 1")

    def lookup_fields(self) -> dict[str, int]:
        """The drafter's generation-config fields that turn its lookup source on (none when `lookup_min_match` is 0)."""
        if not self.lookup_min_match:
            return {}
        num_tokens = {} if self.lookup_num_tokens is None else {"lookup_num_tokens": self.lookup_num_tokens}
        return {"lookup_min_match": self.lookup_min_match, **num_tokens}


@dataclass(frozen=True, kw_only=True)
class VerifyCostSettings(Settings):
    """`run_verify_cost`'s settings: `prefix_lengths` x `num_tokens` (tokens per verification forward), medians of
    `repeats` forwards after `warmup` untimed ones, prefills of `prefill_chunk` tokens per forward."""

    prefix_lengths: tuple[int, ...] = DEFAULT_VERIFY_PREFIX_LENGTHS
    num_tokens: tuple[int, ...] = DEFAULT_NUM_TOKENS
    repeats: int = 7
    warmup: int = 2
    prefill_chunk: int = 2048

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require_counts("prefix_lengths", "num_tokens", "repeats", "prefill_chunk")
        self._require_counts("warmup", minimum=0)


@dataclass(frozen=True, kw_only=True)
class MemorySettings(Settings):
    """`run_memory_benchmark`'s settings: one plain and one assisted process per prompt length (seeded random ids),
    each generating `max_new_tokens` greedy tokens in `dtype` on `num_threads` torch threads (None: torch's choice),
    each given `timeout` seconds (None: no limit)."""

    prompt_lengths: tuple[int, ...] = (1024, 8192)
    max_new_tokens: int = 16
    dtype: str = "float32"
    num_threads: int | None = 1
    timeout: float | None = 1800

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require_counts("prompt_lengths", "max_new_tokens")
        self._require(self.dtype in ("float32", "bfloat16", "float16"), "dtype", "pass float32, bfloat16 or float16")
        self._require(self.num_threads is None or self.num_threads >= 1, "num_threads", "pass None or a count >= 1")
        self._require(self.timeout is None or self.timeout > 0, "timeout", "pass None or seconds > 0")


@dataclass(frozen=True, kw_only=True)
class TauSettings(Settings):
    """`run_tau_benchmark`'s settings: `max_new_tokens` greedy tokens per prompt; `whole_blocks` drafts whole blocks
    (confidence thresholds 0), as the drafter was trained; `drafter_alone` turns the lookup source and the cost model
    off, so that every round drafts."""

    max_new_tokens: int = 64
    whole_blocks: bool = False
    drafter_alone: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require_counts("max_new_tokens")

    def drafter_fields(self) -> dict[str, Any]:
        """The generation-config fields these settings set on every drafter."""
        return {**(WHOLE_BLOCKS if self.whole_blocks else {}), **(DRAFTER_ALONE if self.drafter_alone else {})}
