"""Which source proposes a request's next round: the lookup continuation, a drafted block, or nothing at all.

Speculation pays only where a round yields more tokens than it costs: each source is valued in tokens per target
step by the cost model, `RoundCosts` (`round_costs.py`); a plain step, a round that proposes nothing, is worth 1.

`RoundPlanner` keeps, per request and source, the running means of the drafts proposed and accepted per verified
round and of the rounds that rejected one (`record`), and takes the source worth most (`choose`). Both sources' drafts
are accepted one after another while they match, so from a source's continuation rate `a` (accepted / (accepted +
rejections), the geometric estimate; a round that kept all it proposed says only that each token was kept) `k`
tokens yield `E(k) = a + a^2 + ... + a^k`, and the planner chooses the length worth most too: of a lookup
continuation (`lookup_length`), and the most a drafter block may propose (`draft_length`; its confidence cuts,
`drafting.draft_tokens`, may end it sooner, from the drafter's own probabilities of this round). Under greedy decoding
a repeated file keeps `a` near 1 and the whole continuation is proposed; sampled at T=1 a token is kept with its
target probability only, and 1-3 tokens are worth more than 10. A longer matched suffix predicts its continuation
better (held-out code, greedy: the first copied token is right in 64% of the rounds with a match of 2 or more
tokens, 70% with 3 or more; `scripts/lookup_bound.py`), so each matched length keeps its own rate too, mixed with the
source's pooled one (`match_rate`).

A lookup continuation worth more than a plain step is taken without weighing the drafter (`lookup_first`): the
drafter competes with plain steps in the rounds without one. A source passed over is probed again after 4, 8, 16 and
then every 32 rounds, so that its means follow the text (a drafter that stops paying in prose may pay again in code).
With all costs 0 (a GPU, where a verified token is almost free) a round never proposes nothing.

The choice reads the request's committed tokens and past verifications only, never this round's draws, so the law
handed to the verifier stays exact, and a seeded run repeats itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

import torch

from .lookup import SuffixIndex
from .round_costs import RoundCosts, expected_accepted

# The weight of the newest round in a source's running means (`RoundPlanner.record`).
RUNNING_MEAN_WEIGHT = 0.25
# A source's running means start from a prior, one accepted draft and one rejection a round (a continuation rate of
# 1/2), worth this many rounds: its first verified round is folded into the prior, not put in its place, so that one
# unlucky first round (a drafter's first block after the prefill is often rejected whole) does not price the source
# out of the rounds after it (0: the first round's means replace the prior).
PRIOR_ROUNDS = 3
# A matched length's own continuation rate counts as many rounds as it has seen, up to the running mean's memory (4),
# against this many for the pooled rate of all lookup rounds (`RoundPlanner.match_rate`).
POOLED_RATE_ROUNDS = 2
# A source passed over this many rounds in a row is tried again, then after twice as many, up to the most.
FIRST_PROBE_INTERVAL = 4
MAX_PROBE_INTERVAL = 32


class Source(str, Enum):
    """Where a round's proposal comes from."""

    LOOKUP = "lookup"
    DRAFTER = "drafter"
    NONE = "none"  # no proposal: the round is one plain decoding step of the target


@dataclass
class SourceRecord:
    """Running means of one source's verified rounds for one request (`None`: never verified): drafts accepted and
    proposed, and rounds that rejected a draft (`rejected`); and its probing."""

    accepted: float | None = None
    proposed: float | None = None
    rejected: float = 0.0
    rounds: int = 0
    passed_over: int = 0
    probe_interval: int = FIRST_PROBE_INTERVAL

    def update(self, proposed: int, accepted: int) -> None:
        rejected, self.rounds = float(accepted < proposed), self.rounds + 1
        weight = RUNNING_MEAN_WEIGHT
        if self.accepted is None:
            self.accepted, self.proposed, self.rejected = 1.0, float(proposed), 1.0
            weight = 1.0 / (1 + PRIOR_ROUNDS)
        self.accepted += weight * (accepted - self.accepted)
        self.proposed += weight * (proposed - self.proposed)
        self.rejected += weight * (rejected - self.rejected)

    @property
    def continuation_rate(self) -> float:
        """`a`, the chance that a draft is kept after the ones before it were: accepted / (accepted + rejections)."""
        if self.accepted is None or self.accepted + self.rejected == 0.0:
            return 0.0
        return self.accepted / (self.accepted + self.rejected)


