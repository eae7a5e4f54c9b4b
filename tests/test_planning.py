"""The source choice (`inference/planning.py`): untried sources first, then the cost model (`round_costs.py`), with
probes."""

import pytest
import torch

from transformers_longspark.inference import planning
from transformers_longspark.inference.planning import (
    FIRST_PROBE_INTERVAL,
    MAX_PROBE_INTERVAL,
    RoundPlanner,
    Source,
    SourceRecord,
)
from transformers_longspark.inference.round_costs import RoundCosts, expected_accepted

CPU = RoundCosts(draft_round_cost=0.4, verify_token_cost=0.15)


@pytest.fixture
def first_round_sets_the_rate(monkeypatch):
    """No prior: a source's first verified round sets its means, so a test sets a rate with one `record`."""
    monkeypatch.setattr(planning, "PRIOR_ROUNDS", 0)


@pytest.mark.parametrize("lookup_first", [True, False])
def test_untried_sources_are_tried_first(lookup_first):
    """An untried source is worth the most. With `lookup_first`, the untried drafter waits for the first round without
    a paying continuation."""
    planner = RoundPlanner(CPU, lookup_first=lookup_first)
    assert planner.choose([1, 2, 3], can_draft=True) is Source.LOOKUP
    planner.record(Source.LOOKUP, proposed=3, accepted=3)
    expected = Source.LOOKUP if lookup_first else Source.DRAFTER  # the drafter is still untried
    assert planner.choose([1, 2, 3], can_draft=True) is expected
    assert planner.choose([], can_draft=True) is Source.DRAFTER
    assert planner.choose([], can_draft=False) is Source.NONE  # nothing to propose


def test_a_paying_continuation_comes_before_the_drafter(first_round_sets_the_rate):
    """With `lookup_first` (the default), a continuation worth more than a plain step is taken even where the
    drafter's running value is higher; one worth less leaves the round to the drafter and plain steps, as before."""
    planner = RoundPlanner(CPU)
    planner.record(Source.LOOKUP, proposed=4, accepted=1)  # rate 1/2: 2 tokens, (1 + 0.75) / (1 + 0.3) = 1.35
    planner.record(Source.DRAFTER, proposed=7, accepted=7)  # rate 1: 7 of 7, (1 + 7) / (1 + 1.05 + 0.4) = 3.3
    competing = RoundPlanner(CPU, lookup_first=False, records=planner.records)
    assert competing.choose([7] * 4, can_draft=True) is Source.DRAFTER
    assert planner.choose([7] * 4, can_draft=True) is Source.LOOKUP and planner.draft_length == 0
    assert planner.records[Source.DRAFTER].passed_over == 0  # not weighed, so not passed over: no probe is due
    planner.records[Source.LOOKUP] = SourceRecord(accepted=0.0, proposed=4.0, rejected=1.0, rounds=2)  # rate 0
    planner.match_records.clear()
    assert planner.choose([7] * 4, can_draft=True) is Source.DRAFTER and planner.draft_length == 7


def test_the_source_worth_more_tokens_per_step_wins(first_round_sets_the_rate):
    planner = RoundPlanner(CPU)
    planner.record(Source.LOOKUP, proposed=10, accepted=4)  # rate 0.8: 5 of 10 tokens, (1 + 2.69) / (1 + 0.75) = 2.1
    planner.record(Source.DRAFTER, proposed=3, accepted=2)  # rate 2/3: 4 of 7, (1 + 1.6) / (1 + 0.6 + 0.4) = 1.3
    assert planner.choose([7] * 10, can_draft=True) is Source.LOOKUP and planner.lookup_length(10) == 5
    assert planner.choose([7] * 3, can_draft=True) is Source.LOOKUP  # (1 + 1.95) / (1 + 0.45) = 2.04
    assert planner.choose([7], can_draft=True) is Source.LOOKUP  # one token: (1 + 0.8) / (1 + 0.15) = 1.57
    assert planner.choose([], can_draft=True) is Source.DRAFTER and planner.draft_length == 4
    assert planner.choose([], can_draft=True, room=2) is Source.DRAFTER and planner.draft_length == 2
    assert planner.choose([7] * 10, can_draft=True) is Source.LOOKUP and planner.draft_length == 0


