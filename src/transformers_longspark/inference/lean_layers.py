"""Decoder layers without transformers' per-module Python, for the fast verification path.

A decoder layer's stock forward calls a dozen modules (two norms, the attention with four projections, the MLP with
three and its activation), each through `nn.Module.__call__`, plus keyword-deprecation wrappers, the attention
registry and the rotary helper. For a small target on a CPU that Python is a large share of a step (SmolLM2-135M on
2 vCPUs: docs/results.md, "Lean decoder layers"). `lean_forward(layer)` runs the same operations in the same
order on the same tensors, reading the weights straight from the submodules, so its output is bit-identical to the
stock layer's (tested for every supported architecture, one and several tokens, with and without padding).

The layer itself is still called through `nn.Module.__call__`, so its own forward hooks (LongSpark's hidden-state
capture) run as before. A layer whose submodules carry hooks (e.g. transformers' attention-weight recorder, a user's
probe), a layer in training mode, or torch's global module hooks send the call to the stock forward, where the hooks
fire.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..packed_linear import fused_linears

# The decoder layers whose stock forward `lean_forward` reproduces (the same operations in transformers 5.24-5.25):
# Llama's layer, and the ones that differ from it only in projection biases (Qwen2), a per-head RMS norm of queries
# and keys (Qwen3) or sliding-window masks built outside the layer (Mistral, Qwen2, Qwen3).
LEAN_LAYER_TYPES = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _rms_norm(hidden: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """transformers' `LlamaRMSNorm.forward` (Qwen2, Qwen3 and Mistral have the same): `weight * (x * rsqrt(mean(x^2)
    + eps))` in float32, cast back before the weight. On CPU torch's `rms_norm` composes the same operations in the
    same order as one call instead of seven (bit-identical: `tests/test_lean_layers.py`); elsewhere it may be a fused
    kernel that rounds differently, and a weight in another dtype than the input promotes in the stock formula, so
    there the operations are spelled out."""
    if hidden.device.type == "cpu" and norm.weight.dtype == hidden.dtype:
        return F.rms_norm(hidden, norm.weight.shape, norm.weight, norm.variance_epsilon)
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * hidden.to(dtype)


class RotaryFactors(threading.local):
    """`(cos, signed_sin)`, each `(b, 1, k, head_dim)`, of a forward's position embeddings `(cos, sin)`, made once per
    forward for all its layers (the decoder hands each layer the same tuple) and per thread: `rotate_half(x) * sin`
    is `x.roll(head_dim // 2, -1) * signed_sin` with the first half of `sin` negated, bit for bit (a negation is
    exact), in one operation instead of four."""

    def __init__(self):
        self._source: tuple[torch.Tensor, torch.Tensor] | None = None
        self._factors: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self._source is not position_embeddings:
            cos, sin = position_embeddings
            half = sin.shape[-1] // 2
            signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            self._source, self._factors = position_embeddings, (cos.unsqueeze(1), signed_sin.unsqueeze(1))
        return self._factors


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin` (`RotaryFactors`)."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, dims=-1) * signed_sin)


def supports_lean_forward(layer: nn.Module) -> bool:
    """Whether `lean_forward` reproduces `layer`'s stock forward: one of `LEAN_LAYER_TYPES` with the submodules it
    reads (a layer of another class, or one whose parts were replaced, keeps its own forward)."""
    if type(layer).__name__ not in LEAN_LAYER_TYPES:
        return False
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    if attention is not None:
        norms += [getattr(attention, name) for name in ("q_norm", "k_norm") if hasattr(attention, name)]
    linears = [getattr(attention, n, None) for n in _PROJECTIONS] + [getattr(mlp, n, None) for n in _MLP]
    return (
        all(type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon") for n in norms)
        and all(type(m) is nn.Linear for m in linears)
        and isinstance(getattr(mlp, "act_fn", None), nn.Module)
        and all(hasattr(attention, name) for name in ("head_dim", "scaling", "layer_idx"))
    )


def lean_forward(layer: nn.Module, rotary: RotaryFactors | None = None) -> Callable[..., torch.Tensor]:
    """The stock forward of `layer` (`supports_lean_forward`) without the submodule calls; the stock forward itself
    wherever a hook, training mode or torch's global hooks need it, or where the model's attention implementation is
    not a registered function (eager).

    The returned function takes the decoder layer's arguments: `hidden_states` `(b, k, hidden)`, `attention_mask` as
    the layer's attention function takes it, `position_embeddings` `(cos, sin)` each `(b, k, head_dim)`, `cache` (or
    `past_key_values`); returns `(b, k, hidden)`. Layers of one model share one `rotary`.
    """
    rotary = rotary or RotaryFactors()
    stock = type(layer).forward.__get__(layer)
    attn, mlp = layer.self_attn, layer.mlp
    q_proj, k_proj, v_proj, o_proj = (getattr(attn, name) for name in _PROJECTIONS)
    gate_proj, up_proj, down_proj = (getattr(mlp, name) for name in _MLP)
    input_norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    head_dim, scaling, layer_idx = attn.head_dim, attn.scaling, attn.layer_idx
    hooked = tuple(m for m in layer.modules() if m is not layer)  # whose hooks the stock forward would run

    def needs_stock() -> bool:
        return (
            layer.training
            or bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)
            or any(m._forward_hooks or m._forward_pre_hooks for m in hooked)
        )

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        attention = ALL_ATTENTION_FUNCTIONS.get(attn.config._attn_implementation)
        if args or attention is None or needs_stock():
            return stock(hidden_states, *args, **kwargs)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, head_dim)

        hidden = _rms_norm(hidden_states, input_norm)
        query, key, value = fused_linears(hidden, (q_proj, k_proj, v_proj))
        query, key = query.view(hidden_shape), key.view(hidden_shape)
        if q_norm is not None:
            query, key = _rms_norm(query, q_norm), _rms_norm(key, k_norm)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = value.view(hidden_shape).transpose(1, 2)
        cos, signed_sin = rotary(kwargs["position_embeddings"])
        query, key = _rotate(query, cos, signed_sin), _rotate(key, cos, signed_sin)
        if cache is not None:
            key, value = cache.update(key, value, layer_idx)
        out, _ = attention(attn, query, key, value, kwargs.get("attention_mask"), dropout=0.0, scaling=scaling)
        hidden_states = hidden_states + o_proj.forward(out.reshape(*input_shape, -1).contiguous())

        hidden = _rms_norm(hidden_states, post_norm)
        gate, up = fused_linears(hidden, (gate_proj, up_proj))
        hidden = down_proj.forward(mlp.act_fn.forward(gate) * up)
        return hidden_states + hidden

    return forward


__all__ = ["LEAN_LAYER_TYPES", "RotaryFactors", "lean_forward", "supports_lean_forward"]
