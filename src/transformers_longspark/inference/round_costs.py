"""The cost model of the source choice (`planning.py`), in plain decoding steps of the target.

The drafter's generation config gives the costs: a verification forward over the anchor and `k` proposed tokens
costs `1 + verify_round_cost + verify_token_cost * k` steps (on some CPUs any forward of more than one token is
dearer, whatever `k`: `verify_round_cost`), and a drafter round `draft_round_cost` steps at a short prefix. The
drafter's round costs the same at any prefix length (its context is fixed-size), while the target's step grows with
the prefix, by one more step every `step_doubling_length` tokens: at `t` tokens a drafter round costs
`draft_round_cost / (1 + t / step_doubling_length)` steps. A calibration (`calibration.py`) measures the verification
at every row count instead (`forward_costs`: on a CPU whose kernel changes between 3 and 4 rows the cost has a knee
that no line follows), and at a long prefix too (`long_forward_costs`: each verified row attends over the whole
prefix), so that a round is priced at its request's length. A source expected to yield `E` accepted drafts from `k`
proposed ones gives `(1 + E) / (1 + cost)` tokens per step (`RoundCosts.proposal_value`); plain decoding, a round
that proposes nothing, gives 1.
"""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass(frozen=True)
class RoundCosts:
    """The cost model, in plain decoding steps of the target (the module docstring); `step_doubling_length` 0: the
    step's cost does not grow with the prefix.

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


__all__ = ["RoundCosts", "expected_accepted", "interpolate"]
