"""The lookup source's share of `drafting_cost.py`: a synthetic token history per prefix length, indexed in the
`SuffixIndex` of a `longspark_lookup` candidate generator, and the ids its timed rounds propose after."""

from __future__ import annotations

import random

import torch

from ..inference.generation import LongSparkCandidateGenerator
from .common import timed_call

# With the lookup source on: the round with it, its cost over the lookup-off round's, the index per request.
LOOKUP_ROW_FIELDS = ("longspark_lookup_ms", "longspark_lookup_update_ms", "longspark_lookup_proposal_ms",
                     "longspark_lookup_ms_vs_shortest", "lookup_overhead_ms", "lookup_index_bytes",
                     "lookup_prefill_index_ms", "lookup_hit_rounds")  # fmt: skip
LOOKUP_HISTORY = "random ids in stretches of 8-64 tokens, 30% of them copies of earlier stretches (lookup_history)"
LOOKUP_NOTES = (
    " longspark_lookup: the same drafter with its lookup source on; each round adds the round's new tokens (fresh "
    "random ids) to the request's SuffixIndex, queries it and drafts the block on a miss (the round's full cost). "
    "lookup_index_bytes: SuffixIndex.nbytes of a synthetic history of prefix + 1 tokens (grows with the prefix); "
    "lookup_prefill_index_ms: indexing it, once per request; lookup_overhead_ms: longspark_lookup_ms - longspark_ms."
)


def lookup_history(length: int, vocab_size: int, seed: int = 0, repeat_share: float = 0.3) -> list[int]:
    """`length` seeded token ids with repeated stretches, as in code: stretches of 8-64 tokens, each either fresh
    random ids or (with probability `repeat_share`) a copy of an earlier stretch of the history."""
    rng = random.Random(seed)
    tokens: list[int] = []
    while len(tokens) < length:
        size = rng.randint(8, 64)
        if len(tokens) >= size and rng.random() < repeat_share:
            start = rng.randrange(len(tokens) - size + 1)
            tokens.extend(tokens[start : start + size])
        else:
            tokens.extend(rng.randrange(vocab_size) for _ in range(size))
    return tokens[:length]


class LookupRounds:
    """The token ids the `longspark_lookup` generator proposes after, round by round.

    Indexes `history` (the request's tokens when the first round after the prefill runs: the index holds them all,
    `prefill_index_ms`, `index_bytes`); then each round's ids end `new_tokens` tokens further into `round_tokens`,
    which that round's `plan_round` adds to the index before querying it, as after a verification.
    """

    def __init__(self, gen: LongSparkCandidateGenerator, history: list[int], round_tokens: list[int], new_tokens: int):
        seconds, _ = timed_call(gen.planner.lookup.extend, history)
        self.prefill_index_ms, self.index_bytes = 1000.0 * seconds, gen.planner.lookup.nbytes
        self.ids = torch.tensor([history + round_tokens], device=gen.session.drafter.device)
        self.length, self.new_tokens = len(history), new_tokens

    def next_ids(self) -> torch.LongTensor:
        self.length += self.new_tokens
        if self.length > self.ids.shape[1]:
            raise RuntimeError(f"More lookup rounds than the {self.ids.shape[1]} tokens planned for.")
        return self.ids[:, : self.length]


__all__ = ["LOOKUP_ROW_FIELDS", "LookupRounds", "lookup_history"]
