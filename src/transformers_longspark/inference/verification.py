"""The target's verification forward near the memory floor.

Each LongSpark round verifies `k <= B + 1` tokens in one cached target forward. With transformers' stock `sdpa` path
that forward costs several one-token steps at long prefixes, for three reasons that have nothing to do with the
drafter:

1. **Grouped K/V heads are repeated.** With a mask and more than one query token, `sdpa_attention_forward` expands
   every layer's cached K and V to all query heads (`repeat_kv`): a copy of the whole cache per forward (on CPU and,
   whenever a mask is passed, on CUDA). `grouped_verification_attention` instead folds the query heads of each K/V
   group into the query-length axis, `(b, h, k, d) -> (b, h_kv, g * k, d)`, so each cached row is read once and
   nothing prefix-sized is written. The mask is the one `sdpa` gets (bottom-right causal over the block, with left
   padding), broadcast over the group, never copied; on CPU, when every query sees the whole prefix (no left
   padding), only the block's own `k x k` corner of the scores is filled.
2. **The cache is concatenated.** `DynamicLayer.update` appends with `torch.cat`, copying each layer's whole cache
   at every forward. `ReservedDynamicLayer` appends into storage reserved for the whole generation, so a forward
   writes only its own new rows; cropping rejected rows only shortens the view.
3. **On CPU, weights are repacked.** For more than one row, `F.linear` repacks every weight matrix per call;
   `packed_linear.packed_linear_weights` runs the linear layers from weights packed once instead, so verifying a few
   tokens reads the weights about once, as a one-token step does.
4. **Each layer runs a dozen module calls of Python.** `lean_layers.lean_forward` runs the decoder layers of Llama,
   Qwen2, Qwen3 and Mistral targets as the same operations without them (bit-identical outputs), a large share of a
   small target's step on a CPU.

`fast_verification(target, cache, max_length)` applies all four for the duration of one `generate` call with a
LongSpark drafter (the generate hook does this) and restores the target's attention implementation and linear
layers afterwards. The switch is per call and per thread: while it is on, the target's config names
`longspark_verification`, but a forward from any other thread (a plain `generate` on the same target in a server)
finds the stock `sdpa` function and mask behind that name, and the stock linear layers and decoder layers, so plain
`generate` is never affected, even concurrently. Other modes opt in the same way, e.g. prompt lookup:

    with fast_verification(target):
        target.generate(**inputs, prompt_lookup_num_tokens=10)

Queries longer than `MAX_FOLDED_QUERIES` (prefill) and single queries (a plain step, which `sdpa` serves without
repeating K/V heads) go to the stock `sdpa` kernel unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..packed_linear import MAX_PACKED_ROWS, packed_linear_weights
from ..transformers_private import attention_implementation, set_attention_implementation
from .lean_layers import RotaryFactors, lean_forward, supports_lean_forward

ATTENTION_NAME = "longspark_verification"
# Queries per forward up to which attention is computed on grouped heads; longer ones (prefill) use stock `sdpa`.
MAX_FOLDED_QUERIES = 64


def grouped_verification_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`softmax(q k^T * scaling + mask) v` over grouped K/V heads without repeating them.

    Args:
        query: `(b, h, k, d)`, the `k` new tokens' queries. key / value: `(b, h_kv, T, d)`, cache included.
        attention_mask: boolean `(b, 1, k, T)` (True = attend) as built for `sdpa`, or `None` (causal, no padding).

    Returns:
        `(b, k, h, d)` attention output and `None` (no attention weights), as every transformers attention function.
    """
    batch, num_heads, num_queries, head_dim = query.shape
    num_kv_heads, num_keys = key.shape[1], key.shape[2]
    unsupported = dropout > 0.0 or kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None
    float_mask = attention_mask is not None and attention_mask.dtype != torch.bool
    if unsupported or float_mask or num_queries > MAX_FOLDED_QUERIES:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)  # fmt: skip
    groups = num_heads // num_kv_heads
    if num_queries == 1:
        # A plain step: the group's query heads fold into `sdpa`'s query axis, so its fused kernel reads each K/V head
        # once without expanding it (2 threads, 9 query / 3 K/V heads of 64, 6,144 rows: 370 us against 610-690 us
        # with `enable_gqa`); a boolean `(b, 1, 1, T)` padding mask broadcasts over the folded heads.
        folded = query.reshape(batch, num_kv_heads, groups, head_dim)  # head h reads K/V head h // groups
        out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask,
                                                               scale=scaling)  # fmt: skip
        return out.reshape(batch, num_heads, 1, head_dim).transpose(1, 2), None
    scaling = head_dim**-0.5 if scaling is None else scaling
    prefix = num_keys - num_queries  # cached rows before the block
    # Head h uses K/V head h // groups (as `repeat_kv`), so the group folds into the query axis: one plain matmul per
    # K/V head. (A separate group axis would broadcast K and V in `matmul`, which copies them `groups` times.)
    grouped = (query * scaling).reshape(batch, num_kv_heads, groups * num_queries, head_dim)  # (b, h_kv, g * k, d)
    scores = torch.matmul(grouped, key.transpose(-1, -2))  # (b, h_kv, g * k, T)
    by_group = scores.view(batch, num_kv_heads, groups, num_queries, num_keys)
    # Without left padding every query sees the whole prefix, so on CPU only the block's own `k x k` corner is
    # masked: a fill over all `T` columns costs about as much as the two matmuls there at 8 queries and 8K rows.
    # (On CUDA the fill is cheap, and the check would synchronise at every layer.)
    sees_prefix = attention_mask is None or (
        query.device.type == "cpu" and prefix > 0 and bool(attention_mask[..., :prefix].all())
    )
    if attention_mask is None:
        if num_queries > 1:  # bottom-right causal: query i sees the prefix and block tokens 0..i
            future = torch.ones(num_queries, num_queries, dtype=torch.bool, device=query.device).triu_(1)
            by_group[..., prefix:].masked_fill_(future, float("-inf"))
    elif sees_prefix:
        by_group[..., prefix:].masked_fill_(~attention_mask[:, :, None, :, prefix:], float("-inf"))
    else:
        by_group.masked_fill_(~attention_mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs, value)  # (b, h_kv, g * k, d)
    if not sees_prefix:
        # A query that may attend to nothing (a left-padding position of a batched prefill) gets zeros, as in `sdpa`,
        # not NaN: its K/V rows stay finite, so masking them later is enough.
        attends_to_nothing = ~attention_mask.any(dim=-1)[:, :, None, :, None]  # (b, 1, 1, k, 1)
        out.view(batch, num_kv_heads, groups, num_queries, head_dim).masked_fill_(attends_to_nothing, 0.0)
    return out.view(batch, num_heads, num_queries, head_dim).transpose(1, 2).contiguous(), None


