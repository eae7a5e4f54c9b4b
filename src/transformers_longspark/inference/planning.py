"""Which source proposes a request's next round: the lookup continuation, a drafted block, or nothing at all.

Speculation pays only where a round yields more tokens than it costs. The cost model of the drafter's generation
config counts in plain decoding steps of the target: a verification forward over the anchor and `k` proposed tokens
costs `1 + verify_round_cost + verify_token_cost * k` steps (on some CPUs any forward of more than one token is
dearer, whatever `k`: `verify_round_cost`), and a drafter round `draft_round_cost` steps at a short prefix. The
drafter's round costs the same at any prefix length (its context is fixed-size), while the target's step grows with
the prefix, by one more step every `step_doubling_length` tokens: at `t` tokens a drafter round costs
`draft_round_cost / (1 + t / step_doubling_length)` steps. A calibration (`calibration.py`) measures the verification
at every row count instead (`forward_costs`: on a CPU whose kernel changes between 3 and 4 rows the cost has a knee
that no line follows), and at a long prefix too (`long_forward_costs`: each verified row attends over the whole
prefix), so that a round is priced at its request's length. A source expected to yield `E` accepted drafts from `k`
proposed ones gives `(1 + E) / (1 + cost)` tokens per step; plain decoding, a round that proposes nothing, gives 1.

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


def expected_accepted(rate: float, num_tokens: int) -> float:
    """`a + a^2 + ... + a^k`: the drafts accepted of `k` proposed when each is kept with probability `a` while the
    ones before it were."""
    if rate >= 1.0:
        return float(num_tokens)
    return rate * (1.0 - rate**num_tokens) / (1.0 - rate)


def interpolate(points: tuple[tuple[int, float], ...], x: float) -> float:
    """The piecewise-linear curve through `points` (`(x, y)`, increasing `x`) at `x`, its end segments extended
    beyond them (a single point: that point's `y`)."""
    if len(points) == 1:
        return points[0][1]
    segment = next((i for i in range(1, len(points) - 1) if x <= points[i][0]), len(points) - 1)
    (x0, y0), (x1, y1) = points[segment - 1], points[segment]  # the last segment, extended, beyond the last point
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


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


@dataclass(frozen=True)
class RoundCosts:
    """The cost model, in plain decoding steps of the target (`planning.py`); `step_doubling_length` 0: the step's
    cost does not grow with the prefix.

    A verification's and a batch's costs, where a calibration measured them (`calibration.py`; empty: read from the
    batch-1 fields): `forward_costs`, `(rows, steps)` pairs, the cost of one forward of `rows` tokens in one-row steps
    at a short prefix (a batched forward of `B` rows of `n` tokens costs about what one row of `B * n` tokens does);
    `long_forward_costs`, the same at a prefix of `long_prefix_length` tokens in one-row steps there (a few rows
    attend over the prefix `rows` times: on a small target at 4K tokens 8 rows cost 1.9 steps, 1.35 at a short
    prefix); `draft_batch_costs`, `(batch, steps)` pairs, a drafter round over `batch` requests in one-row steps.
    Between and beyond the measured points each is read piecewise-linearly (`interpolate`), and between and beyond
    the two prefixes linearly in the prefix's length, in milliseconds, over the step's at that length
    (`forward_cost`)."""

    draft_round_cost: float = 0.0
    verify_round_cost: float = 0.0
    verify_token_cost: float = 0.0
    step_doubling_length: int = 0
    forward_costs: tuple[tuple[int, float], ...] = ()
    draft_batch_costs: tuple[tuple[int, float], ...] = ()
    long_forward_costs: tuple[tuple[int, float], ...] = ()
    long_prefix_length: int = 0

    def __post_init__(self):
        # e.g. lists read back from a cached JSON
        for name in ("forward_costs", "draft_batch_costs", "long_forward_costs"):
            points = tuple((int(n), float(cost)) for n, cost in getattr(self, name))
            object.__setattr__(self, name, points)

    def step_growth(self, length: int) -> float:
        """The one-token step at a prefix of `length` tokens, in steps at a short prefix."""
        return 1.0 + length / self.step_doubling_length if self.step_doubling_length else 1.0

    def drafter_cost(self, length: int, batch: int = 1) -> float:
        """One drafter round over `batch` requests at a prefix of `length` tokens, in (batched) target steps at that
        length. Unmeasured batches: a round costs `draft_round_cost` of the batched step, as at batch 1."""
        if batch == 1 or not self.draft_batch_costs:
            return self.draft_round_cost / self.step_growth(length)
        measured = interpolate(((1, self.draft_round_cost), *self.draft_batch_costs), batch)
        return measured / (self.forward_cost(batch, length) * self.step_growth(length))

    def verify_cost(self, proposed: float, length: int = 0) -> float:
        """What verifying `proposed` tokens at a prefix of `length` tokens costs beyond a plain step, in steps: the
        measured forward costs of `1 + proposed` rows (`forward_cost`) where a calibration measured them (a CPU whose
        kernel changes between 3 and 4 rows has a knee that no line follows), else `verify_round_cost +
        verify_token_cost * proposed`."""
        if self.forward_costs:
            return self.forward_cost(1 + proposed, length) - 1.0 if proposed > 0 else 0.0
        return self.verify_round_cost + self.verify_token_cost * proposed

    def forward_cost(self, rows: float, length: int = 0) -> float:
        """One forward of `rows` tokens at a prefix of `length` tokens, in one-row steps at that prefix: the measured
        `forward_costs`, carried to `length` along the line through its milliseconds at the short and the long
        prefix (`long_forward_costs`; without them, as at a short prefix), else the line of `verify_cost` (`1 + k`
        rows cost `1 + verify_cost(k)`). At least a step: a forward never costs less than a one-token one."""
        if rows <= 1:
            return 1.0
        if not self.forward_costs:
            return 1.0 + self.verify_round_cost + self.verify_token_cost * (rows - 1)
        short = interpolate(((1, 1.0), *self.forward_costs), rows)
        if not self.long_forward_costs or self.long_prefix_length <= 0:
            return short
        long = interpolate(((1, 1.0), *self.long_forward_costs), rows) * self.step_growth(self.long_prefix_length)
        # With a flat step (no growth measured) the attention's share is small: no extrapolation past the long prefix.
        reach = length if self.step_doubling_length else min(length, self.long_prefix_length)
        milliseconds = short + (long - short) * reach / self.long_prefix_length  # in short-prefix steps
        return max(1.0, milliseconds / self.step_growth(reach))

    def batch_verify_cost(self, batch: int, proposed: int, length: int = 0) -> float:
        """What verifying `proposed` tokens in each of `batch` rows costs beyond a plain batched step, in such steps:
        the verification's `batch * (1 + proposed)` rows against the plain step's `batch` (`forward_cost`). So a
        wide batch pays each proposed token nearly in full, where one row's step has rows to spare (on a 2-core CPU,
        8 rows cost ~1.2 one-row steps, 64 rows ~3.1); at batch 1 this is `verify_cost(proposed)`. `length`: the
        longest request's prefix."""
        if batch == 1:
            return self.verify_cost(proposed, length)
        return self.forward_cost(batch * (1 + proposed), length) / self.forward_cost(batch, length) - 1.0

    def drafter_value(self, rate: float | None, block: int, length: int) -> tuple[float, int]:
        """`(tokens per step, k)`: the best of letting a drafter round at a prefix of `length` tokens propose at most
        `k <= block` tokens, at continuation rate `rate` (`proposal_value`, the drafter's round included). Its
        confidence cuts may end a block sooner; this caps it where more verified rows would cost more than they
        yield (on a CPU whose kernel changes at 4 rows, a third draft kept 1 time in 4 does not pay)."""
        return self.proposal_value(rate, block, self.drafter_cost(length), length=length)

    def lookup_value(
        self, rate: float | None, available: int, fixed: bool = False, length: int = 0
    ) -> tuple[float, int]:
        """`(tokens per step, k)`: the best of proposing the first `k <= available` tokens of a lookup continuation
        (`fixed`: all of them) at continuation rate `rate`, at a prefix of `length` tokens (`proposal_value`)."""
        return self.proposal_value(rate, available, 0.0, fixed, length)

    def proposal_value(
        self, rate: float | None, available: int, extra: float, fixed: bool = False, length: int = 0
    ) -> tuple[float, int]:
        """`(tokens per step, k)`: the best of proposing `k <= available` tokens (`fixed`: all of them) that are kept
        one after another at continuation rate `rate` (`expected_accepted`), for a round at a prefix of `length`
        tokens that costs `extra` steps besides its verification; the longest ties win (with all costs 0 longer is
        never worse). `rate` None (the source is untried): infinite, and all `available`."""
        if rate is None:
            return float("inf"), available
        best = (0.0, 0)
        for k in range(available if fixed else 1, available + 1):
            value = (1.0 + expected_accepted(rate, k)) / (1.0 + self.verify_cost(k, length) + extra)
            if value >= best[0]:
                best = (value, k)
        return best


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
    "RoundCosts",
    "RoundPlan",
    "RoundPlanner",
    "Source",
    "SourceRecord",
    "expected_accepted",
    "interpolate",
]
