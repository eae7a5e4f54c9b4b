"""One drafting round for `n` requests, shared by transformers' batch-1 loop (`generation.py`) and the batched loop
(`batched.py`): read each request's context views from the target cache (`read_draft_context`), then draft its block
with one drafter forward (`draft_tokens`), applying `generate`'s logits processors as plain `generate` would
(`process_logits`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from ..context_state import DraftContext, LongSparkContextState, gather_columns, last_real_columns
from ..modeling_longspark import LongSparkDrafterModel
from ..targets import read_cache_rows
from .lookup import SuffixIndex, point_mass_logits


def read_draft_context(
    drafter: LongSparkDrafterModel,
    state: LongSparkContextState,
    cache: Cache,
    num_columns: int,
    column_mask: torch.BoolTensor | None = None,
) -> DraftContext:
    """Absorbs the cache columns added since the last round into the summary and gathers this round's context views.

    Args:
        drafter: the drafter (its config and summary queries).
        state: the requests' persistent state; its `boundary_states` must already be set for this round.
        cache: the target cache, `num_columns` columns long.
        column_mask: `(N, num_columns)` bool, True where a column holds a real row of request `n` (False for left
            padding and rejected drafts). `None`: one request whose columns are all real; its window is then a view of
            the cache tail (no copy). With a mask, each request's window is gathered from its own last real rows.
    """
    config = drafter.config
    new_rows = num_columns - state.num_absorbed
    use_summary = config.use_global_summary and not config.full_prefix_context
    use_window = config.use_recent_window or config.full_prefix_context
    device = state.boundary_states.device
    if column_mask is None:
        window_rows = num_columns if config.full_prefix_context else min(config.window_size, num_columns)
        rows_to_read = max(new_rows if use_summary else 0, window_rows)
        window_index = window_mask = new_mask = None
        positions = torch.tensor([num_columns], device=device)
    else:
        positions = column_mask.sum(dim=1)
        longest = int(positions.max())
        window_rows = longest if config.full_prefix_context else min(config.window_size, longest)
        rows_to_read = num_columns
        window_index, window_mask = last_real_columns(column_mask, window_rows)
        new_mask = column_mask[:, num_columns - new_rows :]
    window_keys, window_values = [], []
    for j, layer_id in enumerate(config.target_layer_ids):
        keys, values = read_cache_rows(cache, layer_id, rows_to_read)
        if use_summary and new_rows > 0:
            queries = drafter.summary_queries[j]
            state.absorb(j, queries, keys[:, :, -new_rows:], values[:, :, -new_rows:], new_mask)
        if use_window and window_index is None:
            window_keys.append(keys[:, :, -window_rows:])
            window_values.append(values[:, :, -window_rows:])
        elif use_window:
            window_keys.append(gather_columns(keys, window_index))
            window_values.append(gather_columns(values, window_index))
    state.num_absorbed = num_columns
    return DraftContext(
        boundary_states=state.boundary_states,
        window_keys=window_keys,
        window_values=window_values,
        window_mask=window_mask if use_window else None,
        summary_values=list(state.summaries) if use_summary else [],
        positions=positions,
    )


def drafting_thresholds(drafter: LongSparkDrafterModel) -> tuple[float, float]:
    """`(token, block)` confidence thresholds of the drafter's generation config (see `draft_tokens`): transformers'
    `assistant_confidence_threshold`, and LongSpark's `block_confidence_threshold` (0 where unset)."""
    config = drafter.generation_config
    return config.assistant_confidence_threshold or 0.0, getattr(config, "block_confidence_threshold", 0.0) or 0.0


# The longest suffix the lookup source matches: longer matches are rarer and add little over this one.
LOOKUP_MAX_NGRAM = 6


def lookup_settings(drafter: LongSparkDrafterModel) -> tuple[int, int]:
    """`(min_match, num_tokens)` of the lookup source, from the drafter's generation config (`propose_blocks`):
    `lookup_min_match` (0 or unset: off) and `lookup_num_tokens` (unset: the block size)."""
    config = drafter.generation_config
    min_match = getattr(config, "lookup_min_match", 0) or 0
    return min_match, getattr(config, "lookup_num_tokens", None) or drafter.config.block_size