def test_a_drafter_that_does_not_pay_is_skipped_and_probed_at_growing_intervals():
    planner = RoundPlanner(CPU)
    planner.record(Source.DRAFTER, proposed=3, accepted=0)  # 1 / 1.85 < 1: plain decoding is worth more
    choices = [planner.choose([], can_draft=True) for _ in range(300)]
    probes = [i for i, source in enumerate(choices) if source is Source.DRAFTER]
    gaps = [b - a for a, b in zip([-1, *probes], probes)]
    interval = FIRST_PROBE_INTERVAL
    assert gaps[:3] == [interval, 2 * interval, 4 * interval] and set(gaps[3:]) == {MAX_PROBE_INTERVAL}
    assert set(choices) == {Source.NONE, Source.DRAFTER}


def test_a_probed_lookup_round_is_recorded_under_its_matched_length(first_round_sets_the_rate):
    planner = RoundPlanner(CPU)
    planner.record(Source.LOOKUP, proposed=3, accepted=0)  # lookup does not pay: plain steps win, then a probe
    choices = [planner.choose([7, 7, 7], can_draft=False, matched=4) for _ in range(FIRST_PROBE_INTERVAL)]
    assert choices == [Source.NONE] * (FIRST_PROBE_INTERVAL - 1) + [Source.LOOKUP]
    assert planner.lookup_match == 4
    planner.record(Source.LOOKUP, proposed=3, accepted=3)
    assert set(planner.match_records) == {0, 4} and planner.match_records[4].rounds == 1


def test_a_probe_that_pays_brings_the_source_back():
    planner = RoundPlanner(CPU)
    planner.record(Source.DRAFTER, proposed=3, accepted=0)
    skipped = [planner.choose([], can_draft=True) for _ in range(FIRST_PROBE_INTERVAL - 1)]
    assert skipped == [Source.NONE] * (FIRST_PROBE_INTERVAL - 1)
    assert planner.choose([], can_draft=True) is Source.DRAFTER  # the probe
    for _ in range(3):
        planner.record(Source.DRAFTER, proposed=3, accepted=3)
    assert planner.choose([], can_draft=True) is Source.DRAFTER  # now on merit
    assert planner.records[Source.DRAFTER].probe_interval == FIRST_PROBE_INTERVAL


@pytest.mark.parametrize("accepted", [0, 1])
def test_without_costs_every_round_proposes(accepted):
    planner = RoundPlanner(RoundCosts())
    planner.record(Source.DRAFTER, proposed=7, accepted=accepted)
    planner.record(Source.LOOKUP, proposed=7, accepted=0)
    assert all(planner.choose([1, 2], can_draft=True) is not Source.NONE for _ in range(50))
    assert all(planner.choose([], can_draft=True) is Source.DRAFTER for _ in range(50))


def test_running_means_follow_recent_rounds():
    planner = RoundPlanner(CPU)
    planner.record(Source.LOOKUP, proposed=10, accepted=0)
    for _ in range(8):
        planner.record(Source.LOOKUP, proposed=10, accepted=8)
    record = planner.records[Source.LOOKUP]
    assert 7 < record.accepted < 8 and record.proposed == pytest.approx(10)
    planner.record(Source.NONE, proposed=0, accepted=0)  # a plain step tells no source anything
    assert planner.records[Source.NONE].accepted is None


def test_the_drafter_pays_at_long_prefixes_where_the_target_step_is_dearer():
    """A drafter round costs the same at any prefix, a target step more and more: the same drafter record is worth
    less than plain decoding at a short prefix and more at a long one."""
    costs = RoundCosts(draft_round_cost=0.4, verify_token_cost=0.15, step_doubling_length=4096)
    assert costs.drafter_cost(0) == pytest.approx(0.4) and costs.drafter_cost(8192) == pytest.approx(0.4 / 3)
    choices = {}
    for length in (100, 8192):
        planner = RoundPlanner(costs)
        planner.record(Source.DRAFTER, proposed=2, accepted=0.5)  # (1 + 0.5) / (1 + 0.3 + drafter round)
        choices[length] = planner.choose([], can_draft=True, length=length)
    assert choices == {100: Source.NONE, 8192: Source.DRAFTER}


