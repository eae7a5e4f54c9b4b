"""`target.generate(..., assistant_model=drafter)` with a LongSpark drafter.

Routing: transformers picks a candidate generator in `GenerationMixin._get_candidate_generator`, which has no
registry for third-party drafters. `transformers_longspark.register()` (run when a drafter is built, or a name of the
package is first used) wraps that method (and the assistant checks of `_validate_generation_mode`) once: when
`assistant_model` is a `LongSparkDrafterModel` the wrapper returns a `LongSparkCandidateGenerator`, and for every
other assistant and mode it calls the original unchanged. Assisted
decoding itself (verification, acceptance, cache cropping, streamers, outputs) is transformers' own loop for one
sequence; `_assisted_decoding` is wrapped to run it inside `verification.fast_verification`, and to run a batch of
sequences in `batched.py` instead (transformers' loop is batch-1). Settings neither loop serves (beam search, several
sequences per prompt, static caches) are refused before any token.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from functools import partial
from typing import Any, ClassVar

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import StaticCache, StaticLayer
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS
from transformers.generation.logits_process import LogitsProcessorList

from ..context_state import DraftContext
from ..modeling_longspark import LongSparkDrafterModel
from ..packed_linear import packed_drafter_weights
from ..targets import check_target_compatible
from ..transformers_private import original_generation_methods, patch_generation_methods
from .calibration import calibration_for_generate
from .drafting import DraftRequests, DraftSettings, Proposal
from .knobs import DraftingKnobs
from .session import DraftSession
from .stats import DraftingStats
from .verification import fast_verification


class LongSparkCandidateGenerator(CandidateGenerator):
    """Proposes one block of up to `B` tokens per round from the target's fixed-size context: transformers' batch-1
    assisted loop driving a `DraftSession`.

    Per round it chooses the source (`DraftSession.plan`: the lookup continuation, the drafter, or no proposal, which
    makes the round one plain decoding step). Where the drafter runs, it takes the boundary states captured at the
    last accepted position, folds the target-cache rows retained since the last drafter round into the global summary
    and views the recent window (`DraftSession.read_context`), then drafts one forward over `[a, MASK, ...]` with the
    Markov correction and the target's logits processors applied token by token (`DraftSession.draft_round`).
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
                f"LongSparkCandidateGenerator drafts for one sequence (transformers' assisted decoding is batch-1), "
                f"got {input_ids.shape[0]}. `target.generate(..., assistant_model=drafter)` runs batches in "
                "`transformers_longspark.inference.batched` instead."
            )
        settings = _call_settings(target, drafter, generation_config, logits_processor)
        self.session = DraftSession.for_generate(target, drafter, input_ids, settings)
        self.state = self.session.new_state()
        self.planner = self.session.new_planner()
        self.max_length = generation_config.max_length
        self.proposal: Proposal | None = None  # this round's, until transformers reports its verification
        # Whether the last target forward verified no drafts (the prefill, or a round without a proposal): the
        # boundary is then that forward's last position, else its last accepted one.
        self.boundary_is_last_position = True

    @property
    def stats(self) -> DraftingStats:
        return self.session.stats

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens one round proposes (transformers >= 5.25 sizes a recurrent cache's history with it)."""
        return self.session.settings.max_proposal_tokens

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """Called by transformers after each verification (the prefill's included) with the drafts accepted."""
        if self.proposal is not None:
            self.session.record_accepted(self.proposal, [int(num_matches)], [self.planner])
        self.boundary_is_last_position = self.proposal is None or int(self.proposal.num_drafted[0]) == 0
        self.proposal = None

    def close(self) -> None:
        """Removes the hidden-state hooks from the target (the generate hook calls it when decoding ends or fails)."""
        self.session.close()

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
        room = max(0, min(self.session.settings.max_proposal_tokens, self.max_length - input_ids.shape[1] - 1))
        requests = requests_after(input_ids, room)
        cache, num_cached = model_kwargs["cache"], input_ids.shape[1] - 1
        read_context = partial(self.update_context, cache, num_cached, n_last_matches)
        self.proposal = self.session.draft_round(requests, [self.planner], read_context)
        k = int(self.proposal.num_drafted[0])
        if k == 0:  # the verification forward still runs: one plain decoding step
            return input_ids, None
        logits = None if self.proposal.logits is None else self.proposal.logits[:, :k]  # None: greedy compares tokens
        return torch.cat([input_ids, self.proposal.tokens[:, :k]], dim=1), logits

    @torch.no_grad()
    def update_context(self, cache, num_cached: int, n_last_matches: int) -> DraftContext:
        """Absorbs new cache rows into the summary and gathers this round's three context views.

        `num_cached` is the target cache length `t`; `n_last_matches` indexes the boundary position, the last
        accepted one, in the last target forward that verified drafts."""
        if cache.get_seq_length() != num_cached:
            raise RuntimeError(f"Target cache holds {cache.get_seq_length()} rows, expected {num_cached}.")
        position = -1 if self.boundary_is_last_position else n_last_matches
        self.state.boundary_states = self.session.captured_boundary(torch.tensor([position]))
        return self.session.read_context(self.state, cache, num_cached)


def requests_after(input_ids: torch.LongTensor, room: int) -> DraftRequests:
    """The one request of a batch-1 round: the tokens `input_ids` `(1, t)`, with room for `room` drafts after them."""
    rows = torch.zeros(1, dtype=torch.long, device=input_ids.device)
    sequences = torch.cat([input_ids, input_ids.new_zeros(1, room)], dim=1)
    return DraftRequests(sequences, rows, rows + input_ids.shape[1], rows + room)


class _OpenGenerators(threading.local):
    """The candidate generators created by this thread's running `generate` calls, closed when each call ends."""

    def __init__(self):
        self.generators: list[LongSparkCandidateGenerator] = []


_open = _OpenGenerators()
_ORIGINAL = original_generation_methods()
_original_get_candidate_generator = _ORIGINAL["_get_candidate_generator"]
_original_validate_generation_mode = _ORIGINAL["_validate_generation_mode"]
_original_assisted_decoding = _ORIGINAL["_assisted_decoding"]


def _get_candidate_generator(
    self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, assistant_model=None, **kwargs
) -> CandidateGenerator:
    if isinstance(assistant_model, LongSparkDrafterModel):
        generator = LongSparkCandidateGenerator(self, assistant_model, input_ids, generation_config, logits_processor)
        _open.generators.append(generator)
        return generator
    return _original_get_candidate_generator(
        self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, assistant_model, **kwargs
    )


def _call_settings(
    target: PreTrainedModel,
    drafter: LongSparkDrafterModel,
    generation_config: GenerationConfig,
    logits_processor: LogitsProcessorList | None,
) -> DraftSettings:
    """The `DraftSettings` of one `generate` call, with this machine's calibrated costs where the drafter asks for
    them (`calibration.calibration_for_generate`)."""
    calibration = calibration_for_generate(target, drafter)
    costs = None if calibration is None else calibration.costs
    return DraftSettings.for_generate(drafter, generation_config, logits_processor, costs)


def _assisted_decoding(self, input_ids, *args, assistant_model=None, **kwargs):
    if not isinstance(assistant_model, LongSparkDrafterModel):
        return _original_assisted_decoding(self, input_ids, *args, assistant_model=assistant_model, **kwargs)
    cache = kwargs.get("cache")
    check_dynamic_cache(cache)
    max_length = kwargs["generation_config"].max_length
    if input_ids.shape[0] > 1:  # transformers' loop is batch-1
        from .batched import batched_speculative_decoding, max_cache_columns

        # Built once: the cache's room, the batch checks and the loop read the same settings.
        settings = _call_settings(self, assistant_model, kwargs["generation_config"], kwargs.get("logits_processor"))
        decode = partial(batched_speculative_decoding, settings=settings)
        max_length = max_cache_columns(max_length, settings.max_proposal_tokens)
    else:
        decode = _original_assisted_decoding
    # The fast verification path and the hidden-state hooks live exactly as long as the decoding loop, even when it
    # is interrupted (an exception or KeyboardInterrupt from a streamer or stopping criterion).
    opened = len(_open.generators)
    try:
        fast = assistant_model.fast_verification
        packed = assistant_model.packed_weights
        rows = {}
        if fast and packed:
            assistant_model.bind_target(self)  # its output head is one of the layers to pack
            # Measured (once per machine and target) before the fast path opens: which kernel runs which row counts.
            calibration = calibration_for_generate(self, assistant_model)
            rows = {} if calibration is None else calibration.fast_path_rows
        with (
            fast_verification(self, cache, max_length, packed, lean_layers=assistant_model.lean_layers, **rows)
            if fast
            else nullcontext(),
            packed_drafter_weights(assistant_model) if fast and packed else nullcontext(),
        ):
            return decode(self, input_ids, *args, assistant_model=assistant_model, **kwargs)
    finally:
        while len(_open.generators) > opened:
            _open.generators.pop().close()


def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs) -> None:
    # Our own checks come first, so that a mismatched drafter gets LongSpark's error, not the different-tokenizer one.
    drafter = generation_mode_kwargs.get("assistant_model")
    if isinstance(drafter, LongSparkDrafterModel):
        check_target_compatible(drafter.config, self)
        check_generation_settings(generation_config)
        DraftingKnobs.from_generation_config(drafter.generation_config)  # refuses invalid knobs before any forward
    _original_validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs)