@dataclass
class RoundPlanner:
    """One request's source choice (`choose`) and what its past rounds measured (`record`).

    Attributes:
        costs: the cost model.
        lookup: the request's `SuffixIndex`, or `None` with the lookup source off.
        choose_lookup_length: propose the best prefix of a lookup continuation (`lookup_length`), else all of it.
        lookup_first: a lookup continuation worth more than a plain step is taken without weighing the drafter
            (`choose`); False: the two compete on their estimated tokens per step.
        block_size: the most tokens of a drafter block (the drafter's `B`, as `DraftSettings.new_planner` passes it).
    """

    costs: RoundCosts
    lookup: SuffixIndex | None = None
    choose_lookup_length: bool = True
    lookup_first: bool = True
    block_size: int = 7
    records: dict[Source, SourceRecord] = field(default_factory=lambda: {s: SourceRecord() for s in Source})
    # The lookup rounds by the length of their matched suffix, and the matched length of this round's continuation.
    match_records: dict[int, SourceRecord] = field(default_factory=dict)
    lookup_match: int = 0
    # The most tokens this round's drafter block may propose (`drafter_value`), when the drafter is chosen.
    draft_length: int = 0

    def match_rate(self, matched: int = 0) -> float | None:
        """The continuation rate of lookup rounds after a `matched`-token suffix: the pooled rate of all lookup rounds
        (`None` while there were none), mixed with that length's own as it gains rounds (`POOLED_RATE_ROUNDS`)."""
        pooled = self.records[Source.LOOKUP]
        if pooled.accepted is None:
            return None
        own = self.match_records.get(matched)
        if own is None:
            return pooled.continuation_rate
        weight = min(own.rounds, round(1 / RUNNING_MEAN_WEIGHT))
        return (weight * own.continuation_rate + POOLED_RATE_ROUNDS * pooled.continuation_rate) / (
            weight + POOLED_RATE_ROUNDS
        )

    def lookup_plan(self, available: int, matched: int = 0, length: int = 0) -> tuple[float, int]:
        """`(tokens per step, k)` of proposing `k` of the `available` tokens of a continuation after a `matched`-token
        suffix, for a request of `length` tokens (`RoundCosts.lookup_value`; all of them with `choose_lookup_length`
        off)."""
        rate, fixed = self.match_rate(matched), not self.choose_lookup_length
        return self.costs.lookup_value(rate, available, fixed=fixed, length=length)

    def lookup_length(self, available: int, matched: int = 0, length: int = 0) -> int:
        """How many of the `available` tokens of a continuation after a `matched`-token suffix to propose, for a
        request of `length` tokens."""
        return self.lookup_plan(available, matched, length)[1]

    def drafter_rate(self) -> float | None:
        """The drafter's continuation rate (`None` while it is untried)."""
        record = self.records[Source.DRAFTER]
        return None if record.accepted is None else record.continuation_rate

    def choose(
        self, continuation: list[int], can_draft: bool, length: int = 0, matched: int = 0, room: int | None = None
    ) -> Source:
        """This round's source, among the lookup continuation (when `continuation` is non-empty: the tokens after a
        `matched`-token suffix, worth its best length, `lookup_length`), the drafter (when `can_draft`: a block of at
        most `room` tokens, default `block_size`, worth its best length, `draft_length`) and no proposal, for a
        request of `length` tokens. Ties go to the first of that order. With `lookup_first`, a continuation worth at
        least a plain step is taken without weighing the drafter."""
        values = {}
        if continuation:
            values[Source.LOOKUP] = self.lookup_plan(len(continuation), matched, length)[0]
        # A continuation is evidence about this round, the drafter's value a running mean over its past rounds: valued
        # against each other, the drafter won rounds that the continuation would have yielded more in (replayed on
        # held-out answers: docs/how-it-works.md, "Which source first").
        lookup_pays = self.lookup_first and values.get(Source.LOOKUP, 0.0) >= 1.0
        if can_draft and not lookup_pays:
            block = self.block_size if room is None else min(room, self.block_size)
            values[Source.DRAFTER], self.draft_length = self.costs.drafter_value(self.drafter_rate(), block, length)
        options = list(values)
        values[Source.NONE] = 1.0
        best = max(values, key=values.get)  # the first of the largest: dicts keep the order above
        probe = None
        for source in options:
            record = self.records[source]
            if source is best:
                record.passed_over, record.probe_interval = 0, FIRST_PROBE_INTERVAL
                continue
            if record.accepted is None:  # untried, it is worth the most: it lost only to another untried source
                continue
            record.passed_over += 1
            if probe is None and record.passed_over >= record.probe_interval:  # its means may be stale: try it
                record.passed_over, record.probe_interval = 0, min(2 * record.probe_interval, MAX_PROBE_INTERVAL)
                probe = source
        chosen = best if probe is None else probe
        self.lookup_match = matched if chosen is Source.LOOKUP else 0
        self.draft_length = self.draft_length if chosen is Source.DRAFTER else 0
        return chosen

    def expected_accepted(self, source: Source, proposed: int) -> float:
        """The drafts a round from `source` proposing `proposed` tokens is expected to keep, from this request's past
        rounds (infinite while the source is untried: it is worth trying)."""
        if source is Source.NONE or proposed == 0:
            return 0.0
        if source is Source.LOOKUP:
            rate = self.match_rate(self.lookup_match)
            return float("inf") if rate is None else expected_accepted(rate, proposed)
        rate = self.drafter_rate()
        return float("inf") if rate is None else expected_accepted(rate, proposed)

    def record(self, source: Source, proposed: int, accepted: int) -> None:
        """Folds one verified round from `source` (`proposed` tokens, `accepted` of them kept) into its means (and a
        lookup round into those of its matched length)."""
        if source is not Source.NONE:
            self.records[source].update(proposed, accepted)
        if source is Source.LOOKUP:
            self.match_records.setdefault(self.lookup_match, SourceRecord()).update(proposed, accepted)


