"""What batched LongSpark decoding (`batched.py`) cannot honour, refused before any token with the alternative named
(`generate` once per prompt), and the position ids it builds for left-padded prompts."""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.logits_process import (
    LogitsProcessorList,
    PrefixConstrainedLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from ..targets import sliding_window_layers

ONE_PER_PROMPT = "call generate() once per prompt"


def column_slack(num_rows: int, block_size: int) -> int:
    """Hole columns allowed beyond the longest sequence before the cache is compacted.

    A few rounds' worth, or an eighth of the prefix: a compaction copies the cache once, while every verification
    forward reads all of it, so compacting rarely costs less than the holes it removes."""
    return max(4 * (block_size + 1), num_rows // 8)


def max_cache_columns(max_length: int, block_size: int) -> int:
    """Most columns the shared cache can reach: the longest sequence, its slack of holes, one verification block."""
    return max_length + column_slack(max_length, block_size) + block_size + 1


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
    "ONE_PER_PROMPT",
    "check_batched_generation",
    "check_default_position_ids",
    "column_slack",
    "default_position_ids",
    "max_cache_columns",
]
