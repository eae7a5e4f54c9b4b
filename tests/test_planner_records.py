"""What the session tells each request's planner, read back after real `generate` calls against a hand count.

The planner's unit tests (`test_planning.py`) pass whatever they are handed; here a spy records every round's
proposal (its source, tokens and the request's tokens so far), the drafts each round kept are counted by hand from the
final output (greedy: the longest prefix of the proposal that the output repeats), the matched length of each lookup
round by a brute-force search, and every planner's running means (per source and per matched length, probe rounds
included) must be those of the rounds it really had. With rows that end at different times (EOS), each remaining row
must keep its own planner and its own lookup index (offset and tokens).
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList

from helpers import FollowTheLastToken, longest_earlier_match, make_drafter, make_target
from transformers_longspark.inference import session
from transformers_longspark.inference.drafting import LOOKUP_MAX_NGRAM, DraftSettings
from transformers_longspark.inference.planning import Source, SourceRecord


def cost_aware_lookup_drafter(target):
    """Lookup on (matches of 2+ tokens, up to 6 tokens), and a cost model under which rounds of every source, plain
    steps and probes occur on a random target."""
    drafter = make_drafter(target, block_size=4)
    config = drafter.generation_config
    config.assistant_confidence_threshold = 0.0
    config.lookup_min_match, config.lookup_num_tokens = 2, 6
    config.draft_round_cost, config.verify_token_cost = 0.2, 0.3
    return drafter


def record_rounds(monkeypatch) -> tuple[list, list]:
    """`(planners, rounds)`: every planner created (in creation order: batch row order), and per request and round
    `(batch row, length, its tokens so far from its offset, source, proposed tokens)`."""
    planners, rounds = [], []
    new_planner, draft_round = DraftSettings.new_planner, session.DraftSession.draft_round

    def created(self, offset=0):
        planners.append(new_planner(self, offset))
        return planners[-1]

    def proposed(self, requests, round_planners, read_context):
        before = [(int(row), int(length)) for row, length in zip(requests.rows, requests.lengths)]
        proposal = draft_round(self, requests, round_planners, read_context)
        for r, (row, length) in enumerate(before):
            offset = planners[row].lookup.offset
            tokens = requests.sequences[row, offset:length].tolist()
            drafts = proposal.tokens[r, : int(proposal.num_drafted[r])].tolist()
            rounds.append((row, length, tokens, proposal.sources[r], drafts))
        return proposal

    monkeypatch.setattr(DraftSettings, "new_planner", created)
    monkeypatch.setattr(session.DraftSession, "draft_round", proposed)
    return planners, rounds


def as_tuple(record: SourceRecord) -> tuple:
    return (record.accepted, record.proposed, record.rejected, record.rounds)


def expected_records(rounds, output: torch.Tensor) -> dict:
    """Per batch row: the running means of each source and of each matched length, replayed from the rounds with the
    drafts kept counted from `output` (greedy)."""
    expected = {}
    for row, length, tokens, source, drafts in rounds:
        sources, matches = expected.setdefault(row, ({}, {}))
        kept = 0
        while kept < len(drafts) and drafts[kept] == int(output[row, length + kept]):
            kept += 1
        if source is not Source.NONE:
            sources.setdefault(source, SourceRecord()).update(len(drafts), kept)
        if source is Source.LOOKUP:
            matched, _ = longest_earlier_match(tokens, 2, LOOKUP_MAX_NGRAM)
            assert matched >= 2
            matches.setdefault(matched, SourceRecord()).update(len(drafts), kept)
    return expected


@pytest.mark.parametrize("batch_size", [1, 3])
def test_planners_hold_the_rounds_they_really_had(batch_size, monkeypatch):
    planners, rounds = record_rounds(monkeypatch)
    target = make_target("llama", seed=0)
    drafter = cost_aware_lookup_drafter(target)
    prompts = torch.tensor([[5, 9, 28, 3, 5, 9, 28, 3, 5, 9], [1, 2, 3, 4, 5, 6, 1, 2, 3, 4], [7] * 10])[:batch_size]
    mask = torch.ones_like(prompts)
    if batch_size > 1:
        mask[1, :2] = 0  # a left-padded row: its tokens start at column 2
    output = target.generate(prompts, attention_mask=mask, max_new_tokens=60, do_sample=False,
                             assistant_model=drafter, pad_token_id=0)  # fmt: skip
    assert len(planners) == batch_size
    expected = expected_records(rounds, output)
    for row, planner in enumerate(planners):
        sources, matches = expected[row]
        assert {s: as_tuple(planner.records[s]) for s in sources} == {s: as_tuple(r) for s, r in sources.items()}
        assert all(planner.records[s].accepted is None for s in Source if s not in sources)
        assert {m: as_tuple(r) for m, r in planner.match_records.items()} == {m: as_tuple(r) for m, r in
                                                                               matches.items()}  # fmt: skip
    used = {source for _, _, _, source, _ in rounds}
    assert used == set(Source), used  # lookup, drafter and plain rounds
    kept_some = [planner.records[Source.LOOKUP].accepted for planner in planners]
    assert any(kept for kept in kept_some), "some lookup round kept drafts"


def test_rows_that_end_early_leave_each_remaining_row_its_own_planner_and_index(monkeypatch):
    """Batched, lookup on, rows ending at different times (row 0 walks the cycle holding the EOS id, so it ends first,
    then row 2): at every round, each request's planner is its row's (created for it, its offset its left padding)
    and its lookup index holds exactly the row's tokens. The rows' texts differ, so a planner moved to another row
    would hold the other row's tokens."""
    seen, plan_round = [], session.plan_round

    def spy(requests, settings, planners):
        plan = plan_round(requests, settings, planners)
        for row, length, planner in zip(requests.rows.tolist(), requests.lengths.tolist(), planners):
            index = planner.lookup
            seen.append((row, id(planner), index.offset, index.tokens[:], requests.sequences[row, :length].tolist()))
        return plan

    planners, _ = record_rounds(monkeypatch)
    monkeypatch.setattr(session, "plan_round", spy)
    target = make_target("qwen3", seed=4)
    drafter = make_drafter(target, block_size=4)
    drafter.generation_config.assistant_confidence_threshold = 0.0
    drafter.generation_config.lookup_min_match, drafter.generation_config.lookup_num_tokens = 2, 6
    eos = 3  # 2 tokens into row 0's walk of the cycle 0..5, 5 into row 2's, never in row 1's (24..29)
    prompts = torch.tensor([[9, 9, 0, 1, 2, 0, 1], [9, 24, 25, 26, 24, 25, 26], [40, 41, 50, 51, 52, 53, 4]])
    mask = torch.ones_like(prompts)
    mask[0, :2] = 0
    options = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=63, eos_token_id=eos,
                   logits_processor=LogitsProcessorList([FollowTheLastToken()]))  # fmt: skip
    reference = target.generate(prompts, **options)
    assisted = target.generate(prompts, assistant_model=drafter, **options)
    assert torch.equal(assisted, reference)
    ends = [(row == eos).nonzero()[0, 0].item() if (row == eos).any() else len(row) for row in reference]
    assert ends[0] < ends[2] < ends[1] == reference.shape[1], ends
    offsets = (~mask.bool()).sum(dim=1).tolist()
    for row, planner, offset, index_tokens, tokens in seen:
        assert planner == id(planners[row]) and offset == offsets[row]
        assert index_tokens == tokens[offset : offset + len(index_tokens)] and len(index_tokens) == len(tokens) - offset
    assert {row for row, *_ in seen[-3:]} == {1}  # the last rounds served row 1 alone


