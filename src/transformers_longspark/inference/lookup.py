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

Whether a round takes the continuation is the source choice's call (`planning.py`): under sampling a copied token is
accepted with its target probability only, so a match is not always worth its verification.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch


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

    def continuation(self, num_tokens: int) -> tuple[list[int], int]:
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
