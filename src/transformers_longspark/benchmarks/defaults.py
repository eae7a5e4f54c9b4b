"""The benchmarks' choices and defaults, in a module that imports nothing heavy: `longspark bench --help` reads them
without loading torch. The benchmark modules re-export them where they are used."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# speed.py
MODES = ("greedy", "sampled")
# The plain paths: stock `generate`, the same on the fast verification path (reserved cache rows, grouped-head
# attention) and with transformers' static cache. Every speedup is reported over `plain` and over the fastest of these.
PLAIN_METHODS = ("plain", "plain_fast", "plain_static")
METHODS = (
    *PLAIN_METHODS,
    "prompt_lookup",
    "prompt_lookup_fast",
    "longspark",
    "longspark_drafter_only",
    "longspark_lookup_only",
    "longspark_no_proposals",
    "full_prefix",
)
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
# drafting_cost.py --with-lookup: the lookup source's settings.
DEFAULT_LOOKUP_MIN_MATCH = 2
DEFAULT_LOOKUP_NUM_TOKENS = 10

# prompts.py
DEFAULT_LONG_LENGTHS = (2048, 4096, 8192)
SHORT_SOURCES = ("gsm8k", "mmath-en", "stdlib-code")
HELD_OUT_DIR = Path("data") / "smollm2" / "held_out"

# drafting_cost.py
DEFAULT_PREFIX_LENGTHS = (512, 1024, 2048, 4096, 8192)
DEFAULT_SYNTHETIC_PREFIX_LENGTHS = (32768, 65536, 131072)

# verify_cost.py
DEFAULT_VERIFY_PREFIX_LENGTHS = (512, 1024, 2048, 4096, 8192)
DEFAULT_NUM_TOKENS = (1, 2, 4, 8, 16)

# models.py
_QWEN3 = dict(
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    rms_norm_eps=1e-6,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    num_hidden_layers=36,
    bos_token_id=151643,
    eos_token_id=151645,
    pad_token_id=151643,
)
SYNTHETIC_TARGETS: dict[str, dict[str, Any]] = {
    "qwen3-4b": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False},
    "qwen3-14b": {
        **_QWEN3,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "tie_word_embeddings": False,
    },
    # For tests: Qwen3 layout (grouped K/V heads, QK-norm) at toy sizes.
    "tiny": {
        **_QWEN3,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    },
}
"""Qwen3 configs by name (hidden size, layers, heads, KV heads, head dim, MLP width as published)."""
