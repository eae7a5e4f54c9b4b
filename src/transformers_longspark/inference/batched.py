"""Batched LongSpark speculative decoding: `target.generate(input_ids, attention_mask=..., assistant_model=drafter)`
with more than one (left-padded) prompt.

transformers' assisted decoding is batch-1, so the generation hook (`generation.py`) routes batches here; batch 1
keeps transformers' own loop. A round serves the `n` unfinished sequences with ONE drafter forward over their `n`
blocks (`drafting.draft_tokens`) and ONE target forward over each sequence's `[a, y_1, ..., y_k]` (`k` the longest
block, shorter ones padded), then applies the acceptance rule per sequence (paper Sec. 2.1): greedy keeps the longest
prefix equal to the target's argmax, sampling runs speculative sampling. `generate`'s logits processors are applied to
the drafter's and the target's logits at every position, with that position's own prefix.

Cache layout. The sequences share one target cache whose columns are common and whose rows are not: `column_mask`
`(n, T)` says which columns hold a real token of each sequence. Left padding, rejected drafts and block padding are
holes: they stay in the cache, masked out of every later attention (`column_mask` is the 2D `attention_mask`), and
`position_ids` count real tokens only, so each sequence attends to exactly its own prefix at its own positions, as in
plain `generate`. Holes grow by at most `k` columns a round; once they pass `column_slack` columns beyond the longest
sequence, the cache is compacted (each sequence's real columns gathered to the right, left-padded). A sequence leaves
the batch (and the cache) as soon as it ends (EOS or `max_length`); its output is padded with `pad_token_id` like plain
`generate`'s.

Per sequence, the drafter reads the batch-1 context (`context_state.read_context`, given the column mask): the
global summary absorbs only its real rows, its recent window is gathered from its own last `W` real rows, and its
boundary state is the target's hidden states at its last accepted position.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from ..context_state import DraftContext, gather_columns, last_real_columns
from ..modeling_longspark import LongSparkDrafterModel
from ..transformers_private import pad_token_tensor
from .batched_checks import (
    check_batched_generation,
    check_default_position_ids,
    column_slack,
    default_position_ids,
    max_cache_columns,
)
from .drafting import DraftRequests, DraftSettings
from .planning import RoundPlanner
from .processors import process_logits
from .sampling import sample_from
from .session import DraftSession

# --- acceptance rules -------------------------------------------------------------------------------------------


def greedy_acceptance(
    drafted: torch.LongTensor, target_logits: torch.Tensor, num_drafted: torch.LongTensor
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Keeps each sequence's drafts while they equal the target's argmax.

    Args:
        drafted: `(n, k)` drafts; row `r` proposed `num_drafted[r]` of them. target_logits: `(n, k + 1, V)`, processed.

    Returns:
        `(num_accepted, next_tokens)`, both `(n,)`: drafts kept, and the target's token after them.
    """
    target_tokens = target_logits.argmax(dim=-1)
    steps = torch.arange(drafted.shape[1], device=drafted.device)
    matches = (drafted == target_tokens[:, :-1]) & (steps < num_drafted[:, None])
    num_accepted = matches.long().cumprod(dim=1).sum(dim=1)
    return num_accepted, target_tokens.gather(1, num_accepted[:, None])[:, 0]


