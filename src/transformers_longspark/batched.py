"""Batched LongSpark speculative decoding: `target.generate(input_ids, attention_mask=..., assistant_model=drafter)`
with more than one (left-padded) prompt.

transformers' assisted decoding is batch-1, so the generation hook (`generation.py`) routes batches here; batch 1
keeps transformers' own loop. A round serves the `n` unfinished sequences with ONE drafter forward over their `n`
blocks (`drafting.draft_tokens`) and ONE target forward over each sequence's `[a, y_1, ..., y_k]` (`k` the longest
block, shorter ones padded), then applies the acceptance rule per sequence (SPEC section 1): greedy keeps the longest
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

Per sequence, the drafter reads the batch-1 context (`drafting.read_draft_context`, given the column mask): the global
summary absorbs only its real rows, its recent window is gathered from its own last `W` real rows, and its boundary
state is the target's hidden states at its last accepted position.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    PrefixConstrainedLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from .context_state import LongSparkContextState, gather_columns, last_real_columns
from .drafting import (
    DraftingStats,
    drafting_thresholds,
    max_proposal_tokens,
    new_lookup,
    process_logits,
    propose_blocks,
    read_draft_context,
)
from .lookup import SuffixIndex
from .modeling_longspark import LongSparkDrafterModel
from .targets import HiddenStateCapture, check_sliding_window, check_target_compatible, sliding_window_layers

ONE_PER_PROMPT = "call generate() once per prompt"


def column_slack(num_rows: int, block_size: int) -> int:
    """Hole columns allowed beyond the longest sequence before the cache is compacted.

    A few rounds' worth, or an eighth of the prefix: a compaction copies the cache once, while every verification
    forward reads all of it, so compacting rarely costs less than the holes it removes."""
    return max(4 * (block_size + 1), num_rows // 8)


def max_cache_columns(max_length: int, block_size: int) -> int:
    """Most columns the shared cache can reach: the longest sequence, its slack of holes, one verification block."""
    return max_length + column_slack(max_length, block_size) + block_size + 1


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
        return num_drafted.clone(), torch.multinomial(p[:, 0], num_samples=1)[:, 0]
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
    # `multinomial` normalises the residual itself.
    return num_accepted, torch.multinomial(torch.where(rejected, residual, p_next), num_samples=1)[:, 0]


# --- settings that batched decoding cannot honour ---------------------------------------------------------------


# Model inputs the loop builds itself (`position_ids` only when they are generate's default, checked separately).
HANDLED_MODEL_KWARGS = {"attention_mask", "cache", "use_cache", "logits_to_keep", "position_ids"}
# Processors that keep state across steps or call user code on each row's prefix: the loop calls processors once per
# drafted and verified position, and on rows of other lengths whose outputs it then discards.
ONE_CALL_PER_STEP_PROCESSORS = (PrefixConstrainedLogitsProcessor, UnbatchedClassifierFreeGuidanceLogitsProcessor)


def check_batched_generation(
    target: PreTrainedModel,
    generation_config: GenerationConfig,
    logits_processor: LogitsProcessorList | None,
    stopping_criteria: StoppingCriteriaList,
    streamer: Any,
    synced_gpus: bool,
    model_kwargs: dict[str, Any],
    block_size: int,
) -> None:
    """Raises `ValueError`, before any token, for what batched LongSpark decoding does not support."""
    if streamer is not None:
        raise ValueError(f"Streaming is batch-1: {ONE_PER_PROMPT} to stream it, or drop `streamer` for a batch.")
    requested = [name for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
                 if getattr(generation_config, name, False)]  # fmt: skip
    if generation_config.return_dict_in_generate:
        returned = ", ".join(requested) or "past_key_values"
        raise ValueError(
            f"Batched LongSpark decoding returns the `sequences` tensor only, not {returned} (its cache drops each "
            f"sequence as it ends): drop return_dict_in_generate, or {ONE_PER_PROMPT}."
        )
    ignored = sorted(k for k, v in model_kwargs.items() if v is not None and k not in HANDLED_MODEL_KWARGS)
    if ignored:
        raise ValueError(
            f"Batched LongSpark decoding passes the target input_ids, attention_mask and position ids only; it "
            f"cannot pass {', '.join(ignored)}: {ONE_PER_PROMPT}."
        )
    if generation_config.prefill_chunk_size:
        raise ValueError(
            f"Batched LongSpark decoding prefills the prompts in one forward (prefill_chunk_size="
            f"{generation_config.prefill_chunk_size}): drop prefill_chunk_size, or {ONE_PER_PROMPT}."
        )
    stateful = [type(p).__name__ for p in logits_processor or [] if isinstance(p, ONE_CALL_PER_STEP_PROCESSORS)]
    if stateful:
        raise ValueError(
            f"Batched LongSpark decoding calls logits processors once per drafted position and on other sequences' "
            f"prefixes, which {', '.join(stateful)} cannot take: {ONE_PER_PROMPT}."
        )
    if synced_gpus:
        raise ValueError(f"Batched LongSpark decoding does not support `synced_gpus`; {ONE_PER_PROMPT}.")
    others = [type(c).__name__ for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    if others:
        raise ValueError(f"Batched LongSpark decoding stops each sequence at EOS or max_new_tokens only; "
                         f"{', '.join(others)} is not supported: {ONE_PER_PROMPT}.")  # fmt: skip
    cache = model_kwargs.get("cache")
    if cache is None or cache.get_seq_length() > 0:
        raise ValueError(f"Batched LongSpark decoding starts from an empty target cache; {ONE_PER_PROMPT} to continue "
                         "from a prefilled cache.")  # fmt: skip
    window, _ = sliding_window_layers(target.config)
    columns = max_cache_columns(generation_config.max_length, block_size)
    if window is not None and window < columns:
        raise ValueError(
            f"The target uses sliding-window attention ({window} columns), and the holes of a batched cache would "
            f"count toward its window; {ONE_PER_PROMPT}, or keep max_length (prompt + new tokens) well below {window}."
        )


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
        logits_processor: LogitsProcessorList | None,
    ):
        config = drafter.config
        check_target_compatible(config, target)
        check_sliding_window(target, config.target_layer_ids, input_ids.shape[1])
        drafter.bind_target(target)
        # The most tokens a round proposes (the drafter's block, or a longer lookup continuation).
        self.block_size = max_proposal_tokens(drafter)
        self.target, self.drafter, self.cache = target, drafter, cache
        self.logits_processor = logits_processor if logits_processor else None
        self.do_sample = bool(generation_config.do_sample)
        self.eos_token_ids = getattr(generation_config, "_eos_token_tensor", None)
        pad = getattr(generation_config, "_pad_token_tensor", None)
        self.pad_token_id = int(pad) if pad is not None else 0  # no pad: every sequence reaches max_length
        self.max_length = generation_config.max_length
        token_threshold, block_threshold = drafting_thresholds(drafter)
        self.draft_kwargs = dict(
            logits_processor=self.logits_processor, do_sample=self.do_sample, confidence_threshold=token_threshold,
            eos_token_ids=self.eos_token_ids, block_confidence_threshold=block_threshold,
        )  # fmt: skip
        self.capture = HiddenStateCapture(drafter.target.layers, config.target_layer_ids, keep=self.block_size + 1)
        self.state = LongSparkContextState(config.num_draft_layers, config.summary_chunk_size)
        self.stats = drafter.drafting_stats = DraftingStats()
        batch_size, prompt_length = input_ids.shape
        self.batch_size, self.prompt_length = batch_size, prompt_length
        self.row_ids = torch.arange(batch_size, device=input_ids.device)
        self.sequences = input_ids.new_full((batch_size, self.max_length + self.block_size + 1), self.pad_token_id)
        self.sequences[:, :prompt_length] = input_ids
        self.lengths = torch.full((batch_size,), prompt_length, dtype=torch.long, device=input_ids.device)
        self.column_mask = self.positions = None
        self.lookups: list[SuffixIndex] | None = None  # per row, with lookup on (set at prefill)
        self.ended_lengths: dict[int, int] = {}

    @torch.no_grad()
    def run(self, attention_mask: torch.Tensor | None) -> torch.LongTensor:
        """Decodes every sequence to its end; returns `(batch, prompt + longest new)`, padded like `generate`."""
        try:
            self.prefill(attention_mask)
            while len(self.row_ids) > 0:
                self.round()
        finally:
            self.capture.remove()
        return self.outputs()

    def prefill(self, attention_mask: torch.Tensor | None) -> None:
        """The prompts' forward, exactly as plain `generate` runs it, and each sequence's first new token."""
        input_ids = self.sequences[:, : self.prompt_length]
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if not mask[:, -1].all():
            raise ValueError("Batched LongSpark decoding needs left-padded prompts (a row of attention_mask ends with "
                             "0); pad on the left, e.g. `tokenizer.padding_side = 'left'`.")  # fmt: skip
        position_ids = default_position_ids(mask)
        outputs = self.target(
            input_ids=input_ids, attention_mask=None if mask.all() else mask.long(), position_ids=position_ids,
            cache=self.cache, use_cache=True, logits_to_keep=1,
        )  # fmt: skip
        logits = outputs.logits[:, -1].float()
        logits = process_logits(self.logits_processor, self.sequences, self.row_ids, self.lengths, logits)
        probs = logits.softmax(dim=-1)
        first = torch.multinomial(probs, num_samples=1) if self.do_sample else probs.argmax(dim=-1, keepdim=True)
        self.column_mask, self.positions = mask, mask.sum(dim=1)
        padding = (~mask).sum(dim=1).tolist()  # each row's tokens start after its left padding
        self.lookups = [new_lookup(self.drafter, offset) for offset in padding]
        self.lookups = None if self.lookups[0] is None else self.lookups
        self.state.boundary_states = self.boundary_states(torch.full_like(self.lengths, -1))
        self.commit(first, torch.ones_like(self.lengths))

    def round(self) -> None:
        """Drafts, verifies and accepts one block for every unfinished sequence."""
        start = time.perf_counter()
        context = read_draft_context(self.drafter, self.state, self.cache, self.column_mask.shape[1], self.column_mask)
        self.compact_if_sparse()
        drafting = time.perf_counter()
        room = (self.max_length - self.lengths - 1).clamp(min=0, max=self.block_size)
        drafted, draft_logits, num_drafted, from_lookup = propose_blocks(
            self.drafter, context, self.sequences, self.row_ids, self.lengths, room, self.lookups, self.draft_kwargs
        )
        self.stats.lookup_rounds += int(from_lookup.sum())
        self.stats.context_update_seconds += drafting - start
        self.stats.proposal_seconds += time.perf_counter() - drafting
        self.stats.rounds += len(self.row_ids)
        self.stats.batch_rounds += 1
        self.stats.drafted_tokens += int(num_drafted.sum())
        self.stats.context_state_bytes = self.state.nbytes

        target_logits = self.verify(drafted, num_drafted)
        if self.do_sample:
            num_accepted, next_tokens = speculative_sampling(drafted, draft_logits, target_logits, num_drafted)
        else:
            num_accepted, next_tokens = greedy_acceptance(drafted, target_logits, num_drafted)
        self.stats.record_accepted(num_accepted.tolist())
        steps = torch.arange(drafted.shape[1] + 1, device=drafted.device)
        self.column_mask = torch.cat([self.column_mask[:, : -len(steps)], steps <= num_accepted[:, None]], dim=1)
        self.positions = self.positions + num_accepted + 1
        self.state.boundary_states = self.boundary_states(num_accepted)
        padded = torch.cat([drafted, next_tokens[:, None]], dim=1)
        new_tokens = torch.where(steps < num_accepted[:, None], padded, next_tokens[:, None])
        self.commit(new_tokens, num_accepted + 1)

    def verify(self, drafted: torch.LongTensor, num_drafted: torch.LongTensor) -> torch.Tensor:
        """One target forward over each sequence's `[a, y_1, ..., y_k]`; returns the `(n, k + 1, V)` logits after the
        logits processors (position `i` sees the sequence and its first `i` drafts). Leaves the block's columns in
        `column_mask` as real up to each sequence's last draft."""
        steps = torch.arange(drafted.shape[1] + 1, device=drafted.device)
        block = torch.cat([self.sequences[self.row_ids, self.lengths - 1][:, None], drafted], dim=1)
        self.column_mask = torch.cat([self.column_mask, steps <= num_drafted[:, None]], dim=1)
        position_ids = self.positions[:, None] + steps
        outputs = self.target(input_ids=block, attention_mask=self.column_mask, position_ids=position_ids,
                              cache=self.cache, use_cache=True)  # fmt: skip
        logits = outputs.logits.float()
        for i in range(len(steps)):
            logits[:, i] = process_logits(
                self.logits_processor, self.sequences, self.row_ids, self.lengths + i, logits[:, i]
            )
        return logits

    def boundary_states(self, index: torch.LongTensor) -> torch.Tensor:
        """`(n, D * hidden_size)`: the selected layers' states at block position `index[r]` of the last forward."""
        rows = torch.arange(len(index), device=index.device)
        return torch.cat([states[rows, index] for states in self.capture.states], dim=-1)

    def commit(self, new_tokens: torch.LongTensor, count: torch.LongTensor) -> None:
        """Appends each sequence's first `count[r]` of `new_tokens` `(n, m)`, cut after an EOS and at `max_length`,
        then lets the sequences that ended leave the batch."""
        steps = torch.arange(new_tokens.shape[1], device=new_tokens.device)
        keep = torch.minimum(count, self.max_length - self.lengths)
        ended = self.lengths + keep >= self.max_length
        if self.eos_token_ids is not None:
            is_eos = torch.isin(new_tokens, self.eos_token_ids.to(new_tokens.device)) & (steps < keep[:, None])
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
            if self.lookups is not None:
                self.lookups = [self.lookups[row] for row in keep.tolist()]

    def compact_if_sparse(self) -> None:
        """Gathers each sequence's real cache columns to the right once the holes exceed `column_slack`. Runs right
        after `read_draft_context`, so every column is already in the summaries."""
        longest = int(self.positions.max())
        if self.column_mask.shape[1] - longest <= column_slack(longest, self.block_size):
            return
        index, self.column_mask = last_real_columns(self.column_mask, longest)
        for layer in self.cache.layers:
            layer.keys, layer.values = gather_columns(layer.keys, index), gather_columns(layer.values, index)
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
    **model_kwargs,
) -> torch.LongTensor:
    """`GenerationMixin._assisted_decoding` for a batch and a LongSpark drafter (same arguments, same outputs).

    Returns `(batch, prompt + new)` sequences, each padded with `pad_token_id` after its EOS.
    """
    block_size = max_proposal_tokens(assistant_model)
    check_batched_generation(
        model, generation_config, logits_processor, stopping_criteria, streamer, synced_gpus, model_kwargs, block_size
    )
    # `generate` accepts inputs on the CPU for a model elsewhere; this loop calls the model directly.
    input_ids = input_ids.to(model.device)
    attention_mask = model_kwargs.get("attention_mask")
    attention_mask = None if attention_mask is None else attention_mask.to(model.device)
    check_default_position_ids(model_kwargs.get("position_ids"), input_ids, attention_mask)
    cache = model_kwargs["cache"]
    decoder = BatchedSpeculativeDecoder(model, assistant_model, input_ids, cache, generation_config, logits_processor)
    return decoder.run(attention_mask)


def default_position_ids(attention_mask: torch.Tensor) -> torch.LongTensor:
    """`(batch, S)` positions counting each left-padded row's real tokens (0 on padding), as `generate` builds them."""
    mask = attention_mask.bool()
    return (mask.long().cumsum(dim=1) - 1).masked_fill(~mask, 0)


def check_default_position_ids(
    position_ids: torch.Tensor | None, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None
) -> None:
    """Refuses `position_ids` other than `generate`'s default: the loop numbers each sequence's real tokens itself."""
    if position_ids is None:
        return
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    expected = default_position_ids(mask)
    if position_ids.shape != expected.shape or not torch.equal(position_ids.to(expected.device)[mask], expected[mask]):
        raise ValueError(
            f"Batched LongSpark decoding numbers each sequence's real tokens from 0 and cannot take other "
            f"position_ids: drop position_ids, or {ONE_PER_PROMPT}."
        )


__all__ = [
    "BatchedSpeculativeDecoder",
    "batched_speculative_decoding",
    "check_batched_generation",
    "column_slack",
    "greedy_acceptance",
    "max_cache_columns",
    "speculative_sampling",
]
