"""The lookup source end to end, where the unit tests of `SuffixIndex` and `RoundPlanner` cannot see the wiring:
which suffix the planner's index matches inside `generate`, and which rate a round's length is chosen from.

The target's tokens are set by `FollowTheLastToken` (each token is `CYCLE[previous]`), so the first round's text,
and so its matches, are known in advance. (Continuations longer than the drafter's block, batched and batch-1, are
checked in `test_processors_with_lookup.py`.)
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList

from helpers import FollowTheLastToken, make_drafter, make_target
from transformers_longspark.inference import session
from transformers_longspark.inference.drafting import DraftSettings
from transformers_longspark.inference.planning import Source, SourceRecord


def first_rounds(monkeypatch) -> list[tuple[list[Source], list[list[int]]]]:
    """Collects each round's sources and proposed tokens (`DraftSession.draft_round`)."""
    rounds, draft_round = [], session.DraftSession.draft_round

    def spy(self, requests, planners, read_context):
        proposal = draft_round(self, requests, planners, read_context)
        tokens = [proposal.tokens[r, : int(k)].tolist() for r, k in enumerate(proposal.num_drafted)]
        rounds.append((list(proposal.sources), tokens))
        return proposal

    monkeypatch.setattr(session.DraftSession, "draft_round", spy)
    return rounds


def generate(prompts, drafter_options: dict, max_new_tokens: int = 12) -> torch.Tensor:
    target = make_target("qwen3", seed=4)
    drafter = make_drafter(target, block_size=4)
    drafter.generation_config.assistant_confidence_threshold = 0.0
    for name, value in drafter_options.items():
        setattr(drafter.generation_config, name, value)
    options = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=max_new_tokens, do_sample=False,
                   pad_token_id=63, logits_processor=LogitsProcessorList([FollowTheLastToken()]))  # fmt: skip
    reference = target.generate(prompts, **options)
    assisted = target.generate(prompts, assistant_model=drafter, **options)
    assert torch.equal(assisted, reference)
    return assisted


@pytest.mark.parametrize("batch_size", [1, 2])
def test_the_longest_matched_suffix_wins_over_a_more_recent_shorter_one(batch_size, monkeypatch):
    """After the prompt and its first new token (`CYCLE[1] = 2`) the text ends with `0 1 2`, which occurred at the
    start, followed by 50; its suffix `1 2` occurred more recently, followed by 40. The first lookup round proposes
    what followed the longest match."""
    rounds = first_rounds(monkeypatch)
    prompts = torch.tensor([[0, 1, 2, 50, 7, 1, 2, 40, 9, 0, 1], [30, 31, 32, 33, 34, 35, 30, 31, 32, 33, 34]])
    generate(prompts[:batch_size], dict(lookup_min_match=2, lookup_num_tokens=6))
    sources, tokens = rounds[0]
    assert sources[0] is Source.LOOKUP  # untried sources tie, and lookup comes first
    assert tokens[0] == [50, 7, 1, 2, 40, 9]


def test_a_lookup_round_takes_its_matched_lengths_own_rate(monkeypatch):
    """Each request's planner starts with past rounds: lookup rounds after matches of every length kept all they
    proposed, while the pooled lookup rate is 1/6 and the drafter kept nothing. The first round's continuation (after
    a 6-token match) is worth proposing at the mixed rate `(4 * 1 + 2 * 1/6) / 6 = 0.72` (2 tokens are worth most at
    0.3 step per verified token), not at the pooled rate, where nothing beats a plain step."""
    rounds, new_planner = first_rounds(monkeypatch), DraftSettings.new_planner

    def seeded(self, offset=0):
        planner = new_planner(self, offset)
        planner.records[Source.LOOKUP] = SourceRecord(accepted=0.2, proposed=3.0, rejected=1.0, rounds=8)
        planner.records[Source.DRAFTER] = SourceRecord(accepted=0.0, proposed=2.0, rejected=1.0, rounds=8)
        planner.match_records.update({m: SourceRecord(5.0, 5.0, 0.0, rounds=10) for m in range(2, 7)})
        return planner

    monkeypatch.setattr(DraftSettings, "new_planner", seeded)
    prompts = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])  # then CYCLE[3] = 4: a 6-token match
    generate(prompts, dict(lookup_min_match=2, lookup_num_tokens=6, verify_token_cost=0.3))
    sources, tokens = rounds[0]
    assert sources == [Source.LOOKUP] and tokens == [[5, 0]]
