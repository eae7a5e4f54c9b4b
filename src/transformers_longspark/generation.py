"""`target.generate(..., assistant_model=drafter)` with a LongSpark drafter.

Routing: transformers picks a candidate generator in `GenerationMixin._get_candidate_generator`, which has no
registry for third-party drafters. `import transformers_longspark` wraps that method (and the assistant checks
of `_validate_generation_mode`) once: when `assistant_model` is a `LongSparkDrafterModel` the wrapper returns a
`LongSparkCandidateGenerator`, and for every other assistant and mode it calls the original unchanged. Assisted
decoding itself (verification, acceptance, cache cropping, streamers, outputs) is transformers' own loop; with a
LongSpark drafter it runs inside `verification.fast_verification` (`_assisted_decoding` is wrapped for that).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.utils import GenerationMixin

from .context_state import DraftContext, LongSparkContextState
from .modeling_longspark import LongSparkDrafterModel
from .targets import HiddenStateCapture, check_sliding_window, check_target_compatible, read_cache_rows
from .verification import fast_verification


@dataclass
class DraftingStats:
    """Per-`generate` counters, kept on `drafter.drafting_stats` after each call.

    `tau = (new tokens - 1) / verification rounds`: the prefill forward yields the first token, then each round
    adds the accepted draft tokens plus one.
    """

    rounds: int = 0
    drafted_tokens: int = 0
    proposal_seconds: float = 0.0
    context_update_seconds: float = 0.0
    context_state_bytes: int = 0


class LongSparkCandidateGenerator(CandidateGenerator):
    """Proposes one block of up to `B` tokens per round from the target's fixed-size context.

    Per round it (1) folds the target-cache rows retained since the last round into the global summary, (2) views
    the recent window in the target cache and takes the boundary states captured at the last accepted position,
    (3) runs one drafter forward over `[a, MASK, ...]` and (4) applies the Markov correction and the target's
    logits processors token by token, sampling (or taking the argmax of) exactly the distributions it returns.
    """

    requires_model_outputs = True
    # Hidden states come from forward hooks that keep only the last B + 1 positions, so nothing is requested here.
    model_kwargs_overrides: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: LongSparkDrafterModel,
        input_ids: torch.LongTensor,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None = None,
    ):
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"LongSpark drafting got a batch of {input_ids.shape[0]} sequences, but transformers' assisted "
                "decoding is batch-1. Call generate() once per prompt; batched drafting is not supported yet."
            )
        check_target_compatible(drafter.config, target)
        config = drafter.config
        check_sliding_window(target, config.target_layer_ids, input_ids.shape[1])
        drafter.bind_target(target)
        self.drafter, self.config = drafter, config
        self.layer_ids = config.target_layer_ids
        self.capture = HiddenStateCapture(drafter.target.layers, self.layer_ids, keep=config.block_size + 1)
        self.state = LongSparkContextState(config.num_draft_layers, config.summary_chunk_size)
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor if logits_processor else None
        self.eos_token_ids = getattr(generation_config, "_eos_token_tensor", None)
        self.max_length = generation_config.max_length
        self.mask_ids = torch.full((1, config.block_size - 1), config.mask_token_id, dtype=torch.long)
        self.confidence_threshold = drafter.generation_config.assistant_confidence_threshold or 0.0
        self.boundary_from_prefill = True
        self.stats = drafter.drafting_stats = DraftingStats()

    @torch.no_grad()
    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any],
        model_outputs: Any,
        is_first_iteration: bool,
        n_last_matches: int,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        # The target must prefill first: the drafter needs its cache and boundary states.
        if is_first_iteration:
            return input_ids, None
        self.stats.rounds += 1
        start = time.perf_counter()
        context = self.update_context(model_kwargs["cache"], input_ids.shape[1] - 1, n_last_matches)
        after_update = time.perf_counter()
        self.stats.context_update_seconds += after_update - start

        num_tokens = min(self.config.block_size, self.max_length - input_ids.shape[1] - 1)
        if num_tokens <= 0:
            return input_ids, None
        candidate_ids, candidate_logits = self.propose(input_ids, context, num_tokens)
        self.stats.proposal_seconds += time.perf_counter() - after_update
        self.stats.drafted_tokens += candidate_logits.shape[1]
        return candidate_ids, candidate_logits

    @torch.no_grad()
    def update_context(self, cache, num_cached: int, n_last_matches: int) -> DraftContext:
        """Absorbs new cache rows into the summary and gathers this round's three context views.

        `num_cached` is the target cache length `t`; `n_last_matches` indexes the boundary position in the last
        verification forward (the prefill's last position on the first round)."""
        if cache.get_seq_length() != num_cached:
            raise RuntimeError(f"Target cache holds {cache.get_seq_length()} rows, expected {num_cached}.")
        config, state = self.config, self.state
        # After prefill the boundary is the last prompt position; after a round it is the last accepted token.
        position = -1 if self.boundary_from_prefill else n_last_matches
        self.boundary_from_prefill = False
        state.boundary_states = self.capture.concatenated(position)

        new_rows = num_cached - state.num_absorbed
        window_rows = num_cached if config.full_prefix_context else min(config.window_size, num_cached)
        use_summary = config.use_global_summary and not config.full_prefix_context
        use_window = config.use_recent_window or config.full_prefix_context
        window_keys, window_values = [], []
        for j, layer_id in enumerate(self.layer_ids):
            keys, values = read_cache_rows(cache, layer_id, max(new_rows if use_summary else 0, window_rows))
            if use_summary and new_rows > 0:
                queries = self.drafter.summary_queries[j]
                state.absorb(j, queries, keys[:, :, -new_rows:], values[:, :, -new_rows:])
            if use_window:
                window_keys.append(keys[:, :, -window_rows:])
                window_values.append(values[:, :, -window_rows:])
        state.num_absorbed = num_cached
        self.stats.context_state_bytes = state.nbytes
        return DraftContext(
            boundary_states=state.boundary_states,
            window_keys=window_keys,
            window_values=window_values,
            window_mask=None,
            summary_values=list(state.summaries) if use_summary else [],
            positions=torch.tensor([num_cached], device=state.boundary_states.device),
        )

    @torch.no_grad()
    def propose(
        self, input_ids: torch.LongTensor, context: DraftContext, num_tokens: int
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        """Drafts up to `num_tokens` tokens; returns them appended to `input_ids` and their `(1, k, V)` logits.

        The block ends early at an EOS, and before the first token after the first whose draft probability is below
        `assistant_confidence_threshold` (dynamic block length: unlikely tokens are not worth verifying)."""
        block_ids = torch.cat([input_ids[:, -1:], self.mask_ids.to(input_ids.device)], dim=1)
        base_logits = self.drafter(block_ids, context).base_logits
        drafted_ids, drafted_logits = [], []
        previous = input_ids[:, -1]
        for i in range(num_tokens):
            logits = self.drafter.to_target_vocab(base_logits[:, i] + self.drafter.markov_correction(previous).float())
            if self.logits_processor is not None:  # they read the whole sequence so far (e.g. repetition penalty)
                logits = self.logits_processor(torch.cat([input_ids, *drafted_ids], dim=1), logits)
            probs = torch.softmax(logits, dim=-1)
            token = torch.multinomial(probs, num_samples=1) if self.do_sample else probs.argmax(dim=-1, keepdim=True)
            if i > 0 and self.confidence_threshold > 0 and float(probs.gather(-1, token)) < self.confidence_threshold:
                break
            drafted_ids.append(token)
            drafted_logits.append(logits)
            # Tokens after an EOS can never be kept, so the block ends there.
            if self.eos_token_ids is not None and torch.isin(token, self.eos_token_ids.to(token.device)).any():
                break
            previous = token[:, 0]
        return torch.cat([input_ids, *drafted_ids], dim=1), torch.stack(drafted_logits, dim=1)


_original_get_candidate_generator = GenerationMixin._get_candidate_generator
_original_validate_generation_mode = GenerationMixin._validate_generation_mode
_original_assisted_decoding = GenerationMixin._assisted_decoding


def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                             assistant_model=None, **kwargs) -> CandidateGenerator:  # fmt: skip
    if isinstance(assistant_model, LongSparkDrafterModel):
        return LongSparkCandidateGenerator(self, assistant_model, input_ids, generation_config, logits_processor)
    return _original_get_candidate_generator(
        self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, assistant_model, **kwargs
    )


def _assisted_decoding(self, input_ids, *args, assistant_model=None, **kwargs):
    # The fast verification path lives exactly as long as the assisted-decoding loop (see `verification.py`).
    if isinstance(assistant_model, LongSparkDrafterModel) and assistant_model.fast_verification:
        with fast_verification(self, kwargs.get("cache"), kwargs["generation_config"].max_length):
            return _original_assisted_decoding(self, input_ids, *args, assistant_model=assistant_model, **kwargs)
    return _original_assisted_decoding(self, input_ids, *args, assistant_model=assistant_model, **kwargs)


def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs) -> None:
    # Our own checks come first, so that a mismatched drafter gets LongSpark's error, not the different-tokenizer one.
    drafter = generation_mode_kwargs.get("assistant_model")
    if isinstance(drafter, LongSparkDrafterModel):
        check_target_compatible(drafter.config, self)
    _original_validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs)


def install_generation_hook() -> None:
    """Routes `generate(assistant_model=<LongSparkDrafterModel>)` to `LongSparkCandidateGenerator` (idempotent)."""
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    GenerationMixin._validate_generation_mode = _validate_generation_mode
    GenerationMixin._assisted_decoding = _assisted_decoding


__all__ = ["LongSparkCandidateGenerator", "DraftingStats", "install_generation_hook"]
