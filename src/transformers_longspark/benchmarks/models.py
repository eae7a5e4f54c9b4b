"""Models the benchmarks run: the full-prefix baseline drafter, and random-weight targets of known shapes.

Drafting and verification costs depend on shapes alone, so a random-weight target built from a published config
(`--synthetic-target qwen3-8b`) times them as the real model would, without downloading it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from ..configuration_longspark import LongSparkConfig
from ..modeling_longspark import LongSparkDrafterModel

_QWEN3 = dict(
    vocab_size=151936, max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    rms_norm_eps=1e-6, num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_hidden_layers=36,
    bos_token_id=151643, eos_token_id=151645, pad_token_id=151643,
)  # fmt: skip
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


def make_full_prefix_drafter(drafter: LongSparkDrafterModel) -> LongSparkDrafterModel:
    """The same drafter network and weights with `full_prefix_context=True`: it attends to every cached KV row of
    its paired target layers (the DFlash/DSpark-style baseline) instead of the window + global summary."""
    config = copy.deepcopy(drafter.config)
    config.full_prefix_context = True
    baseline = LongSparkDrafterModel(config)
    baseline.load_state_dict(drafter.state_dict())
    baseline.generation_config = copy.deepcopy(drafter.generation_config)  # the same confidence threshold
    parameter = next(drafter.parameters())
    return baseline.to(device=parameter.device, dtype=parameter.dtype).eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def synthetic_target_config(name: str) -> Qwen3Config:
    """The `Qwen3Config` of a `SYNTHETIC_TARGETS` entry."""
    if name not in SYNTHETIC_TARGETS:
        raise ValueError(f"Unknown synthetic target {name!r}; choose from {', '.join(SYNTHETIC_TARGETS)}.")
    config = Qwen3Config(**copy.deepcopy(SYNTHETIC_TARGETS[name]))
    config._name_or_path = f"synthetic:{name}"
    return config


def build_synthetic_target(
    name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> PreTrainedModel:
    """A random-weight `Qwen3ForCausalLM` with the shapes of `name` (e.g. `"qwen3-8b"`: 36 layers, hidden 4096).

    Parameters are allocated and initialised directly on `device` in `dtype` (a 16 GB bf16 model is never built in
    fp32 on the CPU first); initialising on a GPU takes well under a second.
    """
    config = synthetic_target_config(name)
    torch.manual_seed(seed)
    with torch.device(device), _default_dtype(dtype):
        model = Qwen3ForCausalLM(config)
    return model.eval().requires_grad_(False)


def build_random_drafter(target: PreTrainedModel, seed: int = 0, **overrides: Any) -> LongSparkDrafterModel:
    """A random-weight drafter of the default shapes for `target` (`LongSparkConfig.from_target_config`), on the
    target's device and in its dtype. Its tau is meaningless; its drafting cost is that of a trained one."""
    parameter = next(target.parameters())
    config = LongSparkConfig.from_target_config(target.config, **overrides)
    torch.manual_seed(seed)
    with torch.device(parameter.device), _default_dtype(parameter.dtype):
        drafter = LongSparkDrafterModel(config)
    return drafter.eval().requires_grad_(False)


__all__ = [
    "SYNTHETIC_TARGETS",
    "build_random_drafter",
    "build_synthetic_target",
    "make_full_prefix_drafter",
    "synthetic_target_config",
]
