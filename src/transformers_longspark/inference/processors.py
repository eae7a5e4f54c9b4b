"""`generate`'s logits processors on drafted positions: which read the scores alone (`SCORE_ONLY_PROCESSORS`, applied
to all requests at once; `DRAFT_VOCAB_PROCESSORS` give the same law on a draft vocabulary's own logits), and
`process_logits`, which applies a batch's processors to the next-token logits of some of its requests as plain
`generate` would.
"""

from __future__ import annotations

import torch
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

# Processors that read the scores alone, never the sequence: applied to all requests at once, whatever their lengths.
SCORE_ONLY_PROCESSORS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    SuppressTokensLogitsProcessor,
)


# Score-only processors that give the same distribution over the tokens a draft vocabulary holds whether they see only
# those tokens or the whole target vocabulary with the rest at -inf (temperature, the top-k / top-p / min-p cuts):
# drafts under them are drawn among the draft vocabulary's own logits (`draft_tokens`).
DRAFT_VOCAB_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


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


__all__ = ["DRAFT_VOCAB_PROCESSORS", "SCORE_ONLY_PROCESSORS", "process_logits"]
