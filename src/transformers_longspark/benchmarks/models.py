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
from .settings import SYNTHETIC_TARGETS


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


def build_synthetic_target(
    name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> PreTrainedModel:
    """A random-weight `Qwen3ForCausalLM` with the shapes of `name` (`SYNTHETIC_TARGETS`, e.g. `"qwen3-8b"`: 36
    layers, hidden 4096), allocated and initialised directly on `device` in `dtype` (a 16 GB bf16 model is never built
    in fp32 on the CPU first); initialising on a GPU takes well under a second."""
    if name not in SYNTHETIC_TARGETS:
        raise ValueError(f"Unknown synthetic target {name!r}; choose from {', '.join(SYNTHETIC_TARGETS)}.")
    config = Qwen3Config(**copy.deepcopy(SYNTHETIC_TARGETS[name]))
    config._name_or_path = f"synthetic:{name}"
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
