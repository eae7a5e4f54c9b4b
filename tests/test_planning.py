"""The source choice (`inference/planning.py`): untried sources first, then the cost model, with probes."""

import pytest

from transformers_longspark.inference.planning import (
    FIRST_PROBE_INTERVAL,
    MAX_PROBE_INTERVAL,
    RoundCosts,
    RoundPlanner,
    Source,
)

CPU = RoundCosts(draft_round_cost=0.4, verify_token_cost=0.15)


def test_untried_sources_are_tried_first():
    planner = RoundPlanner(CPU)
    assert planner.choose([1, 2, 3], can_draft=True) is Source.LOOKUP
    planner.record(Source.LOOKUP, proposed=3, accepted=3)
    assert planner.choose([1, 2, 3], can_draft=True) is Source.DRAFTER  # the drafter is still untried
    assert planner.choose([], can_draft=False) is Source.NONE  # nothing to propose


def test_the_source_worth_more_tokens_per_step_wins():
    planner = RoundPlanner(CPU)
    planner.record(Source.LOOKUP, proposed=10, accepted=4)  # (1 + 4) / (1 + 1.5) = 2.0
    planner.record(Source.DRAFTER, proposed=3, accepted=2)  # (1 + 2) / (1 + 0.4 + 0.45) = 1.62
    assert planner.choose([7] * 10, can_draft=True) is Source.LOOKUP
    assert planner.choose([7], can_draft=True) is Source.LOOKUP  # a shorter continuation costs less
    assert planner.choose([], can_draft=True) is Source.DRAFTER


def test_a_drafter_that_does_not_pay_is_skipped_and_probed_at_growing_intervals():
    planner = RoundPlanner(CPU)
    planner.record(Source.DRAFTER, proposed=3, accepted=0)  # 1 / 1.85 < 1: plain decoding is worth more
    choices = [planner.choose([], can_draft=True) for _ in range(300)]
    probes = [i for i, source in enumerate(choices) if source is Source.DRAFTER]
    gaps = [b - a for a, b in zip([-1, *probes], probes)]
    interval = FIRST_PROBE_INTERVAL
    assert gaps[:3] == [interval, 2 * interval, 4 * interval] and set(gaps[3:]) == {MAX_PROBE_INTERVAL}
    assert set(choices) == {Source.NONE, Source.DRAFTER}


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


def test_a_fixed_verification_overhead_favours_long_proposals():
    """Where any forward of several tokens costs a fixed share more than a one-token step (`verify_round_cost`), a
    short lookup continuation that accepts little does not pay, and a long one that accepts much does."""
    costs = RoundCosts(verify_round_cost=0.45, verify_token_cost=0.08)
    planner = RoundPlanner(costs)
    planner.record(Source.LOOKUP, proposed=2, accepted=0.5)  # (1 + 0.5) / (1 + 0.45 + 0.16) < 1
    assert planner.choose([1, 2], can_draft=False) is Source.NONE
    planner = RoundPlanner(costs)
    planner.record(Source.LOOKUP, proposed=10, accepted=3)  # (1 + 3) / (1 + 0.45 + 0.8) > 1
    assert planner.choose([1] * 10, can_draft=False) is Source.LOOKUP
