"""A drafter's draft vocabulary: the `draft_vocab_size` target token ids it proposes (EAGLE-3's pruned output
vocabulary), and the mapping between its logits' columns and the target's token ids.

The drafter scores only those tokens (rows of the target's LM head, gathered by `bind_target`); the verifier reads
target-vocabulary laws, so `to_target_vocab` gives the other tokens probability zero (`-inf` logits).
"""

from __future__ import annotations

import copy
from typing import TypeVar

import torch

Drafter = TypeVar("Drafter", bound="DraftVocabularyMixin")


class DraftVocabularyMixin:
    """The draft-vocabulary methods of `LongSparkDrafterModel` (`config.draft_vocab_size`, the `draft_vocab` buffer);
    with no draft vocabulary each mapping is the identity."""

    def set_draft_vocab(self, token_ids: torch.LongTensor) -> None:
        """Sets the `draft_vocab_size` target token ids the drafter proposes (distinct, any order)."""
        size = self.config.draft_vocab_size
        if size is None:
            raise ValueError("This drafter drafts over the full vocabulary; build it with `draft_vocab_size` set.")
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if token_ids.numel() != size or token_ids.unique().numel() != size:
            raise ValueError(f"A draft vocabulary needs {size} distinct token ids, got {token_ids.numel()} "
                             f"({token_ids.unique().numel()} distinct).")  # fmt: skip
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size:
            raise ValueError(f"Draft vocabulary ids must lie in [0, {self.config.vocab_size}).")
        self.draft_vocab.copy_(token_ids)
        if self._target is not None:
            self._bind_output_head()

    def with_draft_vocab(self: Drafter, token_ids: torch.LongTensor) -> Drafter:
        """A copy of this drafter that proposes only `token_ids`.

        The Markov rows of tokens this drafter already proposes are kept; tokens it could not propose (when it has
        a draft vocabulary already, e.g. one grown for a new domain) start with zero Markov rows.
        """
        token_ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).flatten()
        config = copy.deepcopy(self.config)
        config.draft_vocab_size = token_ids.numel()
        model = type(self)(config).to(device=self.device, dtype=self.dtype)
        model.generation_config = copy.deepcopy(self.generation_config)
        model.set_draft_vocab(token_ids)
        state = self.state_dict()
        columns = self.draft_indices(token_ids)  # -1 where this drafter cannot propose the token
        old_rows = state["markov_proj.weight"]
        rows = old_rows.new_zeros(token_ids.numel(), old_rows.shape[1])
        rows[columns >= 0] = old_rows[columns[columns >= 0]]
        state["markov_proj.weight"] = rows
        state["draft_vocab"] = model.draft_vocab
        model.load_state_dict(state)
        return model

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """`(..., output_vocab_size)` drafter logits -> `(..., vocab_size)`, `-inf` for tokens it cannot propose."""
        if self.config.draft_vocab_size is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab.to(logits.device), logits)

    def to_target_ids(self, columns: torch.LongTensor) -> torch.LongTensor:
        """Target token id of each column of the drafter's logits (the inverse of `draft_indices`)."""
        if self.config.draft_vocab_size is None:
            return columns
        return self.draft_vocab.to(columns.device)[columns]

    def draft_indices(self, token_ids: torch.LongTensor) -> torch.LongTensor:
        """Column of each target token id in the drafter's logits, `-1` for tokens outside its draft vocabulary."""
        if self.config.draft_vocab_size is None:
            return token_ids
        index = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=token_ids.device)
        columns = torch.arange(self.config.draft_vocab_size, device=token_ids.device)
        index[self.draft_vocab.to(token_ids.device)] = columns
        return index[token_ids]


__all__ = ["DraftVocabularyMixin"]
