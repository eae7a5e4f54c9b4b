"""Lossless on CUDA: the fast verification path's logits, greedy equality (batch 1 and left-padded batches, random and
oracle drafters, lookup on) and the exact sampling law, each with the target and drafter on the GPU.

Skipped without a CUDA device (CI has none); `scripts/gpu_benchmarks.sh` runs this module first on a lent GPU.
`LONGSPARK_TEST_DEVICE=cpu` runs the same checks on the CPU (a smoke test of the module itself).
fp32 equality is exact on CUDA as on CPU only where both paths reduce in the same order, so greedy equality runs in fp32
with TF32 off (torch's default for matmul) and bf16 compares logits within bf16's resolution.
"""

import copy
import os

import pytest
import torch
from test_batched import left_padded
from test_generation import broken_speculative_sampling
from test_lean_layers import decode_logits
from test_verification import build_target, cached_forward
from transformers.generation import utils as generation_utils

from helpers import (
    LAW_VOCAB,
    chi_square_pvalue,
    context_target,
    exact_law,
    make_bigram_target,
    make_drafter,
    make_oracle_drafter,
    make_target,
    sampled_counts,
)

CUDA = torch.device(os.environ.get("LONGSPARK_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(CUDA.type == "cuda" and not torch.cuda.is_available(), reason="no CUDA device")
WINDOW, BLOCK = 8, 4


@pytest.fixture(autouse=True)
def no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("heads", [(4, 4), (12, 4)], ids=["gqa1", "gqa3"])
@pytest.mark.parametrize("left_padding", [0, 3], ids=["unpadded", "left-padded"])
def test_fast_verification_logits_equal_the_stock_path_on_cuda(kind, heads, left_padding):
    target = build_target(kind, *heads).to(CUDA)
    ids = torch.randint(0, 64, (1, 316), generator=torch.Generator().manual_seed(0)).to(CUDA)
    mask = torch.ones_like(ids)
    mask[:, :left_padding] = 0
    for block in (1, 2, 4, 8, 16):
        stock = cached_forward(target, ids[:, : 300 + block], mask[:, : 300 + block], 300, fast=False)
        fast = cached_forward(target, ids[:, : 300 + block], mask[:, : 300 + block], 300, fast=True)
        torch.testing.assert_close(fast, stock, rtol=1e-4, atol=1e-4, msg=f"block of {block} tokens")


def test_fast_verification_in_bfloat16_on_cuda():
    target = build_target("qwen3", 12, 4, dtype=torch.bfloat16).to(CUDA)
    ids = torch.randint(0, 64, (1, 308), generator=torch.Generator().manual_seed(0)).to(CUDA)
    mask = torch.ones_like(ids)
    stock = cached_forward(target, ids, mask, 300, fast=False).float()
    fast = cached_forward(target, ids, mask, 300, fast=True).float()
    torch.testing.assert_close(fast, stock, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_lean_layers_give_the_stock_layers_logits_bit_for_bit_on_cuda(kind):
    target = build_target(kind, 12, 4).to(CUDA)
    ids = torch.randint(0, 64, (1, 48), generator=torch.Generator().manual_seed(0)).to(CUDA)
    mask = torch.ones_like(ids)
    stock = decode_logits(target, ids, mask, 40, [1, 4, 3], lean=False)
    lean = decode_logits(target, ids, mask, 40, [1, 4, 3], lean=True)
    assert all(torch.equal(a, b) for a, b in zip(stock, lean))


def assisted_equals_plain(target, drafter, input_ids, attention_mask, max_new_tokens: int) -> None:
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    reference = target.generate(input_ids, **kwargs)
    assisted = target.generate(input_ids, assistant_model=drafter, **kwargs)
    assert assisted.device.type == CUDA.type
    assert torch.equal(reference, assisted)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("prompt_length", [3, 5 * WINDOW])
def test_greedy_equals_target_with_random_drafter_on_cuda(kind, prompt_length):
    target = make_target(kind).to(CUDA)
    drafter = make_drafter(target, window_size=WINDOW, block_size=BLOCK).to(CUDA)
    prompt = torch.randint(0, 64, (1, prompt_length), generator=torch.Generator().manual_seed(prompt_length)).to(CUDA)
    assisted_equals_plain(target, drafter, prompt, torch.ones_like(prompt), max_new_tokens=40)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_greedy_equals_target_when_drafts_are_accepted_on_cuda(kind):
    target = make_bigram_target(kind, vocab_size=64, seed=2).to(CUDA)
    drafter = make_oracle_drafter(target, agree_on=lambda ids: ids % 3 != 0, window_size=WINDOW, block_size=BLOCK)
    drafter = drafter.to(CUDA)
    prompt = torch.tensor([[5, 9, 28]], device=CUDA)
    assisted_equals_plain(target, drafter, prompt, torch.ones_like(prompt), max_new_tokens=30)
    histogram = drafter.drafting_stats.accepted_histogram
    assert sum(histogram[1:]) > 0 and histogram[0] > 0  # drafts were accepted, and some rounds rejected them all


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("lengths", [[3, 11], [6, 1, 17, 9, 4]], ids=["batch2", "batch5"])
def test_batched_greedy_equals_plain_batched_generate_on_cuda(kind, lengths):
    target = context_target(kind).to(CUDA)
    drafter = make_oracle_drafter(target, window_size=WINDOW, block_size=BLOCK).to(CUDA)
    input_ids, attention_mask = left_padded(lengths)
    assisted_equals_plain(target, drafter, input_ids.to(CUDA), attention_mask.to(CUDA), max_new_tokens=24)
    assert sum(drafter.drafting_stats.accepted_histogram[1:]) > 0


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_greedy_with_lookup_on_repeating_text_on_cuda(kind):
    """A prompt that repeats itself: lookup continuations are proposed and accepted, on the GPU."""
    target = make_target(kind).to(CUDA)
    drafter = make_drafter(target, window_size=WINDOW, block_size=BLOCK).to(CUDA)
    cycle = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(7))
    prompt = cycle.repeat(4)[None].to(CUDA)
    assisted_equals_plain(target, drafter, prompt, torch.ones_like(prompt), max_new_tokens=48)


@pytest.mark.parametrize("verifier", ["transformers", "broken"])
def test_sampling_matches_the_exact_target_law_on_cuda(verifier, monkeypatch):
    """The law of the first three sampled tokens, drafted and verified on the GPU, is the target's (computed on CPU
    from the same weights); with a broken acceptance rule (the negative control) the test sees the difference."""
    target = make_bigram_target("llama", vocab_size=LAW_VOCAB, seed=3, temperature=0.05)
    drafter = make_oracle_drafter(target, strength=2.0, block_size=3, seed=5)
    prompt = torch.tensor([[1, 4, 2, 5]])
    law = exact_law(target, prompt)
    target, drafter = copy.deepcopy(target).to(CUDA), drafter.to(CUDA)
    if verifier == "broken":
        monkeypatch.setattr(generation_utils, "_speculative_sampling", broken_speculative_sampling)
    counts = sampled_counts(target, drafter, prompt.to(CUDA), draws=1500)
    assert drafter.drafting_stats.drafted_tokens > 0
    pvalue = chi_square_pvalue(counts, law)
    assert pvalue > 1e-3 if verifier == "transformers" else pvalue < 1e-6
