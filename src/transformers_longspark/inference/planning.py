"""Which source proposes a request's next round: the lookup continuation, a drafted block, or nothing at all.

Speculation pays only where a round yields more tokens than it costs. The cost model of the drafter's generation
config counts in plain decoding steps of the target: a verification forward over the anchor and `k` proposed tokens
costs `1 + verify_round_cost + verify_token_cost * k` steps (on some CPUs any forward of more than one token is
dearer, whatever `k`: `verify_round_cost`), and a drafter round `draft_round_cost` steps at a short prefix. The
drafter's round costs the same at any prefix length (its context is fixed-size), while the target's step grows with
the prefix, by one more step every `step_doubling_length` tokens: at `t` tokens a drafter round costs
`draft_round_cost / (1 + t / step_doubling_length)` steps. A source expected to yield `E` accepted drafts from `k`
proposed ones gives `(1 + E) / (1 + cost)` tokens per step; plain decoding, a round that proposes nothing, gives 1.
The confidence cuts (`drafting.draft_tokens`) apply the same trade to each position of a block: a token is proposed
while its chance of being accepted repays its share of the verification.

`RoundPlanner` keeps, per request and source, the running means of the drafts proposed and accepted per verified
round (`record`), and takes the source worth most (`choose`). A source passed over is probed again after 4, 8, 16
and then every 32 rounds, so that its means follow the text (a drafter that stops paying in prose may pay
again in code). With all costs 0 (a GPU, where a verified token is almost free) a round never proposes nothing.

The choice reads the request's committed tokens and past verifications only, never this round's draws, so the law
handed to the verifier stays exact, and a seeded run repeats itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from .lookup import SuffixIndex

# The weight of the newest round in a source's running means (`RoundPlanner.record`).
RUNNING_MEAN_WEIGHT = 0.25
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
    """Running means of one source's verified rounds for one request (`None`: never verified), and its probing."""

    accepted: float | None = None
    proposed: float | None = None
    passed_over: int = 0
    probe_interval: int = FIRST_PROBE_INTERVAL

    def update(self, proposed: int, accepted: int) -> None:
        if self.accepted is None:
            self.accepted, self.proposed = float(accepted), float(proposed)
            return
        self.accepted += RUNNING_MEAN_WEIGHT * (accepted - self.accepted)
        self.proposed += RUNNING_MEAN_WEIGHT * (proposed - self.proposed)


@dataclass(frozen=True)
class RoundCosts:
    """The cost model, in plain decoding steps of the target (`planning.py`); `step_doubling_length` 0: the step's
    cost does not grow with the prefix."""

    draft_round_cost: float = 0.0
    verify_round_cost: float = 0.0
    verify_token_cost: float = 0.0
    step_doubling_length: int = 0

    def drafter_cost(self, length: int) -> float:
        """One drafter round at a prefix of `length` tokens, in target steps at that length."""
        growth = 1.0 + length / self.step_doubling_length if self.step_doubling_length else 1.0
        return self.draft_round_cost / growth

    def tokens_per_step(self, source: Source, record: SourceRecord, length: int, proposed: int | None = None) -> float:
        """`(1 + E) / (1 + cost)` of a round from `source` at a prefix of `length` tokens; infinite while the source
        is untried (try it first). `proposed`: this round's number of tokens where known (a lookup continuation), else
        the running mean."""
        if source is Source.NONE:
            return 1.0
        if record.accepted is None:
            return float("inf")
        cost = self.verify_round_cost + self.verify_token_cost * (record.proposed if proposed is None else proposed)
        if source is Source.DRAFTER:
            cost += self.drafter_cost(length)
        return (1.0 + record.accepted) / (1.0 + cost)


@dataclass
class RoundPlanner:
    """One request's source choice (`choose`) and what its past rounds measured (`record`).

    Attributes:
        costs: the cost model.
        lookup: the request's `SuffixIndex`, or `None` with the lookup source off.
    """

    costs: RoundCosts
    lookup: SuffixIndex | None = None
    records: dict[Source, SourceRecord] = field(default_factory=lambda: {s: SourceRecord() for s in Source})

    def choose(self, continuation: list[int], can_draft: bool, length: int = 0) -> Source:
        """This round's source, among the lookup continuation (when `continuation` is non-empty), the drafter
        (when `can_draft`) and no proposal, for a request of `length` tokens. Ties go to the first of that order."""
        options = [Source.LOOKUP] if continuation else []
        options += [Source.DRAFTER] if can_draft else []
        # A lookup round's length is known before it runs; a drafted block's is estimated from past rounds.
        proposed = {Source.LOOKUP: len(continuation), Source.DRAFTER: None}
        values = {s: self.costs.tokens_per_step(s, self.records[s], length, proposed[s]) for s in options}
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
        return best if probe is None else probe

    def record(self, source: Source, proposed: int, accepted: int) -> None:
        """Folds one verified round from `source` (`proposed` tokens, `accepted` of them kept) into its means."""
        if source is not Source.NONE:
            self.records[source].update(proposed, accepted)


@dataclass
class RoundPlan:
    """The sources of one round's `n` requests.

    Attributes:
        sources: per request, its `Source`.
        continuations: the lookup tokens of each request whose source is `Source.LOOKUP`, by request index.
    """

    sources: list[Source]
    continuations: dict[int, list[int]]

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
    "MAX_PROBE_INTERVAL",
    "RUNNING_MEAN_WEIGHT",
    "RoundCosts",
    "RoundPlan",
    "RoundPlanner",
    "Source",
    "SourceRecord",
]
