"""The fast verification path: grouped-head attention and reserved cache rows give the stock path's logits."""

import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.cache_utils import DynamicLayer

from helpers import make_drafter, make_target
from transformers_longspark.inference.verification import (
    ATTENTION_NAME,
    ReservedDynamicLayer,
    fast_verification,
    grouped_verification_attention,
)

EXTRA_TARGETS = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}


def build_target(kind: str, num_heads: int = 4, num_kv_heads: int = 2, dtype=torch.float32):
    if kind in EXTRA_TARGETS:
        config_cls, model_cls = EXTRA_TARGETS[kind]
        torch.manual_seed(0)
        config = config_cls(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=8,
                            max_position_embeddings=1024)  # fmt: skip
        target = model_cls(config).eval()
    else:
        target = make_target(
            kind, hidden_size=48, num_hidden_layers=2, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads
        )
    return target.to(dtype)


def cached_forward(target, ids, attention_mask, prefix: int, fast: bool) -> torch.Tensor:
    """Prefills `ids[:, :prefix]` with the stock path, then returns the logits of one forward over the rest."""
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(ids[:, :prefix], attention_mask=attention_mask[:, :prefix], position_ids=positions[:, :prefix],
               cache=cache)  # fmt: skip
        with fast_verification(target) if fast else torch.no_grad():
            return target(ids[:, prefix:], attention_mask=attention_mask, position_ids=positions[:, prefix:],
                          cache=cache).logits  # fmt: skip


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen2", "mistral"])
@pytest.mark.parametrize("heads", [(4, 4), (12, 4), (12, 3)], ids=["gqa1", "gqa3", "gqa4"])
@pytest.mark.parametrize("prefix", [5, 300], ids=["short", "long"])
@pytest.mark.parametrize("left_padding", [0, 3], ids=["unpadded", "left-padded"])
def test_fast_verification_logits_equal_the_stock_path(kind, heads, prefix, left_padding):
    target = build_target(kind, *heads)
    ids = torch.randint(0, 64, (1, prefix + 16), generator=torch.Generator().manual_seed(prefix))
    mask = torch.ones_like(ids)
    mask[:, :left_padding] = 0
    for block in range(1, 17):
        stock = cached_forward(target, ids[:, : prefix + block], mask[:, : prefix + block], prefix, fast=False)
        fast = cached_forward(target, ids[:, : prefix + block], mask[:, : prefix + block], prefix, fast=True)
        torch.testing.assert_close(fast, stock, rtol=1e-5, atol=1e-5, msg=f"block of {block} tokens")


