"""`inference/sampling.py`: one token per row drawn with the law of its probabilities, never one of probability 0."""

import pytest
import torch
from scipy.stats import chisquare

from transformers_longspark.inference.sampling import sample_from


def test_draws_follow_each_rows_law_and_never_a_zero_probability_token():
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(3, 12, generator=generator) ** 3
    probs[0, [2, 7]] = 0.0  # masked tokens (e.g. -inf logits) must never be drawn
    probs[1, :-1] = 0.0  # all the mass on the last entry
    probs[2] *= 5.0  # an unnormalised row (a residual `max(p - q, 0)`) is normalised
    torch.manual_seed(1)
    draws = torch.stack([sample_from(probs) for _ in range(20_000)])  # (draws, rows)
    for row in range(3):
        counts = torch.bincount(draws[:, row], minlength=12).double()
        law = probs[row].double() / probs[row].double().sum()
        assert counts[law == 0].sum() == 0
        keep = law > 0
        if keep.sum() > 1:
            assert chisquare(counts[keep].numpy(), (law[keep] * len(draws)).numpy()).pvalue > 1e-3


def test_a_biased_sampler_is_caught_by_the_same_check():
    """Negative control: draws from a law off by 5% in one entry fail the chi-square above."""
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    torch.manual_seed(2)
    draws = torch.stack([sample_from(torch.tensor([[0.55, 0.25, 0.2]])) for _ in range(20_000)])[:, 0]
    counts = torch.bincount(draws, minlength=3).double()
    assert chisquare(counts.numpy(), (probs[0].double() * len(draws)).numpy()).pvalue < 1e-3


def test_a_seeded_run_repeats_and_reads_the_global_rng():
    probs = torch.softmax(torch.randn(4, 100, generator=torch.Generator().manual_seed(3)), dim=-1)
    torch.manual_seed(5)
    first = sample_from(probs)
    torch.manual_seed(5)
    assert torch.equal(first, sample_from(probs))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0])
def test_a_row_without_a_finite_positive_total_is_refused(bad):
    probs = torch.tensor([[0.2, 0.8], [bad, 0.0 if bad == 0.0 else 0.5]])
    with pytest.raises(ValueError, match="finite positive"):
        sample_from(probs)
