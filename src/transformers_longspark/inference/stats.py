"""What a speculative decoding run measures: `DraftingStats` (kept on `drafter.drafting_stats` after each call) and
tau, the tokens per verification round, defined once (`tau`)."""

from __future__ import annotations

from dataclasses import dataclass, field


def tau(new_tokens: int, rounds: int, sequences: int = 1) -> float:
    """Tokens per verification round, bonus token included: `(new_tokens - sequences) / rounds`.

    Each sequence's first new token comes from its prefill forward, and every later round adds the accepted drafts
    plus one; plain decoding's tau is 1. `new_tokens` and `rounds` are summed over `sequences` sequences."""
    if new_tokens < sequences or rounds <= 0:
        raise ValueError(
            f"tau needs at least one new token per sequence and one round, got {new_tokens} tokens of {sequences} "
            f"sequence(s) in {rounds} rounds."
        )
    if new_tokens - sequences < rounds:
        raise ValueError(f"{rounds} rounds cannot yield only {new_tokens - sequences} tokens after the prefill.")
    return (new_tokens - sequences) / rounds


@dataclass
class DraftingStats:
    """Per-`generate` counters, kept on `drafter.drafting_stats` after each call.

    `tau = (new tokens - 1) / verification rounds`: the prefill forward yields the first token, then each round
    adds the accepted draft tokens plus one. In a batch (`batched.py`), `rounds` counts each sequence's rounds (a
    forward over `n` unfinished sequences adds `n`), so `tau = (new tokens - batch size) / rounds`, and
    `batch_rounds` counts the batched forwards.
    """

    rounds: int = 0
    batch_rounds: int = 0
    drafted_tokens: int = 0
    lookup_rounds: int = 0  # rounds that proposed the lookup source's continuation instead of a drafted block
    plain_rounds: int = 0  # rounds that proposed nothing (the cost model's choice, or no room): plain decoding steps
    # accepted_histogram[k]: rounds with a proposal that accepted exactly k drafts (`acceptance_rates()`).
    accepted_histogram: list[int] = field(default_factory=list)
    drafter_rounds: int = 0  # batched forwards that ran the drafter
    # Where the drafting time goes (seconds): `proposal_seconds` is the planning and the proposals (the drafter
    # forward, its token loop, lookup continuations) together; `context_update_seconds` the context reads (summary
    # update, window and boundary views) of drafter rounds. `drafter_round_parts` splits them per drafter round.
    proposal_seconds: float = 0.0
    planning_seconds: float = 0.0
    drafter_forward_seconds: float = 0.0
    context_update_seconds: float = 0.0
    context_state_bytes: int = 0

    def record_accepted(self, counts: list[int]) -> None:
        """Adds rounds that accepted `counts[r]` drafts each."""
        for count in counts:
            if count >= len(self.accepted_histogram):
                self.accepted_histogram.extend([0] * (count + 1 - len(self.accepted_histogram)))
            self.accepted_histogram[count] += 1

    def drafter_round_parts(self) -> dict[str, float]:
        """Milliseconds per drafter round: the drafter forward, the context read (with the summary update), the
        planning, and the rest of the proposal (the token loop with the Markov correction and the processors, lookup
        continuations, bookkeeping); `total` is their sum. Planning and the rest are spread over drafter rounds too,
        as they are what the drafting costs beside the target's forwards."""
        rounds = max(self.drafter_rounds, 1)
        rest = self.proposal_seconds - self.planning_seconds - self.drafter_forward_seconds
        parts = {
            "drafter_forward": self.drafter_forward_seconds,
            "context_read": self.context_update_seconds,
            "planning": self.planning_seconds,
            "rest": max(rest, 0.0),
        }
        parts = {name: seconds * 1e3 / rounds for name, seconds in parts.items()}
        return {**parts, "total": sum(parts.values())}

    def acceptance_rates(self) -> list[float]:
        """`[P(draft 1 accepted), P(drafts 1-2 accepted), ...]` over the verified rounds."""
        histogram = self.accepted_histogram
        total = sum(histogram)
        return [sum(histogram[k:]) / total for k in range(1, len(histogram))] if total else []


__all__ = ["DraftingStats", "tau"]