def test_fast_verification_in_bfloat16():
    target = build_target("qwen3", 12, 4, dtype=torch.bfloat16)
    ids = torch.randint(0, 64, (1, 308), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    stock = cached_forward(target, ids, mask, 300, fast=False).float()
    fast = cached_forward(target, ids, mask, 300, fast=True).float()
    torch.testing.assert_close(fast, stock, rtol=2e-2, atol=2e-2)


def test_the_grouped_attention_never_materialises_repeated_keys_or_values():
    """No op inside it produces a tensor as large as K repeated over the group (what `repeat_kv` or a broadcasting
    matmul would write), and it equals SDPA with grouped-query attention."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestOutput(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor):
                    self.largest = max(self.largest, tensor.numel())
            return out

    query, key, value = torch.randn(1, 12, 8, 64), torch.randn(1, 3, 500, 64), torch.randn(1, 3, 500, 64)
    mask = torch.ones(1, 1, 8, 500, dtype=torch.bool).tril_(diagonal=492)
    module = torch.nn.Module()
    with LargestOutput() as watch:
        out, _ = grouped_verification_attention(module, query, key, value, mask, scaling=0.3)
    assert watch.largest < 2 * key.numel()  # scores are (1, 3, 4 * 8, 500); K repeated 4 times would be 4x K
    reference = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3,
                                                                  enable_gqa=True)  # fmt: skip
    torch.testing.assert_close(out, reference.transpose(1, 2))
    unmasked, _ = grouped_verification_attention(module, query, key, value, None, scaling=0.3)
    torch.testing.assert_close(unmasked, out)  # None means bottom-right causal, as the mask above


def test_the_grouped_attention_masks_padded_prefixes_and_block_corners_like_sdpa():
    """A mask that attends to the whole prefix is applied to the block's corner only; one that hides prefix columns
    (left padding, a window) to every column. Both equal SDPA, and a query that sees nothing gets zeros."""
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 6, 5, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g),
                         torch.randn(2, 2, 40, 16, generator=g))  # fmt: skip
    causal = torch.ones(2, 1, 5, 40, dtype=torch.bool).tril_(diagonal=35)
    padded = causal.clone()
    padded[1, :, :, :7] = False  # row 1 is left-padded by 7 columns
    window = causal.clone()
    window[:, :, 3:, :4] = False  # the last queries no longer see the first columns
    empty = causal.clone()
    empty[0, :, 2] = False  # a query that attends to nothing
    module = torch.nn.Module()
    for mask in (causal, padded, window, empty):
        out, _ = grouped_verification_attention(module, query, key, value, mask, scaling=0.25)
        reference = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.25,
                                                                      enable_gqa=True).transpose(1, 2)  # fmt: skip
        sees = mask.any(dim=-1)[:, 0]  # (b, k)
        torch.testing.assert_close(out[sees], reference[sees])
        assert torch.equal(out[~sees], torch.zeros_like(out[~sees]))


def test_reserved_layer_matches_a_dynamic_layer_through_updates_and_crops():
    reserved, dynamic = ReservedDynamicLayer(capacity=6), DynamicLayer()
    g = torch.Generator().manual_seed(0)
    for rows, crop in [(4, 0), (3, -2), (8, -1), (1, 0), (5, -5), (2, 0)]:  # outgrows the 6 reserved rows twice
        k, v = torch.randn(1, 2, rows, 4, generator=g), torch.randn(1, 2, rows, 4, generator=g)
        for layer in (reserved, dynamic):
            layer.update(k, v)
            layer.crop(crop)
        torch.testing.assert_close(reserved.keys, dynamic.keys, rtol=0, atol=0)
        torch.testing.assert_close(reserved.values, dynamic.values, rtol=0, atol=0)
        assert reserved.get_seq_length() == dynamic.get_seq_length()
    assert reserved.capacity >= 12
    exact = ReservedDynamicLayer(capacity=10)
    exact.update(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4))
    assert exact.capacity == 10 and exact._key_buffer.shape[-2] == 10  # a reserve that fits is not over-allocated
    reserved.batch_select_indices(torch.tensor([0]))  # replaces the tensors: the next update reallocates
    dynamic.batch_select_indices(torch.tensor([0]))
    k = torch.randn(1, 2, 3, 4)
    torch.testing.assert_close(reserved.update(k, k)[0], dynamic.update(k, k)[0], rtol=0, atol=0)


def test_generate_switches_attention_only_inside_assisted_decoding(monkeypatch):
    from transformers_longspark.inference import verification

    target = make_target("qwen3")
    drafter = make_drafter(target)
    calls = []
    original = verification.grouped_verification_attention

    def spy(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return original(module, query, *args, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, spy)
    try:
        prompt = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
        plain = target.generate(prompt, max_new_tokens=10, do_sample=False)
        assert calls == [] and target.config._attn_implementation == "sdpa"
        assisted = target.generate(prompt, max_new_tokens=10, do_sample=False, assistant_model=drafter)
        assert torch.equal(plain, assisted)
        # Each layer sees the prefill's 12 queries (and hands them to stock sdpa), then each verification's block.
        layers = target.config.num_hidden_layers
        assert calls[:layers] == [prompt.shape[1]] * layers
        assert 1 < max(calls[layers:]) <= drafter.config.block_size + 1
        assert target.config._attn_implementation == "sdpa"

        drafter.fast_verification = False
        calls.clear()
        assert torch.equal(target.generate(prompt, max_new_tokens=10, do_sample=False, assistant_model=drafter), plain)
        assert calls == []
    finally:  # the registered dispatcher, not the kernel itself (other threads must keep finding stock `sdpa`)
        AttentionInterface.register(ATTENTION_NAME, verification._this_threads_attention)


def test_fast_verification_restores_the_model_and_keeps_other_attention_implementations():
    target = make_target("llama")
    with pytest.raises(RuntimeError), fast_verification(target):
        assert target.config._attn_implementation == ATTENTION_NAME
        raise RuntimeError("inside generate")
    assert target.config._attn_implementation == "sdpa"
    target.config._attn_implementation = "eager"
    with fast_verification(target):
        assert target.config._attn_implementation == "eager"


def test_prompt_lookup_opts_in_and_stays_exact():
    """The README's opt-in for other modes: attention switched and cache rows reserved, outputs unchanged."""
    target = make_target("llama")
    prompt = torch.randint(0, 8, (1, 40), generator=torch.Generator().manual_seed(0))  # repetitive: lookups hit
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
    cache = DynamicCache(config=target.config)
    with fast_verification(target, cache, max_length=prompt.shape[1] + 20 + 5 + 1):
        lookup = target.generate(prompt, max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=5, cache=cache)
    assert torch.equal(plain, lookup)
    assert all(isinstance(layer, ReservedDynamicLayer) for layer in cache.layers)
    assert cache.layers[0].capacity == prompt.shape[1] + 26  # the reserve was enough: never reallocated