def max_proposal_tokens(drafter: LongSparkDrafterModel) -> int:
    """The most tokens one round can propose: the block size, or the lookup continuation's length if longer."""
    min_match, num_tokens = lookup_settings(drafter)
    return max(drafter.config.block_size, num_tokens if min_match else 0)


def new_lookup(drafter: LongSparkDrafterModel, offset: int = 0) -> SuffixIndex | None:
    """An empty `SuffixIndex` for one request (its tokens start at column `offset`), or `None` when lookup is off."""
    min_match, _ = lookup_settings(drafter)
    return SuffixIndex(min_match, max(min_match, LOOKUP_MAX_NGRAM), offset) if min_match else None


# Processors that read the scores alone, never the sequence: applied to all requests at once, whatever their lengths.
SCORE_ONLY_PROCESSORS = (
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
    EpsilonLogitsWarper, EtaLogitsWarper, InfNanRemoveLogitsProcessor, SuppressTokensLogitsProcessor,
)  # fmt: skip


def process_logits(
    logits_processor: LogitsProcessorList | None,
    sequences: torch.LongTensor,
    rows: torch.LongTensor,
    lengths: torch.LongTensor,
    logits: torch.Tensor,
) -> torch.Tensor:
    """Applies `generate`'s logits processors to the next-token logits `(n, V)` of `n` requests of a batch.

    Args:
        sequences: `(batch, S)` every sequence of the batch, finished ones included; request `r` is batch row
            `rows[r]` and its sequence so far `sequences[rows[r], :lengths[r]]`, as plain `generate` would pass it
            (left padding included).
        rows / lengths: `(n,)`; `rows` are distinct.

    A processor sees the whole batch in its order, as in plain `generate`: some keep per-row state (repetition
    penalty skips each row's left padding). When the requests' lengths differ (a batch whose sequences accepted
    different numbers of drafts), each length gets its own call, and only the rows of that length are kept from it;
    processors that read the scores alone (`SCORE_ONLY_PROCESSORS`) run once for all.
    """
    if not logits_processor:
        return logits
    distinct = lengths.unique()
    if len(distinct) == 1 and len(rows) == len(sequences):  # the whole batch (rows are distinct), as in `generate`
        return logits_processor(sequences[:, : int(distinct[0])], logits)
    for processor in logits_processor:
        if isinstance(processor, SCORE_ONLY_PROCESSORS):
            logits = processor(sequences[rows, : int(distinct[0])], logits)
            continue
        processed = torch.empty_like(logits)
        for length in distinct.tolist():
            group = (lengths == length).nonzero()[:, 0]
            batch_logits = logits.new_zeros(len(sequences), logits.shape[-1])
            batch_logits[rows[group]] = logits[group]
            processed[group] = processor(sequences[:, :length], batch_logits)[rows[group]]
        logits = processed
    return logits


