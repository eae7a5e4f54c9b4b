"""The reserved cache rows of the fast verification path (`verification.reserve_cache_rows`), end to end.

Only the target's plain, empty `DynamicLayer`s may be replaced by reserved ones: a sliding-window layer evicts rows and
a subclass may store them otherwise (quantized, offloaded), so they are kept as they are. The reserve must cover the
most rows a call can hold (batch 1: `max_length`; batched: the longest row, its slack of holes and one verification
block, `max_cache_columns`), so that it is allocated once and never grows: a reallocation copies the whole cache.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from helpers import make_drafter, make_target
from transformers_longspark.inference import verification
from transformers_longspark.inference.verification import ReservedDynamicLayer

LAYER_TYPES = ["full_attention", "sliding_attention", "full_attention", "full_attention"]


class OtherLayer(DynamicLayer):
    """A layer type of its own (as a quantized or offloaded layer is): not a plain `DynamicLayer`."""


@pytest.mark.parametrize("batch_size", [1, 2])
def test_only_plain_dynamic_layers_get_a_reserve(batch_size):
    """A target with a sliding-window layer (1) and a cache whose layer 3 is of another type: after an assisted call,
    layers 0 and 2 are reserved, 1 and 3 kept; outputs equal plain `generate`'s."""
    target = make_target("qwen3", sliding_window=256, use_sliding_window=True, layer_types=LAYER_TYPES)
    drafter = make_drafter(target)  # reads layers 0, 2 and 3
    prompts = torch.randint(0, 64, (batch_size, 9), generator=torch.Generator().manual_seed(1))
    # Short enough that the batched cache is never compacted (see the next test).
    options = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=10, do_sample=False, pad_token_id=0)
    reference = target.generate(prompts, **options)
    cache = DynamicCache(config=target.config)
    cache.layers[3] = OtherLayer()
    assert [type(layer) for layer in cache.layers] == [DynamicLayer, DynamicSlidingWindowLayer, DynamicLayer,
                                                       OtherLayer]  # fmt: skip
    assisted = target.generate(prompts, cache=cache, assistant_model=drafter, **options)
    assert torch.equal(assisted, reference)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [ReservedDynamicLayer, DynamicSlidingWindowLayer, ReservedDynamicLayer, OtherLayer], kinds


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "stock"])
def test_a_batched_call_on_a_target_with_a_sliding_window_layer_survives_compaction(fast):
    """The batched loop accepts a target with sliding-window layers whose window the batch cannot reach
    (`check_batched_generation`); its cache is compacted once its holes exceed their slack."""
    target = make_target("qwen3", sliding_window=256, use_sliding_window=True, layer_types=LAYER_TYPES)
    drafter = make_drafter(target)
    drafter.fast_verification = fast
    prompts = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    options = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=24, do_sample=False, pad_token_id=0)
    reference = target.generate(prompts, **options)
    assert torch.equal(target.generate(prompts, assistant_model=drafter, **options), reference)


def record_allocations(monkeypatch) -> list[tuple[int, int, int]]:
    """`(id(layer), capacity, rows held)` of every allocation of a reserved layer's buffer."""
    allocations, reallocate = [], ReservedDynamicLayer._reallocate

    def spy(self, key_states, value_states, capacity):
        allocations.append((id(self), capacity, self.get_seq_length() + key_states.shape[-2]))
        return reallocate(self, key_states, value_states, capacity)

    monkeypatch.setattr(ReservedDynamicLayer, "_reallocate", spy)
    return allocations


@pytest.mark.parametrize("lookup", [False, True], ids=["drafter", "lookup-longer-than-the-block"])
def test_a_batched_call_never_outgrows_its_reserve(lookup, monkeypatch):
    """A random drafter whose drafts are nearly all rejected leaves `k` holes per round, so the cache reaches its
    slack before each compaction; with lookup on, continuations of 8 tokens (twice the block) widen the rounds. Each
    reserved layer is allocated with `max_cache_columns` rows and never grows (the batch's rows leaving and the
    compactions reallocate at the same capacity), and the widest cache came close to it."""
    allocations = record_allocations(monkeypatch)
    widest, update = [0], ReservedDynamicLayer.update

    def spy_update(self, *args, **kwargs):
        keys, values = update(self, *args, **kwargs)
        widest[0] = max(widest[0], keys.shape[-2])
        return keys, values

    monkeypatch.setattr(ReservedDynamicLayer, "update", spy_update)
    target = make_target("llama", seed=3)
    drafter = make_drafter(target, block_size=4)
    drafter.generation_config.assistant_confidence_threshold = 0.0
    if lookup:
        drafter.generation_config.lookup_min_match, drafter.generation_config.lookup_num_tokens = 1, 8
    prompts = torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(prompts)
    mask[0, :2] = 0
    new_tokens = 40
    options = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    reference = target.generate(prompts, **options)
    assisted = target.generate(prompts, assistant_model=drafter, **options)
    assert torch.equal(assisted, reference)
    longest, block = prompts.shape[1] + new_tokens, 8 if lookup else drafter.config.block_size
    reserve = longest + max(4 * (block + 1), longest // 8) + block + 1  # the documented bound, by hand
    assert allocations and {capacity for _, capacity, _ in allocations} == {reserve}, (reserve, allocations)
    assert max(rows for _, _, rows in allocations) <= reserve
    # The run comes close enough to the bound that a reserve without its verification block (or, with lookup, sized
    # for the drafter's block instead of the longest proposal) would have grown.
    # The run comes within two blocks of the bound (which is loose by about one: the longest row's last rounds have
    # little room left to draft).
    assert reserve - widest[0] <= 2 * (block + 1), (reserve, widest[0])


def test_a_batch_1_call_allocates_its_reserve_once(monkeypatch):
    """Batch 1 reserves `max_length` rows per layer (a round never verifies past it): one allocation per layer."""
    allocations = record_allocations(monkeypatch)
    target = make_target("qwen3", seed=3)
    drafter = make_drafter(target, block_size=4)
    drafter.generation_config.assistant_confidence_threshold = 0.0
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=drafter)
    layers = target.config.num_hidden_layers
    assert len(allocations) == layers and {capacity for _, capacity, _ in allocations} == {36}, allocations
    assert verification.MAX_FOLDED_QUERIES >= 6  # the prefill went through the same layers