def test_a_fixed_verification_overhead_favours_long_proposals(first_round_sets_the_rate):
    """Where any forward of several tokens costs a fixed share more than a one-token step (`verify_round_cost`), a
    short lookup continuation that accepts little does not pay, and a long one that accepts much does."""
    costs = RoundCosts(verify_round_cost=0.45, verify_token_cost=0.08)
    planner = RoundPlanner(costs)
    planner.record(Source.LOOKUP, proposed=2, accepted=0.5)  # (1 + 0.5) / (1 + 0.45 + 0.16) < 1
    assert planner.choose([1, 2], can_draft=False) is Source.NONE
    planner = RoundPlanner(costs)
    planner.record(Source.LOOKUP, proposed=10, accepted=3)  # (1 + 3) / (1 + 0.45 + 0.8) > 1
    assert planner.choose([1] * 10, can_draft=False) is Source.LOOKUP


def test_the_continuation_rate_is_the_geometric_estimate():
    """Each lookup token is kept while the ones before it were: a round that accepts 3 of 10 kept 3 and rejected one
    (rate 3/4 alone); a round that kept everything it proposed rejected none. The running means start from the prior
    (1 accepted, 1 rejection: rate 1/2) that the first round is folded into."""
    record = SourceRecord()
    assert record.continuation_rate == 0.0  # never verified
    record.update(proposed=10, accepted=3)  # accepted 1 + 0.25 * (3 - 1), rejected 1 + 0.25 * (1 - 1)
    assert record.accepted == pytest.approx(1.5) and record.continuation_rate == pytest.approx(1.5 / 2.5)
    record.update(proposed=2, accepted=2)  # accepted 1.5 + 0.25 * (2 - 1.5), rejected 1 - 0.25
    assert record.rejected == pytest.approx(0.75) and record.continuation_rate == pytest.approx(1.625 / 2.375)
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125) and expected_accepted(1.0, 4) == 4


def test_one_rejected_first_block_does_not_price_the_drafter_out():
    """A drafter's first block after the prefill rejected whole (rate 0 on its own) leaves the prior's rate near 1/2,
    where drafting still pays at these costs: the next round drafts again instead of waiting for a probe."""
    costs = RoundCosts(draft_round_cost=0.2, forward_costs=((2, 1.13), (4, 1.12), (8, 1.28)))
    planner = RoundPlanner(costs)
    assert planner.choose([], can_draft=True) is Source.DRAFTER  # untried
    planner.record(Source.DRAFTER, proposed=7, accepted=0)
    assert planner.drafter_rate() == pytest.approx(0.75 / 1.75)
    assert planner.choose([], can_draft=True) is Source.DRAFTER
    for _ in range(4):  # a drafter that keeps failing is priced out at the running mean's pace
        planner.record(Source.DRAFTER, proposed=7, accepted=0)
    assert planner.choose([], can_draft=True) is Source.NONE


def brute_force_best_length(costs: RoundCosts, rate: float, available: int) -> int:
    values = [(1 + sum(rate**i for i in range(1, k + 1))) / (1 + costs.verify_cost(k)) for k in range(available + 1)]
    return max(range(1, available + 1), key=lambda k: (values[k], k))