class _ThreadState(threading.local):
    depth = 0  # `fast_verification` blocks open in this thread; 0: every forward takes the stock `sdpa` path


_thread = _ThreadState()
# Per model config: (the attention implementation to restore, open `fast_verification` blocks in all threads, the
# decoder layers whose forward the first block made lean).
_switched: dict[int, tuple[str, int, list[torch.nn.Module]]] = {}
_switch_lock = threading.Lock()


def _this_threads_attention(module: torch.nn.Module, *args, **kwargs) -> tuple[torch.Tensor, None]:
    """What the switched name runs: the grouped kernel inside this thread's `fast_verification`, stock `sdpa` for a
    forward from any other thread (which sees the switched config of a shared target)."""
    attention = grouped_verification_attention if _thread.depth else sdpa_attention_forward
    return attention(module, *args, **kwargs)


AttentionInterface.register(ATTENTION_NAME, _this_threads_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def _this_threads_layer(lean: Callable[..., torch.Tensor], stock: Callable[..., torch.Tensor], *args, **kwargs):
    """What a lean decoder layer runs: `lean` inside this thread's `fast_verification`, its stock forward for a forward
    from any other thread."""
    return (lean if _thread.depth else stock)(*args, **kwargs)


def _make_layers_lean(model: PreTrainedModel) -> list[torch.nn.Module]:
    """Gives each decoder layer of `model` that `lean_layers` reproduces a lean forward; returns them, for
    `_restore_layers`."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = [layer for layer in getattr(decoder, "layers", ()) if supports_lean_forward(layer)]
    layers = [layer for layer in layers if "forward" not in vars(layer)]  # already replaced by someone else: keep
    rotary = RotaryFactors()
    for layer in layers:
        lean = lean_forward(layer, rotary)
        layer.forward = functools.partial(_this_threads_layer, lean, type(layer).forward.__get__(layer))
    return layers


def _restore_layers(layers: list[torch.nn.Module]) -> None:
    for layer in layers:
        del layer.forward


class ReservedDynamicLayer(DynamicLayer):
    """A `DynamicLayer` that appends into reserved storage instead of concatenating.

    `keys` / `values` stay views `(b, h_kv, n, d)` of the first `n` rows of a `(b, h_kv, capacity, d)` buffer, so
    everything that reads a `DynamicLayer` (cropping, `get_seq_length`, LongSpark's window views) works unchanged.
    Rows past `n` are free: a crop only shortens the view, and the next update overwrites them. When the reserve
    runs out (or a method such as `batch_select_indices` replaced the tensors) the buffer is reallocated, 1.5x larger.
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.shape[-2]
        if not self._owns_rows(key_states, length + new):
            rows = length + new
            self._reallocate(key_states, value_states, self.capacity if rows <= self.capacity else (3 * rows) // 2)
        self._key_buffer[..., length : length + new, :].copy_(key_states)
        self._value_buffer[..., length : length + new, :].copy_(value_states)
        self.keys = self._key_buffer[..., : length + new, :]
        self.values = self._value_buffer[..., : length + new, :]
        return self.keys, self.values

    def _owns_rows(self, key_states: torch.Tensor, rows: int) -> bool:
        """Whether the buffer can take `rows` rows and `keys` is still a view of its start."""
        buffer = self._key_buffer
        if buffer is None or rows > buffer.shape[-2] or buffer.shape[:2] != key_states.shape[:2]:
            return False
        return self.get_seq_length() == 0 or self.keys.data_ptr() == buffer.data_ptr()

    def _reallocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        batch, heads, _, _ = key_states.shape
        keys = key_states.new_empty(batch, heads, capacity, key_states.shape[-1])
        values = value_states.new_empty(batch, heads, capacity, value_states.shape[-1])
        length = self.get_seq_length()
        if length:
            keys[..., :length, :].copy_(self.keys)
            values[..., :length, :].copy_(self.values)
        self._key_buffer, self._value_buffer, self.capacity = keys, values, capacity
        self.keys, self.values = keys[..., :length, :], values[..., :length, :]


def reserve_cache_rows(cache: Cache, num_rows: int) -> None:
    """Makes the empty full-attention `DynamicLayer`s of `cache` append into `num_rows` reserved rows per layer.

    Layers of other types (sliding windows, static or quantized caches) and layers already holding rows are kept.
    """
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and not layer.is_initialized:
            cache.layers[index] = ReservedDynamicLayer(num_rows)


@contextlib.contextmanager
def fast_verification(
    model: PreTrainedModel,
    cache: Cache | None = None,
    max_length: int | None = None,
    packed_weights: bool = True,
    blas_max_rows: int = 1,
    max_packed_rows: int = MAX_PACKED_ROWS,
    lean_layers: bool = True,
) -> Iterator[None]:
    """Verifies with `grouped_verification_attention` (and appends into reserved cache rows) inside the block.

    The attention implementation is switched only when the model uses `sdpa` (the default): a model set to `eager`,
    flash attention or a kernel keeps its own. Only forwards from this thread take the fast path (see the module
    docstring); the last block to exit, in any thread, restores the model's implementation, exceptions included.
    `cache` (still empty) gets `max_length` reserved rows per full-attention layer; it is not restored, as its layers
    hold the rows. With `packed_weights`, the model's CPU linear layers use packed weights (`packed_linear_weights`,
    which keeps them) in forwards of more than `blas_max_rows` and at most `max_packed_rows` tokens (the calibration
    measures where `F.linear` is faster: `packed_linear.measure_blas_max_rows`, `measure_max_packed_rows`). With
    `lean_layers`, the decoder layers run `lean_layers.lean_forward` (the first block to switch a model decides).
    """
    if cache is not None and max_length is not None:
        reserve_cache_rows(cache, max_length)
    config = model.config
    key = id(config)
    with _switch_lock:
        previous, count, lean = _switched.get(key, (attention_implementation(config), 0, []))
        switch = previous == "sdpa"
        if switch:
            if count == 0 and lean_layers:
                lean = _make_layers_lean(model)
            _switched[key] = (previous, count + 1, lean)
            set_attention_implementation(config, ATTENTION_NAME)
    _thread.depth += 1
    try:
        packed = packed_linear_weights(model, blas_max_rows=blas_max_rows, max_rows=max_packed_rows)
        with packed if packed_weights else contextlib.nullcontext():
            yield
    finally:
        _thread.depth -= 1
        if switch:
            with _switch_lock:
                previous, count, lean = _switched.pop(key)
                if count > 1:
                    _switched[key] = (previous, count - 1, lean)
                else:
                    set_attention_implementation(config, previous)
                    _restore_layers(lean)


__all__ = [
    "ATTENTION_NAME",
    "ReservedDynamicLayer",
    "fast_verification",
    "grouped_verification_attention",
    "reserve_cache_rows",
]