@torch.no_grad()
def draft_tokens(
    drafter: LongSparkDrafterModel,
    context: DraftContext,
    sequences: torch.LongTensor,
    rows: torch.LongTensor,
    lengths: torch.LongTensor,
    max_tokens: torch.LongTensor,
    logits_processor: LogitsProcessorList | None,
    do_sample: bool,
    confidence_threshold: float,
    eos_token_ids: torch.Tensor | None,
    block_confidence_threshold: float = 0.0,
) -> tuple[torch.LongTensor, torch.Tensor, torch.LongTensor]:
    """One drafter forward over the blocks `[a, MASK, ...]` of `n` requests, then the Markov correction and the
    logits processors token by token, sampling (or taking the argmax of) exactly the distributions returned.

    A request's block ends after `max_tokens[r]` tokens, after an EOS, and before the first position `i > 1` whose
    confidence, the largest probability of its draft distribution `q_i`, is below `confidence_threshold`, or at which
    the product of the block's probabilities so far (drawn tokens `q_1(y_1) ... q_{i-1}(y_{i-1})`, times `q_i`'s
    confidence: an estimate of the chance that the whole block is accepted) falls below `block_confidence_threshold`
    (dynamic block length: each verified token costs a share of a target step, which unlikely tokens do not repay).

    The cuts keep sampling exact: whether position `i` is proposed is decided from `q_i` and the tokens drawn before
    it, never from `y_i` itself, so a proposed `y_i` is distributed as `q_i`, the law handed to the verifier. (Cutting
    on `q_i(y_i)` would propose `q_i` restricted to the tokens that pass, and bias the output.) In greedy decoding the
    drawn token is the argmax, so both rules cut at the same place.

    Args:
        sequences: `(batch, S)` tokens of the whole batch; request `r`'s are `sequences[rows[r], :lengths[r]]`, the
            last one its anchor `a`. Its drafts are written in place after them (the processors read them), so
            `S >= lengths + max_tokens`.
        rows / lengths / max_tokens: `(n,)` batch row, length and most tokens to draft of each request.

    Returns:
        `(tokens, logits, num_drafted)`: `(n, k)` drafted tokens, their `(n, k, vocab_size)` processed logits and the
        `(n,)` number kept per request; columns past `num_drafted[r]` are to be ignored.
    """
    device = sequences.device
    previous = sequences[rows, lengths - 1]
    masks = previous.new_full((len(rows), drafter.config.block_size - 1), drafter.config.mask_token_id)
    base_logits = drafter(torch.cat([previous[:, None], masks], dim=1), context).base_logits
    # Without processors, tokens are chosen among the draft vocabulary's own logits: every other token is -inf in the
    # target vocabulary, so the distribution is the same, at a fraction of the cost; target-vocabulary logits are
    # built once at the end. Processors read target-vocabulary logits (and the sequence), so they get them per token.
    in_draft_vocab = not logits_processor
    drafting = max_tokens > 0
    num_drafted = torch.zeros_like(lengths)
    drafted_ids, drafted_logits = [], []
    block_probability = torch.ones(len(rows), device=device)  # the product of the block's draft probabilities so far
    for i in range(int(max_tokens.max())):
        drafting &= i < max_tokens
        if not drafting.any():
            break
        logits = base_logits[:, i] + drafter.markov_correction(previous).float()
        if not in_draft_vocab:
            logits = process_logits(logits_processor, sequences, rows, lengths + i, drafter.to_target_vocab(logits))
        probs = torch.softmax(logits, dim=-1)
        if i > 0:  # decided before drawing y_i (see the docstring): the cut must not depend on the token it drops
            confidence = probs.max(dim=-1).values
            drafting &= confidence >= confidence_threshold
            drafting &= block_probability * confidence >= block_confidence_threshold
        choice = torch.multinomial(probs, num_samples=1)[:, 0] if do_sample else probs.argmax(dim=-1)
        token = drafter.to_target_ids(choice) if in_draft_vocab else choice
        block_probability = block_probability * probs.gather(-1, choice[:, None])[:, 0]
        num_drafted += drafting
        sequences[rows, lengths + i] = token
        drafted_ids.append(token)
        drafted_logits.append(logits)
        # Tokens after an EOS can never be kept, so the block ends there.
        if eos_token_ids is not None:
            drafting &= ~torch.isin(token, eos_token_ids.to(device))
        previous = token
    if not drafted_ids:
        vocab_size = drafter.config.vocab_size
        return sequences.new_zeros(len(rows), 0), base_logits.new_zeros(len(rows), 0, vocab_size), num_drafted
    logits = torch.stack(drafted_logits, dim=1)
    return torch.stack(drafted_ids, dim=1), drafter.to_target_vocab(logits) if in_draft_vocab else logits, num_drafted