@pytest.mark.parametrize("accepted, proposed", [(0, 10), (1, 10), (2, 3), (4, 10), (9, 10), (10, 10)])
def test_the_lookup_length_is_the_one_worth_most(accepted, proposed):
    """The planner proposes the prefix of a lookup continuation worth the most tokens per step under the cost model:
    sampled copies that are often rejected get a short prefix, a file that repeats itself the whole continuation."""
    costs = RoundCosts(verify_round_cost=0.05, verify_token_cost=0.09)
    planner = RoundPlanner(costs)
    planner.record(Source.LOOKUP, proposed=proposed, accepted=accepted)
    rate = planner.records[Source.LOOKUP].continuation_rate
    assert planner.lookup_length(10) == brute_force_best_length(costs, rate, 10)
    assert planner.lookup_length(0) == 0
    value, length = costs.lookup_value(rate, 10)
    assert value == pytest.approx((1 + expected_accepted(rate, length)) / (1 + costs.verify_cost(length)))


def test_lookup_lengths_follow_the_rate(first_round_sets_the_rate):
    costs = RoundCosts(verify_round_cost=0.05, verify_token_cost=0.09)
    lengths = {}
    for accepted in (1, 3, 10):  # rates 1/2, 3/4 and 1
        planner = RoundPlanner(costs)
        planner.record(Source.LOOKUP, proposed=10, accepted=accepted)
        lengths[accepted] = planner.lookup_length(10)
    assert lengths == {1: 2, 3: 5, 10: 10}
    untried = RoundPlanner(costs)
    assert untried.lookup_length(7) == 7  # untried: the whole continuation
    free = RoundPlanner(RoundCosts())  # a GPU: a longer prefix is never worth less
    free.record(Source.LOOKUP, proposed=10, accepted=0)
    assert free.lookup_length(10) == 10


def test_a_short_prefix_of_a_poor_continuation_can_beat_plain_decoding():
    """At rate 0.4, all 10 tokens are worth less than a plain step, and the best prefix more: the round is a lookup
    round of a few tokens, not a plain step."""
    costs = RoundCosts(verify_round_cost=0.05, verify_token_cost=0.09)
    planner = RoundPlanner(costs)
    planner.records[Source.LOOKUP] = SourceRecord(accepted=0.4, proposed=10.0, rejected=0.6)  # rate 0.4
    assert (1 + expected_accepted(0.4, 10)) / (1 + costs.verify_cost(10)) < 1
    assert planner.choose([3] * 10, can_draft=False) is Source.LOOKUP and planner.lookup_length(10) == 2


def test_a_round_proposes_the_prefix_its_planner_chose(first_round_sets_the_rate):
    """`plan_round` hands on the prefix of the lookup continuation that `RoundPlanner.lookup_length` chose: two
    requests over the same repeating tokens, one whose past lookup rounds kept half their tokens (rate 1/2: two tokens
    are worth most), one whose rounds kept all (the whole continuation), and one with the choice off."""
    from transformers_longspark.inference.drafting import DraftRequests, DraftSettings, plan_round

    costs = RoundCosts(verify_round_cost=0.05, verify_token_cost=0.09)
    settings = DraftSettings(block_size=4, lookup_min_match=3, lookup_num_tokens=8, costs=costs)
    sequences = torch.tensor([[1, 2, 3, 4, 5, 6] * 4 + [0] * 12] * 3)  # 24 tokens each, room for 12 more
    requests = DraftRequests(sequences, torch.arange(3), torch.full((3,), 24), torch.full((3,), 12))
    planners = [settings.new_planner() for _ in range(3)]
    planners[2].choose_lookup_length = False
    for planner, accepted in zip(planners, [1, 8, 1]):
        planner.record(Source.LOOKUP, proposed=8, accepted=accepted)
        planner.record(Source.DRAFTER, proposed=4, accepted=0)
    plan = plan_round(requests, settings, planners)
    assert plan.sources == [Source.LOOKUP] * 3
    assert plan.continuations == {0: [1, 2], 1: [1, 2, 3, 4, 5, 6, 1, 2], 2: [1, 2, 3, 4, 5, 6, 1, 2]}