def test_a_drafter_block_ends_at_the_length_its_planner_chose(monkeypatch):
    """Whole blocks (no confidence cuts), and a verification priced so that a drafter that keeps little is worth 1-2
    tokens, not 4: every drafted block proposes at most what its planner chose this round, and some choose less."""
    chosen, draft_round = [], session.DraftSession.draft_round

    def proposed(self, requests, planners, read_context):
        proposal = draft_round(self, requests, planners, read_context)
        for r, planner in enumerate(planners):
            if proposal.sources[r] is Source.DRAFTER:
                chosen.append((planner.draft_length, int(proposal.num_drafted[r])))
        return proposal

    monkeypatch.setattr(session.DraftSession, "draft_round", proposed)
    target = make_target("llama", seed=0)
    drafter = make_drafter(target, block_size=4)
    config = drafter.generation_config
    config.assistant_confidence_threshold = config.block_confidence_threshold = 0.0
    config.draft_round_cost, config.verify_round_cost, config.verify_token_cost = 0.0, 0.0, 0.3
    prompts = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    target.generate(prompts, max_new_tokens=40, do_sample=False, assistant_model=drafter, pad_token_id=0)
    assert chosen and all(1 <= drafted <= length <= 4 for length, drafted in chosen), chosen
    assert any(length < 4 for length, _ in chosen), chosen