def check_generation_settings(generation_config: GenerationConfig) -> None:
    """Raises `ValueError`, before any token, for the `generate` settings LongSpark drafting cannot serve."""
    if (generation_config.num_beams or 1) > 1:
        raise ValueError(
            f"LongSpark speculative decoding does not support beam search (num_beams={generation_config.num_beams}); "
            "use num_beams=1 (greedy or sampling)."
        )
    copies = generation_config.num_return_sequences or 1
    if copies > 1:
        raise ValueError(
            f"LongSpark speculative decoding returns one sequence per prompt (num_return_sequences={copies}); call "
            f"generate once per sample, or repeat the prompt in the batch (`input_ids.repeat_interleave({copies}, 0)`)."
        )
    if generation_config.guidance_scale is not None and generation_config.guidance_scale != 1:
        raise ValueError(
            f"Classifier-free guidance (guidance_scale={generation_config.guidance_scale}) runs its own forward once "
            "per generated token, which a drafted block's several positions would desynchronise; call generate "
            "without assistant_model to use it."
        )
    if generation_config.cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"LongSpark reads and crops the target's KV cache, which cache_implementation="
            f"{generation_config.cache_implementation!r} cannot do; use the default dynamic cache "
            "(drop `cache_implementation`)."
        )


def check_dynamic_cache(cache) -> None:
    """Raises `ValueError` for a cache passed to `generate` that LongSpark cannot read and crop (a static cache)."""
    layers = getattr(cache, "layers", None) or []
    if isinstance(cache, StaticCache) or any(isinstance(layer, StaticLayer) for layer in layers):
        raise ValueError(
            f"LongSpark reads and crops the target's KV cache, which a {type(cache).__name__} cannot do; use the "
            "default dynamic cache (pass no `cache`, or a `DynamicCache`)."
        )


def install_generation_hook() -> None:
    """Routes `generate(assistant_model=<LongSparkDrafterModel>)` to `LongSparkCandidateGenerator` (idempotent); refuses
    a transformers version whose private API it was not written for (`transformers_private.check_transformers`)."""
    patch_generation_methods(
        {
            "_get_candidate_generator": _get_candidate_generator,
            "_validate_generation_mode": _validate_generation_mode,
            "_assisted_decoding": _assisted_decoding,
        }
    )


__all__ = [
    "LongSparkCandidateGenerator",
    "check_dynamic_cache",
    "check_generation_settings",
    "install_generation_hook",
    "requests_after",
]
