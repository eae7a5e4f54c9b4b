"""Batched LongSpark sampling is lossless: each row's joint law of its first tokens is the target's (chi-square, rows
of different lengths that accept different numbers of drafts), and a wrong acceptance rule is caught."""

from __future__ import annotations

import pytest
import torch

from helpers import (
    LAW_TOKENS,
    LAW_VOCAB,
    SAMPLING,
    chi_square_pvalue,
    exact_law,
    make_bigram_target,
    make_oracle_drafter,
)
from transformers_longspark.inference import batched

COPIES, DRAWS = 250, 8  # each prompt drawn COPIES * DRAWS = 2000 times


@pytest.fixture(scope="module")
def sampling_setup():
    """The bigram target and overlapping drafter of `test_generation`'s chi-square test, three prompts of different
    lengths (so rows are padded and accept different numbers of drafts) and each row's exact law."""
    target = make_bigram_target("llama", vocab_size=LAW_VOCAB, seed=3, temperature=0.05)
    drafter = make_oracle_drafter(target, strength=2.0, block_size=3, seed=5)
    input_ids = torch.tensor([[0, 0, 1, 4, 2, 5], [3, 1, 1, 0, 4, 2], [0, 0, 0, 0, 5, 3]])
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]])
    laws = [exact_law(target, input_ids[r : r + 1], attention_mask[r : r + 1]) for r in range(len(input_ids))]
    return target, drafter, input_ids, attention_mask, laws


def sampled_row_counts(target, drafter, input_ids, attention_mask) -> torch.Tensor:
    """`(rows, V**3)` counts of each row's first three tokens, the batch repeated COPIES times, DRAWS times."""
    torch.manual_seed(1234)
    rows = len(input_ids)
    counts = torch.zeros(rows, LAW_VOCAB**LAW_TOKENS, dtype=torch.float64)
    ids, mask = input_ids.repeat(COPIES, 1), attention_mask.repeat(COPIES, 1)
    for _ in range(DRAWS):
        out = target.generate(ids, attention_mask=mask, max_new_tokens=LAW_TOKENS, assistant_model=drafter,
                              pad_token_id=0, **SAMPLING)[:, ids.shape[1] :]  # fmt: skip
        cells = (out[:, 0] * LAW_VOCAB + out[:, 1]) * LAW_VOCAB + out[:, 2]
        for row in range(rows):
            counts[row] += torch.bincount(cells[row::rows], minlength=LAW_VOCAB**LAW_TOKENS).double()
    return counts


@pytest.mark.parametrize("threshold", [0.0, 0.4], ids=["whole-blocks", "confidence-cut"])
def test_sampling_matches_each_rows_exact_law(sampling_setup, threshold, monkeypatch):
    target, drafter, input_ids, attention_mask, laws = sampling_setup
    monkeypatch.setattr(drafter.generation_config, "assistant_confidence_threshold", threshold)
    counts = sampled_row_counts(target, drafter, input_ids, attention_mask)
    assert drafter.drafting_stats.drafted_tokens > 0
    for row_counts, law in zip(counts, laws):
        assert chi_square_pvalue(row_counts, law) > 1e-3


CORRECT_RULE = batched.speculative_sampling


def resample_from_target(drafted, draft_logits, target_logits, num_drafted):
    """A deliberately wrong rule: after a rejection it samples from p instead of norm(max(p - q, 0))."""
    num_accepted, _ = CORRECT_RULE(drafted, draft_logits, target_logits, num_drafted)
    p_next = target_logits.softmax(-1)[torch.arange(len(num_accepted)), num_accepted]
    return num_accepted, torch.multinomial(p_next, 1)[:, 0]


def test_chi_square_detects_a_wrong_acceptance_rule(sampling_setup, monkeypatch):
    target, drafter, input_ids, attention_mask, laws = sampling_setup
    monkeypatch.setattr(batched, "speculative_sampling", resample_from_target)
    counts = sampled_row_counts(target, drafter, input_ids, attention_mask)
    assert min(chi_square_pvalue(row_counts, law) for row_counts, law in zip(counts, laws)) < 1e-6