def test_each_matched_length_keeps_its_own_rate_mixed_with_the_pooled_one(first_round_sets_the_rate):
    """Lookup rounds after 2-token matches that keep nothing and after 6-token matches that keep all: each length's
    rate moves towards its own rounds (at most 4 of them count, against 2 for the pooled rate), and a length without
    rounds of its own takes the pooled rate."""
    costs = RoundCosts(verify_round_cost=0.05, verify_token_cost=0.09)
    planner = RoundPlanner(costs)
    assert planner.match_rate(3) is None  # untried source
    for _ in range(6):
        for matched, accepted in ((2, 0), (6, 10)):
            assert planner.choose([5] * 10, can_draft=False, matched=matched) in (Source.LOOKUP, Source.NONE)
            planner.lookup_match = matched  # as if taken (a probe)
            planner.record(Source.LOOKUP, proposed=10, accepted=accepted)
    pooled = planner.records[Source.LOOKUP].continuation_rate
    assert planner.match_rate(4) == pytest.approx(pooled)
    assert planner.match_rate(2) == pytest.approx((4 * 0.0 + 2 * pooled) / 6)
    assert planner.match_rate(6) == pytest.approx((4 * 1.0 + 2 * pooled) / 6)
    assert planner.lookup_length(10, matched=2) <= 2 < planner.lookup_length(10, matched=4)
    assert planner.lookup_length(10, matched=6) == 10
    assert planner.choose([5] * 10, can_draft=False, matched=6) is Source.LOOKUP and planner.lookup_match == 6
    planner.records[Source.LOOKUP] = SourceRecord(accepted=0.0, proposed=10.0, rejected=1.0, rounds=12)
    assert planner.choose([5] * 10, can_draft=False, matched=2) is Source.NONE and planner.lookup_match == 0


# --- a batched round is planned as a whole -----------------------------------------------------------------------


def test_a_batched_round_pays_only_when_its_rows_repay_the_widest_proposal():
    """A batched verification pads every row to the widest proposal: one row with a long, well-kept lookup
    continuation repays it; one whose drafts are rarely kept, beside rows that propose nothing, does not."""
    from transformers_longspark.inference.planning import batch_round_pays

    costs = RoundCosts(draft_round_cost=0.4, verify_round_cost=0.05, verify_token_cost=0.09)
    kept, weak, idle = RoundPlanner(costs), RoundPlanner(costs), RoundPlanner(costs)
    kept.record(Source.LOOKUP, proposed=8, accepted=8)
    weak.record(Source.DRAFTER, proposed=4, accepted=0)
    weak.record(Source.DRAFTER, proposed=4, accepted=1)
    assert batch_round_pays([kept, idle], [Source.LOOKUP, Source.NONE], [8, 0], 100, costs)
    assert not batch_round_pays([weak, idle, idle], [Source.DRAFTER, Source.NONE, Source.NONE], [4, 0, 0], 100, costs)
    assert batch_round_pays([idle, idle], [Source.NONE, Source.NONE], [0, 0], 100, costs)
    untried = RoundPlanner(costs)  # an untried source is worth trying
    assert batch_round_pays([untried, idle], [Source.DRAFTER, Source.NONE], [4, 0], 100, costs)


def test_a_wide_batch_pays_each_verified_row_in_full():
    """The same rows repay a proposal at batch 2 and not at batch 8: there a plain step already has 8 rows, and the
    verification 8 * (1 + k) of them, on the forward's cost line that batch 1 measured (no batch points)."""
    from transformers_longspark.inference.planning import batch_round_pays

    costs = RoundCosts(draft_round_cost=0.1, verify_round_cost=0.05, verify_token_cost=0.07)
    assert costs.batch_verify_cost(1, 7) == pytest.approx(costs.verify_cost(7))
    assert costs.batch_verify_cost(8, 7) == pytest.approx((1 + 0.05 + 0.07 * 63) / (1 + 0.05 + 0.07 * 7) - 1)
    planners = [RoundPlanner(costs) for _ in range(8)]
    for planner in planners:  # blocks of 7 that keep ~1.5 drafts
        planner.record(Source.DRAFTER, proposed=7, accepted=1)
        planner.record(Source.DRAFTER, proposed=7, accepted=2)
    assert batch_round_pays(planners[:2], [Source.DRAFTER] * 2, [7] * 2, 100, costs)
    assert not batch_round_pays(planners, [Source.DRAFTER] * 8, [7] * 8, 100, costs)