def batch_round_pays(
    planners: list[RoundPlanner], sources: list[Source], proposed: list[int], length: int, costs: RoundCosts
) -> bool:
    """Whether a batched round whose requests chose `sources`, proposing `proposed` tokens each, yields more tokens
    per step than a plain batched step. A batched verification pads every row to the widest proposal, so each row
    pays for `max(proposed)` verified tokens (`RoundCosts.batch_verify_cost`, and the drafter's round if any row
    drafts), whatever it proposed itself: the round pays when `sum(1 + E_r) / sum(1 + cost_r) >= 1`. `length` is the
    longest request's, for the verification's and the drafter's costs."""
    width = max(proposed, default=0)
    if width == 0:
        return True  # nothing proposed: the round is a plain step already
    drafter = costs.drafter_cost(length, len(planners)) if Source.DRAFTER in sources else 0.0
    row_cost = 1.0 + costs.batch_verify_cost(len(planners), width, length) + drafter
    tokens = sum(1.0 + accepted for accepted in batch_expected_accepted(planners, sources, proposed))
    return tokens >= row_cost * len(planners)


def batch_expected_accepted(planners: list[RoundPlanner], sources: list[Source], proposed: list[int]) -> list[float]:
    """Each row's expected accepted drafts (`RoundPlanner.expected_accepted`), where a row has not tried its source
    valued at what the batch's other rows measured of it (their mean continuation rate for lookup, their mean drafts
    kept for the drafter): at batch 1 an untried source is worth trying, but in a batch one row's first try makes
    every row pay for a whole verification. Infinite only while no row has tried it."""
    rates = {
        Source.LOOKUP: [p.match_rate() for p in planners if p.records[Source.LOOKUP].accepted is not None],
        Source.DRAFTER: [p.drafter_rate() for p in planners if p.drafter_rate() is not None],
    }
    expected = []
    for planner, source, k in zip(planners, sources, proposed, strict=True):
        accepted = planner.expected_accepted(source, k)
        if math.isinf(accepted) and rates.get(source):
            accepted = expected_accepted(sum(rates[source]) / len(rates[source]), k)
        expected.append(accepted)
    return expected


@dataclass
class RoundPlan:
    """The sources of one round's `n` requests.

    Attributes:
        sources: per request, its `Source`.
        continuations: the lookup tokens of each request whose source is `Source.LOOKUP`, by request index.
        draft_lengths: the most tokens of each drafting request's block, by request index (none: the block size).
    """

    sources: list[Source]
    continuations: dict[int, list[int]]
    draft_lengths: dict[int, int] = field(default_factory=dict)

    def rows_from(self, source: Source, device: torch.device | None = None) -> torch.LongTensor:
        """`(n',)` the indices of the requests whose source is `source`."""
        rows = [r for r, s in enumerate(self.sources) if s is source]
        return torch.tensor(rows, dtype=torch.long, device=device)

    @property
    def drafts(self) -> bool:
        """Whether any request runs the drafter this round (it then needs the round's context views)."""
        return Source.DRAFTER in self.sources


__all__ = [
    "FIRST_PROBE_INTERVAL",
    "batch_expected_accepted",
    "batch_round_pays",
    "MAX_PROBE_INTERVAL",
    "POOLED_RATE_ROUNDS",
    "RUNNING_MEAN_WEIGHT",
    "RoundPlan",
    "RoundPlanner",
    "Source",
    "SourceRecord",
]
