"""The lookup source: copy the continuation of the longest recent match of the request's own suffix.

Code and agentic text repeat themselves (an identifier, a line, a whole block). Where the last few committed tokens
occurred before, the tokens that followed them then are a cheap and often long proposal, which a learned drafter
cannot match on exact copies (prompt lookup, SuffixDecoding, vLLM's `ngram`/`suffix` methods). `SuffixIndex` keeps,
per request, a hash index from every n-gram (`min_ngram <= n <= max_ngram`) of its tokens to the position after its
most recent occurrence, updated with only the tokens committed since the last round:

- update: `max_ngram - min_ngram + 1` dictionary writes per new token (amortised O(1) per round for a fixed block);
- query: at most `max_ngram - min_ngram + 1` dictionary reads, whatever the request's length;
- memory: one entry per (position, n), i.e. at most `(max_ngram - min_ngram + 1) * T` entries for `T` tokens, plus
  the tokens themselves (`nbytes` estimates it). The most recent occurrence wins, so entries are overwritten, not
  added, when an n-gram repeats: repetitive text (where lookup helps) costs less.

A proposal from lookup is deterministic, so its proposal law is a point mass: the verifier gets one-hot draft logits
(`point_mass_logits`), and speculative sampling stays exact.

Under sampling a copied token is accepted with its target probability only, so a match is not enough: each index also
keeps the running mean of the drafts accepted per verified round by each source of its request (`record`), and sampled
decoding takes the lookup continuation only while its rounds keep up with the drafter's (`lookup_keeps_up`). The
choice reads past verifications only, never this round's draws, so the law handed to the verifier stays exact.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch

# The weight of the newest round in a source's running mean of accepted drafts (`SuffixIndex.record`).
ACCEPTED_MEAN_WEIGHT = 0.25


class SuffixIndex:
    """Incremental n-gram index over one request's tokens.

    Args:
        min_ngram / max_ngram: the shortest and longest suffixes looked up; the longest that matches wins.
        offset: column of the request's first token in its row of the caller's token buffer (its left padding).
    """

    def __init__(self, min_ngram: int = 2, max_ngram: int = 6, offset: int = 0):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"Lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}.")
        self.min_ngram, self.max_ngram, self.offset = min_ngram, max_ngram, offset
        self.tokens: list[int] = []
        # n-gram (as a tuple) -> index just after its most recent occurrence whose continuation was known then.
        self._next: dict[tuple[int, ...], int] = {}
        # Exponential mean of the drafts accepted per verified round, per source (None: not tried yet).
        self.accepted_mean: dict[str, float | None] = {"lookup": None, "drafter": None}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Appends committed tokens. Each n-gram ending just before a new token now has a known continuation."""
        tokens_list, index = self.tokens, self._next
        for token in tokens:
            end = len(tokens_list)  # the n-grams ending at `end - 1` are continued by `token`
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                index[tuple(tokens_list[end - n : end])] = end
            tokens_list.append(int(token))

    def longest_match(self) -> tuple[int, int]:
        """`(n, start)`: the longest suffix of `n` tokens seen before, and where its earlier continuation starts
        (`(0, -1)` if no suffix of at least `min_ngram` tokens occurred before)."""
        tokens = self.tokens
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            start = self._next.get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return n, start
        return 0, -1

    def propose(self, num_tokens: int) -> tuple[list[int], int]:
        """`(continuation, n)`: up to `num_tokens` tokens that followed the longest matching suffix of `n` tokens.

        The continuation may run into the suffix itself (a period-`p` repetition continues periodically)."""
        n, start = self.longest_match()
        if n == 0:
            return [], 0
        tokens, continuation = self.tokens, []
        period = len(tokens) - start
        for i in range(num_tokens):
            position = start + i
            continuation.append(tokens[position] if position < len(tokens) else continuation[i - period])
        return continuation, n

    def record(self, from_lookup: bool, accepted: int) -> None:
        """Folds one verified round of this request (its source, and how many of its drafts were accepted) into that
        source's running mean."""
        source = "lookup" if from_lookup else "drafter"
        mean = self.accepted_mean[source]
        self.accepted_mean[source] = accepted if mean is None else mean + ACCEPTED_MEAN_WEIGHT * (accepted - mean)

    def lookup_keeps_up(self) -> bool:
        """Whether this request's lookup rounds accept, on recent average, at least as many drafts as its drafter
        rounds (True until both sources have been verified)."""
        lookup, drafter = self.accepted_mean["lookup"], self.accepted_mean["drafter"]
        return lookup is None or drafter is None or lookup >= drafter

    @property
    def nbytes(self) -> int:
        """Approximate memory of the index (dictionary, keys and token list), in bytes."""
        keys = sum(sys.getsizeof(key) for key in self._next)
        return sys.getsizeof(self._next) + keys + sys.getsizeof(self.tokens) + 28 * len(self.tokens)


def point_mass_logits(tokens: torch.LongTensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`(..., vocab_size)` logits of the point mass on each of `tokens` `(...)`: 0 there, `-inf` elsewhere."""
    logits = torch.full((*tokens.shape, vocab_size), float("-inf"), dtype=dtype, device=tokens.device)
    return logits.scatter_(-1, tokens[..., None], 0.0)


__all__ = ["SuffixIndex", "point_mass_logits"]
