"""Logits processors that read the recent sequence, on rounds that propose lookup continuations.

The repetition penalty of the other exactness tests reads a set of tokens, which a lookup proposal (a copy of earlier
tokens) never changes. The processor here reads the LAST token: it pushes the target towards `CYCLE[last]`, so the
processed target walks 6-token cycles, the text repeats, and lookup proposes long continuations that are accepted.
A verified position that saw a stale prefix (a lookup token not written where the processors read it, a prefix
without the block's earlier tokens, a row read at another row's length) boosts another token, and the output parts
from plain `generate`'s.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList

from helpers import CYCLE, FollowTheLastToken, make_drafter, make_target
from transformers_longspark.inference import session
from transformers_longspark.inference.planning import Source

VOCAB = 64


def lookup_drafter(target, **generation):
    drafter = make_drafter(target, block_size=4)
    config = drafter.generation_config
    config.assistant_confidence_threshold = 0.0
    config.lookup_min_match, config.lookup_num_tokens = 2, 6
    for name, value in generation.items():
        setattr(config, name, value)
    return drafter


def count_lookup(monkeypatch) -> list[int]:
    """Collects the number of tokens of every lookup proposal (`DraftSession.draft_round`)."""
    lengths, original = [], session.DraftSession.draft_round

    def spy(self, requests, planners, read_context):
        proposal = original(self, requests, planners, read_context)
        lengths.extend(int(proposal.num_drafted[r]) for r, s in enumerate(proposal.sources) if s is Source.LOOKUP)
        return proposal

    monkeypatch.setattr(session.DraftSession, "draft_round", spy)
    return lengths


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_processor_reading_the_last_token_stays_exact_on_lookup_rounds(batch_size, monkeypatch):
    """Greedy, with lookup continuations longer than the drafter's block: assisted equals plain `generate` row by row
    (batch 1: transformers' loop; 3 rows of different prompt lengths: the batched loop, rows accepting different
    numbers of tokens), and multi-token lookup rounds did run."""
    lookup_lengths = count_lookup(monkeypatch)
    target = make_target("qwen3", vocab_size=VOCAB, seed=4)
    drafter = lookup_drafter(target)
    generator = torch.Generator().manual_seed(6)
    prompts = torch.randint(0, 60, (3, 7), generator=generator)[:batch_size]
    mask = torch.ones_like(prompts)
    if batch_size > 1:
        mask[1, :3] = mask[2, :1] = 0
    options = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=63,
                   logits_processor=LogitsProcessorList([FollowTheLastToken()]))  # fmt: skip
    reference = target.generate(prompts, **options)
    assisted = target.generate(prompts, assistant_model=drafter, **options)
    assert torch.equal(assisted, reference)
    new = reference[:, prompts.shape[1] :]
    assert torch.equal(new[:, 1:], CYCLE[new[:, :-1]]), "the processor decides every token"
    assert max(lookup_lengths, default=0) > drafter.config.block_size


def test_rows_of_different_lengths_each_see_their_own_last_token(monkeypatch):
    """Batched rows whose lengths differ (a row that took a lookup round beside rows that drafted, or rejected more):
    each verified position of each row is processed with that row's own prefix. The rows' cycles are offset, so a
    row processed at another row's length gets another token."""
    target = make_target("qwen3", vocab_size=VOCAB, seed=4)
    drafter = lookup_drafter(target, lookup_min_match=3)
    lengths, original = [], session.DraftSession.record_accepted

    def spy(self, proposal, accepted, planners):
        lengths.append(len(set(accepted)))
        return original(self, proposal, accepted, planners)

    monkeypatch.setattr(session.DraftSession, "record_accepted", spy)
    prompts = torch.tensor([[0, 1, 2, 0, 1, 2, 6], [13, 14, 15, 16, 17, 12, 13], [40, 30, 20, 10, 26, 27, 28]])
    options = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=24, do_sample=False, pad_token_id=63,
                   logits_processor=LogitsProcessorList([FollowTheLastToken()]))  # fmt: skip
    reference = target.generate(prompts, **options)
    assisted = target.generate(prompts, assistant_model=drafter, **options)
    assert torch.equal(assisted, reference)
    assert max(lengths) > 1, "rows accepted different numbers of tokens in some round"