@torch.no_grad()
def propose_blocks(
    drafter: LongSparkDrafterModel,
    context: DraftContext,
    sequences: torch.LongTensor,
    rows: torch.LongTensor,
    lengths: torch.LongTensor,
    room: torch.LongTensor,
    lookups: list[SuffixIndex] | None,
    draft_kwargs: dict[str, Any],
) -> tuple[torch.LongTensor, torch.Tensor, torch.LongTensor, torch.BoolTensor]:
    """This round's proposal for `n` requests: the lookup source's continuation where the request's suffix occurred
    before (`lookup.py`), the drafter's block elsewhere (one forward for those requests, `draft_tokens`).

    Args:
        sequences / rows / lengths: as in `draft_tokens`; `room`: `(n,)` most tokens each request may be proposed.
        lookups: per request, its `SuffixIndex` (extended here with the request's tokens since the last round), or
            `None` when lookup is off. A request takes its lookup continuation when the matched suffix has at least
            `lookup_min_match` tokens: `lookup_num_tokens` tokens at no drafter cost, proposed with the point-mass law
            (one-hot logits), which is exactly how they were chosen.
        draft_kwargs: `draft_tokens`' remaining arguments (logits processors, sampling, thresholds, EOS ids).

    Returns:
        `(tokens, logits, num_drafted, from_lookup)`: as `draft_tokens` returns them, and `(n,)` which requests
        took the lookup continuation.
    """
    n, device = len(rows), sequences.device
    drafter_rows = list(range(n))
    proposals: dict[int, list[int]] = {}
    if lookups is not None:
        min_match, num_tokens = lookup_settings(drafter)
        for r, index in enumerate(lookups):
            index.extend(sequences[rows[r], index.offset + len(index) : int(lengths[r])].tolist())
            continuation, matched = index.propose(min(num_tokens, int(room[r])))
            if matched >= min_match and continuation:
                proposals[r] = continuation
        drafter_rows = [r for r in range(n) if r not in proposals]
    vocab_size = drafter.config.vocab_size
    width = max((len(c) for c in proposals.values()), default=0)
    tokens, logits, num_drafted = sequences.new_zeros(n, 0), torch.zeros(n, 0, vocab_size, device=device), None
    if drafter_rows:
        index = torch.tensor(drafter_rows, device=device)
        max_tokens = room[index].clamp(max=drafter.config.block_size)
        drafted = draft_tokens(drafter, context if len(index) == n else context.select(index), sequences, rows[index],
                               lengths[index], max_tokens, **draft_kwargs)  # fmt: skip
        if len(index) == n:
            tokens, logits, num_drafted = drafted
        else:
            width = max(width, drafted[0].shape[1])
            tokens, logits = sequences.new_zeros(n, width), drafted[1].new_zeros(n, width, vocab_size)
            num_drafted = lengths.new_zeros(n)
            tokens[index, : drafted[0].shape[1]], logits[index, : drafted[0].shape[1]] = drafted[0], drafted[1]
            num_drafted[index] = drafted[2]
    from_lookup = torch.zeros(n, dtype=torch.bool, device=device)
    if proposals:
        if num_drafted is None or tokens.shape[1] < width:
            tokens = F.pad(tokens, (0, width - tokens.shape[1]))
            logits = F.pad(logits, (0, 0, 0, width - logits.shape[1]))
            num_drafted = lengths.new_zeros(n) if num_drafted is None else num_drafted
        for r, continuation in proposals.items():
            ids = torch.tensor(continuation, device=device)
            tokens[r, : len(ids)], logits[r, : len(ids)] = ids, point_mass_logits(ids, vocab_size)
            num_drafted[r], from_lookup[r] = len(ids), True
            sequences[rows[r], lengths[r] : lengths[r] + len(ids)] = ids  # the logits processors read the drafts
    return tokens, logits, num_drafted, from_lookup


__all__ = [
    "SCORE_ONLY_PROCESSORS",
    "draft_tokens",
    "drafting_thresholds",
    "lookup_settings",
    "max_proposal_tokens",
    "new_lookup",
    "process_logits",
    "propose_blocks",
    "read_draft_context",
]
