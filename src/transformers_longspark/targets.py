"""What the drafter borrows from and reads out of its target model.

The drafter reuses the target's token embedding, final norm, LM head and rotary embedding (frozen, never stored in
its checkpoint), reads the selected layers' K/V rows from the target's own cache, and captures the selected layers'
hidden states with forward hooks, keeping only the last few positions so that nothing prefix-sized is retained.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from .configuration_longspark import SUPPORTED_TARGET_TYPES, LongSparkConfig


@dataclass(frozen=True)
class TargetModules:
    """The frozen target modules the drafter runs with. A plain container, so they never join the drafter's weights."""

    embed_tokens: nn.Module
    norm: nn.Module
    lm_head: nn.Module
    rotary_emb: nn.Module
    layers: nn.ModuleList


def target_modules(target: PreTrainedModel) -> TargetModules:
    decoder = target.get_decoder()
    return TargetModules(
        embed_tokens=target.get_input_embeddings(),
        norm=decoder.norm,
        lm_head=target.get_output_embeddings(),
        rotary_emb=decoder.rotary_emb,
        layers=decoder.layers,
    )


def _rope_signature(rope_parameters: dict | None) -> dict:
    return {k: v for k, v in (rope_parameters or {}).items() if v is not None}


def check_target_compatible(config: LongSparkConfig, target: PreTrainedModel, drafter_name: str | None = None) -> None:
    """Raises `ValueError` naming every mismatch between a drafter config and its target, and how to fix it.
    `drafter_name` (e.g. the drafter's folder) and the target's `name_or_path` are named in the message."""
    target_config = target.config
    if getattr(target_config, "is_encoder_decoder", False):
        raise ValueError(
            f"LongSpark drafts for decoder-only targets; {type(target).__name__} is an encoder-decoder model."
        )
    text_config = target_config.get_text_config()
    model_type = getattr(text_config, "model_type", None)
    if model_type not in SUPPORTED_TARGET_TYPES:
        raise ValueError(
            f"LongSpark does not support targets of type {model_type!r} "
            f"(supported: {', '.join(SUPPORTED_TARGET_TYPES)}): "
            "it needs full-attention layers whose KV cache can be read and cropped."
        )
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    expected = {
        "hidden_size": text_config.hidden_size,
        "vocab_size": text_config.vocab_size,
        "num_key_value_heads": text_config.num_key_value_heads or text_config.num_attention_heads,
        "head_dim": head_dim,
    }
    problems = [
        f"{name}: drafter {getattr(config, name)} != target {value}"
        for name, value in expected.items()
        if getattr(config, name) != value
    ]
    beyond = [i for i in config.target_layer_ids if i >= text_config.num_hidden_layers]
    if beyond:
        problems.append(f"target_layer_ids {beyond} are beyond the target's {text_config.num_hidden_layers} layers")
    if _rope_signature(config.rope_parameters) != _rope_signature(text_config.rope_parameters):
        problems.append(f"rope_parameters: drafter {config.rope_parameters} != target {text_config.rope_parameters}")
    if problems:
        drafter = f"The LongSpark drafter {drafter_name}" if drafter_name else "This LongSpark drafter"
        target_name = f" {target.name_or_path}" if getattr(target, "name_or_path", "") else ""
        raise ValueError(
            f"{drafter} does not match the target model{target_name}: "
            + "; ".join(problems)
            + ". Use a drafter trained for this target, or build one with "
            "`LongSparkConfig.from_target_config(target.config)`."
        )


def sliding_window_layers(config: PretrainedConfig) -> tuple[int | None, list[int]]:
    """`(window, layers)`: the sliding-window size of a target config and the indices of the layers that use it
    (`(None, [])` for a full-attention model).

    Per-layer `layer_types` decide where a config has them (Gemma, Qwen2/3, GPT-OSS); otherwise every layer slides
    when `sliding_window` is set and not switched off by `use_sliding_window=False` (Mistral, Qwen2 configs without
    `layer_types`). Every path (batch 1, batches, vLLM) asks this one helper."""
    config = config.get_text_config()
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None, []
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        layers = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    elif getattr(config, "use_sliding_window", True):
        layers = list(range(config.num_hidden_layers))
    else:
        layers = []
    return (window, layers) if layers else (None, [])