def test_in_a_batch_a_rows_untried_source_is_valued_at_what_the_other_rows_measured():
    """An untried source is worth trying at batch 1, but in a batch one row's try makes all rows pay: it is valued at
    the other rows' measured means, and counts as infinite only while no row has tried it."""
    from transformers_longspark.inference.planning import batch_expected_accepted, batch_round_pays

    costs = RoundCosts(draft_round_cost=0.2, verify_token_cost=0.04)
    poor, new = [RoundPlanner(costs) for _ in range(7)], RoundPlanner(costs)
    for planner in poor:
        planner.record(Source.LOOKUP, proposed=4, accepted=0)
        planner.record(Source.DRAFTER, proposed=4, accepted=1)
    batch = [new, *poor]
    assert new.expected_accepted(Source.LOOKUP, 4) == new.expected_accepted(Source.DRAFTER, 4) == float("inf")
    rate = poor[0].match_rate()
    assert batch_expected_accepted(batch, [Source.LOOKUP] + [Source.NONE] * 7, [4] + [0] * 7)[0] == pytest.approx(
        expected_accepted(rate, 4)
    )
    assert batch_expected_accepted(batch, [Source.DRAFTER] + [Source.NONE] * 7, [4] + [0] * 7)[0] == pytest.approx(
        expected_accepted(poor[0].drafter_rate(), 4)
    )
    assert not batch_round_pays(batch, [Source.LOOKUP] + [Source.NONE] * 7, [4] + [0] * 7, 100, costs)
    fresh = [RoundPlanner(costs) for _ in range(8)]  # no row has tried it: worth trying once
    assert batch_round_pays(fresh, [Source.LOOKUP] + [Source.NONE] * 7, [4] + [0] * 7, 100, costs)


def test_measured_forward_costs_replace_the_line():
    """Where a calibration measured forwards of 2-64 rows and a drafter round over 8 requests, a verification (at
    batch 1 too) and a batch are priced by those points (read between them, and beyond them on the last segment),
    not by the line of the cost fields."""
    from transformers_longspark.inference.round_costs import interpolate

    line = RoundCosts(draft_round_cost=0.2, verify_round_cost=0.0, verify_token_cost=0.04)
    forwards = ((2, 1.0), (8, 1.2), (16, 1.5), (32, 2.0), (64, 3.1))
    measured = RoundCosts(**{**vars(line), "forward_costs": forwards, "draft_batch_costs": ((8, 0.6),)})
    assert line.batch_verify_cost(1, 3) == line.verify_cost(3) == pytest.approx(0.12)
    assert measured.batch_verify_cost(1, 3) == measured.verify_cost(3) == pytest.approx(0.2 * 2 / 6)  # 4 rows
    assert measured.verify_cost(0) == 0.0
    knee = RoundCosts(forward_costs=((2, 1.05), (3, 1.1), (4, 1.45), (8, 1.6)))  # the kernel changes at 4 rows
    assert knee.verify_cost(2) == pytest.approx(0.1) and knee.verify_cost(3) == pytest.approx(0.45)
    assert knee.lookup_value(0.6, 7)[1] == 2  # a continuation kept 60% of the time: stop before the knee
    assert measured.forward_cost(64) == 3.1 and measured.forward_cost(128) == pytest.approx(5.3)
    assert measured.batch_verify_cost(8, 3) == pytest.approx(2.0 / 1.2 - 1)
    assert line.batch_verify_cost(8, 3) == pytest.approx((1 + 0.04 * 31) / (1 + 0.04 * 7) - 1)
    assert measured.drafter_cost(100, batch=8) == pytest.approx(0.6 / 1.2)
    row_4 = 1 + 0.2 * 2 / 6  # 4 rows, between the points at 2 and 8
    assert measured.drafter_cost(100, batch=4) == pytest.approx(interpolate(((1, 0.2), (8, 0.6)), 4) / row_4)
    assert line.drafter_cost(100, batch=8) == measured.drafter_cost(100) == 0.2  # unmeasured: as at batch 1
    assert interpolate(((1, 2.0),), 9) == 2.0


