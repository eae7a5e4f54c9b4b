"""The lookup source's index against a brute-force search."""

import random

import pytest
import torch

from helpers import longest_earlier_match
from transformers_longspark.inference.lookup import SuffixIndex, point_mass_logits


@pytest.mark.parametrize("vocab, min_ngram, max_ngram", [(3, 1, 4), (5, 2, 6), (50, 2, 3)])
def test_index_matches_brute_force_on_random_streams(vocab, min_ngram, max_ngram):
    rng = random.Random(vocab)
    for _ in range(30):
        index, stream = SuffixIndex(min_ngram, max_ngram), []
        for _ in range(rng.randint(1, 12)):  # commits of 1..5 tokens, as rounds accept them
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
            if rng.random() < 0.3 and len(stream) > 4:  # repeat an earlier stretch, as code does
                start = rng.randrange(len(stream) - 3)
                new = stream[start : start + rng.randint(2, 6)]
            stream += new
            index.extend(new)
            assert index.longest_match() == longest_earlier_match(stream, min_ngram, max_ngram)
            n, start = index.longest_match()
            continuation, matched = index.continuation(4)
            assert matched == n
            if n:
                extended = stream + continuation
                assert extended[start : start + 4] == continuation  # it continues the earlier occurrence
            else:
                assert continuation == []


def test_a_repetition_continues_with_its_period():
    index = SuffixIndex(2, 4)
    index.extend([7, 8, 9, 7, 8, 9, 7, 8])
    assert index.continuation(5) == ([9, 7, 8, 9, 7], 4)


def test_point_mass_logits():
    logits = point_mass_logits(torch.tensor([[2, 0]]), 4)
    assert logits.softmax(-1).tolist() == [[[0, 0, 1, 0], [1, 0, 0, 0]]]


def test_bad_ngram_range_is_refused():
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        SuffixIndex(3, 2)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_generate_proposes_the_continuation_of_the_current_suffix(batch_size, monkeypatch):
    """Every lookup proposal in `generate` is the brute-force continuation of the request's tokens so far (prompt
    and generated, left padding excluded): the index is extended with exactly the committed tokens, anchor included."""
    from helpers import make_drafter, make_target
    from transformers_longspark.inference import drafting, session

    checked, before = [], []
    original_plan, original_propose = drafting.plan_round, drafting.propose_blocks

    def spy_plan(requests, settings, planners):
        rows, lengths = requests.rows.tolist(), requests.lengths.tolist()
        before[:] = [requests.sequences[row, p.lookup.offset : length].tolist() for row, p, length in
                     zip(rows, planners, lengths)]  # fmt: skip
        return original_plan(requests, settings, planners)

    def spy(drafter, context, requests, settings, plan):
        proposal = original_propose(drafter, context, requests, settings, plan)
        tokens, num_drafted = proposal.tokens, proposal.num_drafted
        for r in proposal.from_lookup.nonzero()[:, 0].tolist():
            n, start = longest_earlier_match(before[r], 2, drafting.LOOKUP_MAX_NGRAM)
            expected = (before[r] + [0] * 16)[start : start + int(num_drafted[r])]
            proposed = tokens[r, : int(num_drafted[r])].tolist()
            assert n >= 2 and proposed[: len(before[r]) - start] == expected[: len(before[r]) - start]
            checked.append(r)
        return proposal

    monkeypatch.setattr(session, "plan_round", spy_plan)
    monkeypatch.setattr(session, "propose_blocks", spy)
    target = make_target("qwen3")
    drafter = make_drafter(target)
    drafter.generation_config.lookup_min_match = 2
    prompts = torch.tensor([[0, 0, 1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 5, 6, 7, 5, 6, 7], [9, 9, 9, 9, 8, 9, 9, 9, 9]])
    mask = torch.ones_like(prompts)
    mask[0, :2] = 0
    if batch_size == 1:
        target.generate(prompts[1:2], max_new_tokens=20, do_sample=False, assistant_model=drafter)
    else:
        target.generate(prompts, attention_mask=mask, pad_token_id=0, max_new_tokens=20, do_sample=False,
                        assistant_model=drafter)  # fmt: skip
    assert checked