def check_sliding_window(target: PreTrainedModel, layer_ids: list[int], prompt_length: int) -> None:
    """Refuses sliding-window layers whose cache would evict prompt rows before the summary absorbs them."""
    window, sliding_layers = sliding_window_layers(target.config)
    sliding = [i for i in layer_ids if i in sliding_layers]
    if sliding and prompt_length >= window:
        raise ValueError(
            f"Target layers {sliding} use a sliding-window cache of {window} rows, which evicts rows of this "
            f"{prompt_length}-token prompt before the global summary can absorb them. Use a prompt shorter than "
            f"{window} tokens, or a drafter whose target_layer_ids are full-attention layers."
        )


def read_cache_rows(cache: Cache, layer_id: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last `num_rows` K/V rows of one target layer, as views `(1, num_kv_heads, num_rows, head_dim)`.

    `cache` is a transformers cache, or any object with a `last_rows(layer_id, num_rows)` method returning the same
    (e.g. `vllm.paged_kv.PagedRequestRows`, one request's rows in vLLM's paged cache)."""
    if not isinstance(cache, Cache) and hasattr(cache, "last_rows"):
        return cache.last_rows(layer_id, num_rows)
    layer = cache.layers[layer_id]
    if not isinstance(layer, (DynamicLayer, DynamicSlidingWindowLayer)):
        raise ValueError(
            f"LongSpark reads K/V rows from a dynamic cache, but target layer {layer_id} uses {type(layer).__name__}. "
            "Call generate() without a custom `cache` or `cache_implementation`."
        )
    if layer.keys.shape[2] < num_rows:
        raise ValueError(
            f"Target layer {layer_id} keeps {layer.keys.shape[2]} cached rows but the drafter needs {num_rows}; "
            "its cache evicted rows (sliding window). Use full-attention layers as target_layer_ids."
        )
    start = layer.keys.shape[2] - num_rows
    return layer.keys[:, :, start:], layer.values[:, :, start:]


class HiddenStateCapture:
    """Forward hooks that record the outputs of selected target layers, keeping only the last `keep` positions.

    `keep=None` keeps every position (training, and a serving engine's step). `hidden_of` turns a layer's output into
    its hidden state (default: the output, or its first element); a serving engine whose layers return
    `(mlp_output, residual)` passes their sum. Only forwards run by the thread that created the capture are recorded
    (another thread may run the same target meanwhile: a plain `generate` in a server), unless `any_thread`. The hooks
    are removed by `remove()` or when the capture object is garbage-collected.
    """

    def __init__(
        self,
        layers: nn.ModuleList,
        layer_ids: list[int],
        keep: int | None,
        hidden_of: Callable[[Any], torch.Tensor] | None = None,
        any_thread: bool = False,
    ):
        self.states: list[torch.Tensor | None] = [None] * len(layer_ids)
        buffer, handles, owner = self.states, [], threading.get_ident()
        hidden_of = hidden_of or _first_output
        for slot, layer_id in enumerate(layer_ids):

            def hook(module, args, output, slot=slot):
                if not any_thread and threading.get_ident() != owner:
                    return
                hidden = hidden_of(output)
                # clone(): a slice would keep the whole (batch, seq, hidden) output of a long prefill alive.
                buffer[slot] = (hidden if keep is None else hidden[:, -keep:].clone()).detach()

            handles.append(layers[layer_id].register_forward_hook(hook))
        self._finalizer = weakref.finalize(self, _remove_hooks, handles)

    def remove(self) -> None:
        self._finalizer()


def _first_output(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()