@pytest.mark.parametrize("points", [((1, 1.0),), ((8, 1.0), (4, 0.9)), ((8, -1.0),), ((8, float("nan")),)])
def test_nonsense_batch_points_are_refused(points):
    from transformers_longspark.inference.knobs import check_costs

    with pytest.raises(ValueError, match="forward_costs must be"):
        check_costs(RoundCosts(forward_costs=points), "A test calibration")


def test_a_batch_whose_proposals_do_not_pay_decodes_in_plain_batched_steps():
    """With drafting priced far above what its blocks keep, every batched round after the first drafter rounds is a
    plain step of the whole batch, and the output is plain batched `generate`'s."""
    from helpers import make_drafter, make_target

    target = make_target("qwen3")
    drafter = make_drafter(target)
    drafter.generation_config.draft_round_cost = 50.0
    prompts = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(prompts)
    plain = target.generate(prompts, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assisted = target.generate(prompts, attention_mask=mask, max_new_tokens=16, do_sample=False,
                               assistant_model=drafter)  # fmt: skip
    assert torch.equal(plain, assisted)
    stats = drafter.drafting_stats
    assert stats.drafter_rounds == 1  # the untried drafter once, then plain batched steps only
    assert stats.plain_rounds == stats.rounds - 3


def test_a_verification_at_a_long_prefix_is_priced_from_both_measured_prefixes():
    """Each verified row attends over the whole prefix: with forwards measured at a short and at a long prefix (here
    2,048 tokens), a forward's cost at any prefix follows the line through their milliseconds, over the step there;
    so at 4K a marginal drafter block that pays at a short prefix is priced out, and a lookup continuation is cut
    shorter."""
    short, long = ((2, 1.05), (4, 1.15), (8, 1.3)), ((2, 1.25), (4, 1.4), (8, 1.8))
    costs = RoundCosts(draft_round_cost=0.2, forward_costs=short, long_forward_costs=long, long_prefix_length=2048,
                       step_doubling_length=4096)  # fmt: skip
    assert costs.forward_cost(8, 0) == pytest.approx(1.3) and costs.forward_cost(8, 2048) == pytest.approx(1.8)
    step_4k, forward_4k = 1 + 4096 / 4096, 1.3 + (1.8 * 1.5 - 1.3) * 2  # in short-prefix steps
    assert costs.forward_cost(8, 4096) == pytest.approx(forward_4k / step_4k)
    assert costs.verify_cost(7, 4096) == pytest.approx(forward_4k / step_4k - 1)
    costs_at = [costs.verify_cost(3, n) for n in (0, 1024, 2048, 4096, 32768)]
    assert costs_at == sorted(costs_at) and costs_at[-1] < 1.0  # grows with the prefix, towards a limit
    assert RoundCosts(forward_costs=short).forward_cost(8, 4096) == pytest.approx(1.3)  # no long curve: as short
    flat = RoundCosts(forward_costs=short, long_forward_costs=long, long_prefix_length=2048)  # a flat step
    assert flat.forward_cost(8, 32768) == pytest.approx(1.8)  # not extrapolated beyond the measured prefix
    assert costs.batch_verify_cost(1, 3, 4096) == costs.verify_cost(3, 4096)
    eight_rows, two_rows = costs.forward_cost(8, 4096), costs.forward_cost(2, 4096)
    assert costs.batch_verify_cost(2, 3, 4096) == pytest.approx(eight_rows / two_rows - 1)
    # A drafter keeping 3 drafts in 10: (1 + E) over the round's cost is above a plain step at a short prefix only.
    assert costs.drafter_value(0.3, 7, 0)[0] > 1.02 and costs.drafter_value(0.3, 7, 4096)[0] < 0.95
    planner = RoundPlanner(costs)
    for _ in range(8):
        planner.record(Source.LOOKUP, 6, 2)
    assert planner.lookup_length(10, length=4096) < planner.lookup_length(10, length=0)