def speculative_sampling(
    drafted: torch.LongTensor, draft_logits: torch.Tensor, target_logits: torch.Tensor, num_drafted: torch.LongTensor
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Speculative sampling per sequence: accept `y_i` with probability `min(1, p_i(y_i) / q_i(y_i))` in order; at the
    first rejection sample from `norm(max(p_i - q_i, 0))`, else a bonus token from `p_{k+1}`.

    Args:
        drafted: `(n, k)`; draft_logits: `(n, k, V)` the processed logits each draft was sampled from; target_logits:
            `(n, k + 1, V)` processed; num_drafted: `(n,)` drafts of each row (later columns are ignored).

    Returns:
        `(num_accepted, next_tokens)`, both `(n,)`.
    """
    p = target_logits.softmax(dim=-1)
    num_rows, k = drafted.shape
    if k == 0:
        return num_drafted.clone(), sample_from(p[:, 0])
    q = draft_logits.softmax(dim=-1)
    p_drafted = p[:, :k].gather(-1, drafted[..., None])[..., 0]
    q_drafted = q.gather(-1, drafted[..., None])[..., 0]
    steps = torch.arange(k, device=drafted.device)
    accepted = (torch.rand_like(p_drafted) <= p_drafted / q_drafted) & (steps < num_drafted[:, None])
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(num_rows, device=drafted.device)
    p_next = p[rows, num_accepted]
    residual = (p_next - q[rows, num_accepted.clamp(max=k - 1)]).clamp(min=0.0)
    rejected = (num_accepted < num_drafted)[:, None] & (residual.sum(dim=-1, keepdim=True) > 0)
    # `sample_from` normalises the residual itself.
    return num_accepted, sample_from(torch.where(rejected, residual, p_next))


# --- the decoding loop ------------------------------------------------------------------------------------------


class BatchedSpeculativeDecoder:
    """One batched `generate` call. Row `r` of every per-row tensor is the unfinished sequence `row_ids[r]`.

    Attributes:
        sequences: `(batch, max_length + B + 1)` every sequence's tokens (left-padded prompt, then new tokens) and
            room for a block, finished sequences included (the logits processors see the whole batch).
        lengths: `(n,)` tokens of `sequences[row_ids]`; the last one is the anchor `a`, not yet cached.
        column_mask: `(n, T)` bool, which cache columns hold the sequence's real tokens.
        positions: `(n,)` real tokens cached (= position of the anchor).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: LongSparkDrafterModel,
        input_ids: torch.LongTensor,
        cache: Cache,
        generation_config: GenerationConfig,
        settings: DraftSettings,
    ):
        self.session = DraftSession.for_generate(target, drafter, input_ids, settings)
        self.settings, self.stats = settings, self.session.stats
        # The most tokens a round proposes (the drafter's block, or a longer lookup continuation).
        self.block_size = self.settings.max_proposal_tokens
        self.target, self.cache = target, cache
        pad = pad_token_tensor(generation_config)
        self.pad_token_id = int(pad) if pad is not None else 0  # no pad: every sequence reaches max_length
        self.max_length = generation_config.max_length
        self.state = self.session.new_state()
        batch_size, prompt_length = input_ids.shape
        self.batch_size, self.prompt_length = batch_size, prompt_length
        self.row_ids = torch.arange(batch_size, device=input_ids.device)
        self.sequences = input_ids.new_full((batch_size, self.max_length + self.block_size + 1), self.pad_token_id)
        self.sequences[:, :prompt_length] = input_ids
        self.lengths = torch.full((batch_size,), prompt_length, dtype=torch.long, device=input_ids.device)
        self.column_mask = self.positions = None
        self.planners: list[RoundPlanner] = []  # per row: its source choice and lookup index (set at prefill)
        self.ended_lengths: dict[int, int] = {}

    @torch.no_grad()
    def run(self, attention_mask: torch.Tensor | None) -> torch.LongTensor:
        """Decodes every sequence to its end; returns `(batch, prompt + longest new)`, padded like `generate`."""
        try:
            self.prefill(attention_mask)
            while len(self.row_ids) > 0:
                self.round()
        finally:
            self.session.close()
        return self.outputs()

    def prefill(self, attention_mask: torch.Tensor | None) -> None:
        """The prompts' forward, exactly as plain `generate` runs it, and each sequence's first new token."""
        input_ids = self.sequences[:, : self.prompt_length]
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if not mask[:, -1].all():
            raise ValueError(
                "Batched LongSpark decoding needs left-padded prompts (a row of attention_mask ends with 0); pad on "
                "the left, e.g. `tokenizer.padding_side = 'left'`."
            )
        outputs = self.target(
            input_ids=input_ids,
            attention_mask=None if mask.all() else mask.long(),
            position_ids=default_position_ids(mask),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = outputs.logits[:, -1].float()
        logits = process_logits(self.settings.logits_processor, self.sequences, self.row_ids, self.lengths, logits)
        probs = logits.softmax(dim=-1)
        sample = self.settings.do_sample
        first = sample_from(probs)[:, None] if sample else probs.argmax(dim=-1, keepdim=True)
        self.column_mask, self.positions = mask, mask.sum(dim=1)
        # each row's tokens start after its left padding
        self.planners = [self.session.new_planner(offset) for offset in (~mask).sum(dim=1).tolist()]
        self.state.boundary_states = self.session.captured_boundary(torch.full_like(self.lengths, -1))
        self.commit(first, torch.ones_like(self.lengths))

    def round(self) -> None:
        """Drafts, verifies and accepts one block for every unfinished sequence."""
        room = (self.max_length - self.lengths - 1).clamp(min=0, max=self.block_size)
        requests = DraftRequests(self.sequences, self.row_ids, self.lengths, room)
        proposal = self.session.draft_round(requests, self.planners, self.read_context)
        drafted, num_drafted = proposal.tokens, proposal.num_drafted

        target_logits = self.verify(drafted, num_drafted)
        if self.settings.do_sample:
            num_accepted, next_tokens = speculative_sampling(drafted, proposal.logits, target_logits, num_drafted)
        else:
            num_accepted, next_tokens = greedy_acceptance(drafted, target_logits, num_drafted)
        self.session.record_accepted(proposal, num_accepted.tolist(), self.planners)
        steps = torch.arange(drafted.shape[1] + 1, device=drafted.device)
        self.column_mask = torch.cat([self.column_mask[:, : -len(steps)], steps <= num_accepted[:, None]], dim=1)
        self.positions = self.positions + num_accepted + 1
        self.state.boundary_states = self.session.captured_boundary(num_accepted)
        padded = torch.cat([drafted, next_tokens[:, None]], dim=1)
        new_tokens = torch.where(steps < num_accepted[:, None], padded, next_tokens[:, None])
        self.commit(new_tokens, num_accepted + 1)

    def read_context(self) -> DraftContext:
        """A drafter round's context: absorbs the rows cached since the last one (plain rounds leave no holes)."""
        context = self.session.read_context(self.state, self.cache, self.column_mask.shape[1], self.column_mask)
        self.compact_if_sparse()
        return context

    def verify(self, drafted: torch.LongTensor, num_drafted: torch.LongTensor) -> torch.Tensor:
        """One target forward over each sequence's `[a, y_1, ..., y_k]`; returns the `(n, k + 1, V)` logits after the
        logits processors (position `i` sees the sequence and its first `i` drafts). Leaves the block's columns in
        `column_mask` as real up to each sequence's last draft."""
        steps = torch.arange(drafted.shape[1] + 1, device=drafted.device)
        block = torch.cat([self.sequences[self.row_ids, self.lengths - 1][:, None], drafted], dim=1)
        self.column_mask = torch.cat([self.column_mask, steps <= num_drafted[:, None]], dim=1)
        position_ids = self.positions[:, None] + steps
        outputs = self.target(
            input_ids=block,
            attention_mask=self.column_mask,
            position_ids=position_ids,
            cache=self.cache,
            use_cache=True,
        )
        logits = outputs.logits.float()
        processor = self.settings.logits_processor
        for i in range(len(steps)):
            logits[:, i] = process_logits(processor, self.sequences, self.row_ids, self.lengths + i, logits[:, i])
        return logits

    def commit(self, new_tokens: torch.LongTensor, count: torch.LongTensor) -> None:
        """Appends each sequence's first `count[r]` of `new_tokens` `(n, m)`, cut after an EOS and at `max_length`,
        then lets the sequences that ended leave the batch."""
        steps = torch.arange(new_tokens.shape[1], device=new_tokens.device)
        keep = torch.minimum(count, self.max_length - self.lengths)
        ended = self.lengths + keep >= self.max_length
        eos_token_ids = self.settings.eos_token_ids
        if eos_token_ids is not None:
            is_eos = torch.isin(new_tokens, eos_token_ids.to(new_tokens.device)) & (steps < keep[:, None])
            has_eos = is_eos.any(dim=1)
            keep = torch.where(has_eos, is_eos.long().argmax(dim=1) + 1, keep)
            ended |= has_eos
        self.sequences[self.row_ids[:, None], self.lengths[:, None] + steps] = new_tokens
        self.lengths = self.lengths + keep
        if ended.any():
            self.drop(ended)

    def drop(self, ended: torch.BoolTensor) -> None:
        """Records the ended sequences' lengths and removes their rows from the per-row tensors, cache and state."""
        for row in ended.nonzero()[:, 0].tolist():
            self.ended_lengths[int(self.row_ids[row])] = int(self.lengths[row])
        keep = (~ended).nonzero()[:, 0]
        self.row_ids, self.lengths = self.row_ids[keep], self.lengths[keep]
        self.column_mask, self.positions = self.column_mask[keep], self.positions[keep]
        if len(keep) > 0:
            self.cache.batch_select_indices(keep)
            self.state.select(keep)
            self.planners = [self.planners[row] for row in keep.tolist()]

    def compact_if_sparse(self) -> None:
        """Gathers each sequence's real cache columns to the right once the holes exceed `column_slack`. Runs right
        after `DraftSession.read_context`, so every column is already in the summaries."""
        longest = int(self.positions.max())
        if self.column_mask.shape[1] - longest <= column_slack(longest, self.block_size):
            return
        index, self.column_mask = last_real_columns(self.column_mask, longest)
        for layer in self.cache.layers:
            layer.keys, layer.values = gather_columns(layer.keys, index), gather_columns(layer.values, index)
            if hasattr(layer, "cumulative_length"):
                # A sliding-window layer (whose window the batch never reaches, `check_batched_generation`) counts
                # the columns it has seen for its masks: now the compacted ones.
                layer.cumulative_length = layer.keys.shape[-2]
        self.state.num_absorbed = longest

    def outputs(self) -> torch.LongTensor:
        """`(batch, prompt + longest new)`: each sequence, padded with `pad_token_id` after its end."""
        lengths = torch.tensor([self.ended_lengths[row] for row in range(self.batch_size)], device=self.lengths.device)
        output = self.sequences[:, : int(lengths.max())].clone()
        output[torch.arange(output.shape[1], device=output.device) >= lengths[:, None]] = self.pad_token_id
        return output


def batched_speculative_decoding(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer: Any = None,
    assistant_model: LongSparkDrafterModel | None = None,
    *,
    settings: DraftSettings,
    **model_kwargs,
) -> torch.LongTensor:
    """`GenerationMixin._assisted_decoding` for a batch and a LongSpark drafter (same arguments, same outputs), plus
    the call's `settings` (`DraftSettings.for_generate`, built once by `generation._assisted_decoding`).

    Returns `(batch, prompt + new)` sequences, each padded with `pad_token_id` after its EOS.
    """
    block_size = settings.max_proposal_tokens
    check_batched_generation(
        model, generation_config, logits_processor, stopping_criteria, streamer, synced_gpus, model_kwargs, block_size
    )
    # `generate` accepts inputs on the CPU for a model elsewhere; this loop calls the model directly.
    input_ids = input_ids.to(model.device)
    attention_mask = model_kwargs.get("attention_mask")
    attention_mask = None if attention_mask is None else attention_mask.to(model.device)
    check_default_position_ids(model_kwargs.get("position_ids"), input_ids, attention_mask)
    cache = model_kwargs["cache"]
    decoder = BatchedSpeculativeDecoder(model, assistant_model, input_ids, cache, generation_config, settings)
    return decoder.run(attention_mask)


__all__ = [
    "BatchedSpeculativeDecoder",
    "batched_speculative_decoding",
    "check_batched_generation",
    "default_position_ids",
    "column_slack",
    "greedy_acceptance",
    "max_cache_columns",
    "speculative_sampling",
]
