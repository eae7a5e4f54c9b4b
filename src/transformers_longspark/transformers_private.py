"""Every use of transformers' private API, in one place, with the range of transformers versions it was written for.

LongSpark plugs into `generate` where transformers has no public hook: it wraps three `GenerationMixin` methods
(`_get_candidate_generator`, `_validate_generation_mode`, `_assisted_decoding`; `inference/generation.py` holds the
wrappers), reads the EOS and pad tensors `generate` prepares on its generation config (`_eos_token_tensor`,
`_pad_token_tensor`), and switches a model config's attention implementation (`_attn_implementation`) for the fast
verification path. These names are not covered by transformers' deprecation policy, so `check_transformers` refuses,
before anything is patched, a version outside `SUPPORTED_TRANSFORMERS` or one that lacks them, with the fix;
`LONGSPARK_ALLOW_UNTESTED_TRANSFORMERS=1` lets a version outside the range through (the names are still checked).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import transformers
from packaging.version import Version
from transformers import GenerationConfig, PretrainedConfig
from transformers.generation.utils import GenerationMixin

# [lowest, highest) transformers versions whose private API below LongSpark was written and tested against.
SUPPORTED_TRANSFORMERS = ("5.24", "5.26")
ALLOW_UNTESTED_ENV = "LONGSPARK_ALLOW_UNTESTED_TRANSFORMERS"
PATCHED_METHODS = ("_get_candidate_generator", "_validate_generation_mode", "_assisted_decoding")


def check_transformers(version: str | None = None) -> None:
    """Raises `RuntimeError` naming the problem and the fix when the installed transformers (or `version`) is outside
    `SUPPORTED_TRANSFORMERS` (unless `LONGSPARK_ALLOW_UNTESTED_TRANSFORMERS=1`) or lacks a method LongSpark wraps."""
    version = version or transformers.__version__
    low, high = SUPPORTED_TRANSFORMERS
    allowed = os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0")
    if not Version(low) <= Version(version) < Version(high) and not allowed:
        raise RuntimeError(
            f"transformers-longspark hooks into private parts of transformers' generate(), written for "
            f"transformers>={low},<{high}; this is transformers {version}. Install a supported version "
            f"(pip install 'transformers>={low},<{high}'), or set {ALLOW_UNTESTED_ENV}=1 to try this one."
        )
    missing = [name for name in PATCHED_METHODS if not callable(getattr(GenerationMixin, name, None))]
    if missing:
        raise RuntimeError(
            f"transformers {version} has no GenerationMixin.{', '.join(missing)}, which LongSpark wraps to route "
            f"generate(assistant_model=drafter); install transformers>={low},<{high}."
        )


def original_generation_methods() -> dict[str, Callable[..., Any]]:
    """transformers' own `GenerationMixin` methods that LongSpark wraps, by name (read before any patch)."""
    return {name: getattr(GenerationMixin, name) for name in PATCHED_METHODS}


def patch_generation_methods(wrappers: dict[str, Callable[..., Any]]) -> None:
    """Replaces `GenerationMixin`'s methods by `wrappers` (idempotent), after `check_transformers`."""
    check_transformers()
    for name, wrapper in wrappers.items():
        if name not in PATCHED_METHODS:
            raise ValueError(f"{name} is not one of the GenerationMixin methods LongSpark wraps ({PATCHED_METHODS}).")
        setattr(GenerationMixin, name, wrapper)


def eos_token_tensor(generation_config: GenerationConfig):
    """The EOS ids `generate` prepared on its generation config (a tensor), or `None`."""
    return getattr(generation_config, "_eos_token_tensor", None)


def pad_token_tensor(generation_config: GenerationConfig):
    """The pad id `generate` prepared on its generation config (a tensor), or `None`."""
    return getattr(generation_config, "_pad_token_tensor", None)


def attention_implementation(config: PretrainedConfig) -> str:
    """The attention implementation the model's forwards look up (e.g. "sdpa")."""
    return config._attn_implementation


def set_attention_implementation(config: PretrainedConfig, name: str) -> None:
    """Makes the model's forwards look up the attention function registered under `name` (read at each forward)."""
    config._attn_implementation = name


__all__ = [
    "ALLOW_UNTESTED_ENV",
    "PATCHED_METHODS",
    "SUPPORTED_TRANSFORMERS",
    "attention_implementation",
    "check_transformers",
    "eos_token_tensor",
    "original_generation_methods",
    "pad_token_tensor",
    "patch_generation_methods",
    "set_attention_implementation",
]
