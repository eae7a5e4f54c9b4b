"""One drafting round for `n` requests: the proposal sources and the settings they follow.

`plan_round` chooses each request's source (`planning.py`): the lookup source's continuation (`lookup.py`), a block
drafted by one drafter forward (`draft_tokens`, which applies the Markov correction, `generate`'s logits processors
token by token (`processors.process_logits`) and the confidence cuts), or no proposal. `propose_blocks` proposes
accordingly. `DraftSettings` holds what the cuts, the lookup source, the cost model and the sampling read;
`DraftRequests` the requests of one round. The drafting session (`session.py`) calls them each round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList

from ..context_state import DraftContext
from ..modeling_longspark import LongSparkDrafterModel
from ..transformers_private import eos_token_tensor
from .knobs import DraftingKnobs, pinned_costs
from .lookup import SuffixIndex, point_mass_logits
from .planning import RoundPlan, RoundPlanner, Source, batch_round_pays
from .processors import DRAFT_VOCAB_PROCESSORS, process_logits
from .round_costs import RoundCosts
from .sampling import sample_from

# The longest suffix the lookup source matches: longer matches are rarer and add little over this one.
LOOKUP_MAX_NGRAM = 6


@dataclass(frozen=True)
class DraftSettings:
    """What a round's proposals follow. The drafter's generation config gives the confidence cuts and the lookup
    source, the `generate` call (or the serving engine) the sampling, the EOS ids and the logits processors.

    Attributes:
        block_size: `B`, the most tokens one drafter forward proposes.
        do_sample: sample each draft from its distribution (else take its argmax).
        token_threshold / block_threshold: the confidence cuts of `draft_tokens` (0: off): transformers'
            `assistant_confidence_threshold`, and LongSpark's `block_confidence_threshold`.
        lookup_min_match: shortest matched suffix that makes a request take the lookup continuation (0: lookup off).
        lookup_num_tokens: the most tokens of a lookup continuation.
        lookup_choose_length: propose the prefix of a continuation that the request's past lookup rounds make worth
            most (`RoundPlanner.lookup_length`); False: the whole continuation, every time.
        lookup_first: a continuation worth more than a plain step is taken without weighing the drafter
            (`RoundPlanner.choose`); False: the two compete on their estimated tokens per step.
        use_drafter: the drafter's blocks are a source (False: the lookup source and plain steps only).
        costs: the cost model of the source choice (`round_costs.py`), in plain decoding steps of the target (all 0:
            every round proposes, as on a GPU): the drafter's `generation_config` fields, or a calibration of this
            machine and target (`calibration.py`).
        eos_token_ids: `(k,)` ids that end a block, or `None`.
        logits_processor: `generate`'s processors, applied to every drafted position, or `None`.
        return_logits: give each proposal the `(n, k, vocab_size)` logits its tokens were drawn from, which the
            verifier of sampled decoding divides by; greedy decoding compares tokens only and skips building them
            (unless `assistant_ensemble_weight` mixes the drafter's law into the choice).
    """

    block_size: int
    do_sample: bool = False
    token_threshold: float = 0.0
    block_threshold: float = 0.0
    lookup_min_match: int = 0
    lookup_num_tokens: int = 0
    lookup_choose_length: bool = True
    lookup_first: bool = True
    use_drafter: bool = True
    costs: RoundCosts = field(default_factory=RoundCosts)
    eos_token_ids: torch.Tensor | None = None
    logits_processor: LogitsProcessorList | None = None
    return_logits: bool = True

    @classmethod
    def from_drafter(
        cls, drafter: LongSparkDrafterModel, costs: RoundCosts | None = None, **call: object
    ) -> DraftSettings:
        """The drafter's own settings (its `generation_config`, validated: `DraftingKnobs`), with `costs` in place of
        its cost fields when given (a calibration; the fields it sets are kept over the measurements, `pinned_costs`),
        and `call`'s fields (`do_sample`, `eos_token_ids`, `logits_processor`) from the caller."""
        knobs = DraftingKnobs.from_generation_config(drafter.generation_config)
        costs = None if costs is None else pinned_costs(costs, drafter.generation_config)
        block_size, min_match = drafter.config.block_size, knobs.lookup_min_match
        return cls(
            block_size=block_size,
            token_threshold=knobs.assistant_confidence_threshold,
            block_threshold=knobs.block_confidence_threshold,
            lookup_min_match=min_match,
            lookup_num_tokens=(knobs.lookup_num_tokens or block_size) if min_match else 0,
            lookup_choose_length=knobs.lookup_choose_length,
            lookup_first=knobs.lookup_first,
            use_drafter=knobs.use_drafter,
            costs=knobs.costs if costs is None else costs,
            **call,
        )

    @classmethod
    def for_generate(
        cls,
        drafter: LongSparkDrafterModel,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None,
        costs: RoundCosts | None = None,
    ) -> DraftSettings:
        """The settings of a `generate` call: its sampling, EOS ids and logits processors (and `costs`, when the
        drafter's are calibrated)."""
        do_sample = bool(generation_config.do_sample)
        ensemble = getattr(generation_config, "assistant_ensemble_weight", None) is not None
        return cls.from_drafter(
            drafter,
            costs,
            do_sample=do_sample,
            eos_token_ids=eos_token_tensor(generation_config),
            logits_processor=logits_processor or None,
            return_logits=do_sample or ensemble,
        )

    @property
    def max_proposal_tokens(self) -> int:
        """The most tokens one round proposes: the block size, or the lookup continuation's length if longer."""
        return max(self.block_size, self.lookup_num_tokens)

    def new_planner(self, offset: int = 0) -> RoundPlanner:
        """The source choice of one request (its tokens start at column `offset`), with an empty `SuffixIndex` when
        lookup is on."""
        lookup = None
        if self.lookup_min_match:
            lookup = SuffixIndex(self.lookup_min_match, max(self.lookup_min_match, LOOKUP_MAX_NGRAM), offset)
        return RoundPlanner(
            self.costs,
            lookup,
            choose_lookup_length=self.lookup_choose_length,
            lookup_first=self.lookup_first,
            block_size=self.block_size,
        )


@dataclass
class DraftRequests:
    """The `n` requests of one round.

    Attributes:
        sequences: `(batch, S)` tokens of the whole batch; request `r`'s are `sequences[rows[r], :lengths[r]]`, the
            last one its anchor `a`. Its drafts are written in place after them (the logits processors read them),
            so `S >= lengths + room`.
        rows / lengths / room: `(n,)` batch row, length and most tokens to propose of each request.
    """

    sequences: torch.LongTensor
    rows: torch.LongTensor
    lengths: torch.LongTensor
    room: torch.LongTensor

    def select(self, index: torch.LongTensor) -> DraftRequests:
        """The requests `index` `(n',)` only (the same `sequences`)."""
        return replace(self, rows=self.rows[index], lengths=self.lengths[index], room=self.room[index])


@dataclass
class Proposal:
    """One round's proposal for `n` requests.

    Attributes:
        tokens: `(n, k)` proposed tokens; columns past `num_drafted[r]` are to be ignored.
        logits: `(n, k, vocab_size)` the processed logits each token was drawn from (one-hot for lookup tokens), or
            `None` when the settings do not ask for them (`DraftSettings.return_logits`).
        num_drafted: `(n,)` tokens proposed per request.
        sources: per request, where its proposal came from (`Source.NONE`: no proposal).
        forward_seconds: the time of the drafter forward, if one ran (`DraftingStats.drafter_forward_seconds`).
    """

    tokens: torch.LongTensor
    logits: torch.Tensor | None
    num_drafted: torch.LongTensor
    sources: list[Source]
    forward_seconds: float = 0.0

    @property
    def from_lookup(self) -> torch.BoolTensor:
        """`(n,)` which requests took the lookup continuation."""
        flags = [source is Source.LOOKUP for source in self.sources]
        return torch.tensor(flags, dtype=torch.bool, device=self.num_drafted.device)


def block_continues(confidence, block_probability, token_threshold: float, block_threshold: float):
    """Whether a block goes on to a position `i > 1` (dynamic block length, `draft_tokens`): its `confidence` (the
    largest probability of `q_i`) is at least `token_threshold`, and the product of the block's drawn probabilities so
    far times it at least `block_threshold`. Tensors (one entry per request) or floats."""
    return (confidence >= token_threshold) & (block_probability * confidence >= block_threshold)


@torch.no_grad()
def draft_tokens(
    drafter: LongSparkDrafterModel, context: DraftContext, requests: DraftRequests, settings: DraftSettings
) -> Proposal:
    """One drafter forward over the blocks `[a, MASK, ...]` of `n` requests, then the Markov correction and the
    logits processors token by token, sampling (or taking the argmax of) exactly the distributions returned.

    A request's block ends after `requests.room[r]` tokens (at most `B`), after an EOS, and before the first position
    `i > 1` whose confidence, the largest probability of its draft distribution `q_i`, is below
    `settings.token_threshold`, or at which the product of the block's probabilities so far (drawn tokens
    `q_1(y_1) ... q_{i-1}(y_{i-1})`, times `q_i`'s confidence: an estimate of the chance that the whole block is
    accepted) falls below `settings.block_threshold` (dynamic block length: each verified token costs a share of a
    target step, which unlikely tokens do not repay).

    The cuts keep sampling exact: whether position `i` is proposed is decided from `q_i` and the tokens drawn before
    it, never from `y_i` itself, so a proposed `y_i` is distributed as `q_i`, the law handed to the verifier. (Cutting
    on `q_i(y_i)` would propose `q_i` restricted to the tokens that pass, and bias the output.) In greedy decoding the
    drawn token is the argmax, so both rules cut at the same place.

    Returns the drafted `Proposal` (source `Source.DRAFTER`). The drafts are also written into `requests.sequences`.
    """
    sequences, rows, lengths = requests.sequences, requests.rows, requests.lengths
    max_tokens = requests.room.clamp(max=drafter.config.block_size)
    logits_processor, device = settings.logits_processor, sequences.device
    eos_token_ids = None if settings.eos_token_ids is None else settings.eos_token_ids.to(device)
    previous = sequences[rows, lengths - 1]
    masks = previous.new_full((len(rows), drafter.config.block_size - 1), drafter.config.mask_token_id)
    start = time.perf_counter()
    base_logits = drafter(torch.cat([previous[:, None], masks], dim=1), context).base_logits
    forward_seconds = time.perf_counter() - start
    # Without processors (or with `DRAFT_VOCAB_PROCESSORS` only), tokens are chosen among the draft vocabulary's own
    # logits: every other token is -inf in the target vocabulary, so the distribution is the same, at a fraction of
    # the cost; target-vocabulary logits are built once at the end. Other processors read target-vocabulary logits
    # (and the sequence), so they get them per token.
    in_draft_vocab = all(isinstance(processor, DRAFT_VOCAB_PROCESSORS) for processor in logits_processor or [])
    # Score-only processors never read the sequence: one gather of the rows serves every position.
    score_only_ids = sequences[rows] if in_draft_vocab and logits_processor else None
    drafting = max_tokens > 0
    num_drafted = torch.zeros_like(lengths)
    drafted_ids, drafted_logits = [], []
    block_probability = torch.ones(len(rows), device=device)  # the product of the block's draft probabilities so far
    thresholds = settings.token_threshold, settings.block_threshold
    for i in range(int(max_tokens.max())):
        drafting &= i < max_tokens
        if not drafting.any():
            break
        logits = base_logits[:, i] + drafter.markov_correction(previous).float()
        if not in_draft_vocab:
            logits = process_logits(logits_processor, sequences, rows, lengths + i, drafter.to_target_vocab(logits))
        elif score_only_ids is not None:
            logits = logits_processor(score_only_ids, logits)
        probs = torch.softmax(logits, dim=-1)
        # The confidence (q_i's largest probability) and its token, the greedy choice (the first of tied maxima).
        confidence, choice = probs.max(dim=-1)
        if i > 0:  # decided before drawing y_i (see the docstring): the cut must not depend on the token it drops
            drafting &= block_continues(confidence, block_probability, *thresholds)
        drawn_probability = confidence
        if settings.do_sample:
            choice = sample_from(probs)
            drawn_probability = probs.gather(-1, choice[:, None])[:, 0]
        token = drafter.to_target_ids(choice) if in_draft_vocab else choice
        block_probability = block_probability * drawn_probability
        num_drafted += drafting
        sequences[rows, lengths + i] = token
        drafted_ids.append(token)
        if settings.return_logits:
            drafted_logits.append(logits)
        # Tokens after an EOS can never be kept, so the block ends there.
        if eos_token_ids is not None:
            drafting &= ~torch.isin(token, eos_token_ids)
        previous = token
    sources = [Source.DRAFTER] * len(rows)
    if not drafted_ids:
        empty = base_logits.new_zeros(len(rows), 0, drafter.config.vocab_size) if settings.return_logits else None
        return Proposal(sequences.new_zeros(len(rows), 0), empty, num_drafted, sources, forward_seconds)
    logits = None
    if settings.return_logits:
        logits = torch.stack(drafted_logits, dim=1)
        logits = drafter.to_target_vocab(logits) if in_draft_vocab else logits
    return Proposal(torch.stack(drafted_ids, dim=1), logits, num_drafted, sources, forward_seconds)


def plan_round(requests: DraftRequests, settings: DraftSettings, planners: list[RoundPlanner]) -> RoundPlan:
    """Each request's source this round (`RoundPlanner.choose`): its lookup index is first extended with the
    request's tokens since the last round, and its continuation is a candidate when the matched suffix has at least
    `settings.lookup_min_match` tokens; a round that takes it proposes the length its planner chose from past rounds
    (`RoundPlanner.lookup_length`), and a drafter block at most the length it chose (`RoundPlanner.draft_length`)."""
    sources, continuations, draft_lengths = [], {}, {}
    for r, planner in enumerate(planners):
        room, length, continuation, matched = int(requests.room[r]), int(requests.lengths[r]), [], 0
        if planner.lookup is not None:
            index = planner.lookup
            index.extend(requests.sequences[int(requests.rows[r]), index.offset + len(index) : length].tolist())
            proposed, matched = index.continuation(min(settings.lookup_num_tokens, room))
            continuation = proposed if matched >= settings.lookup_min_match else []
        can_draft = settings.use_drafter and room > 0
        source = planner.choose(continuation, can_draft=can_draft, length=length, matched=matched, room=room)
        if source is Source.LOOKUP:
            continuations[r] = continuation[: planner.lookup_length(len(continuation), matched, length)]
        elif source is Source.DRAFTER:
            draft_lengths[r] = planner.draft_length
        sources.append(source)
    if len(planners) > 1:  # a batch verifies every row at the widest proposal: the round as a whole must pay
        proposed = [
            _expected_proposal(planner, source, continuations.get(r), settings)
            for r, (planner, source) in enumerate(zip(planners, sources, strict=True))
        ]
        if not batch_round_pays(planners, sources, proposed, int(requests.lengths.max()), settings.costs):
            return RoundPlan([Source.NONE] * len(planners), {})
    return RoundPlan(sources, continuations, draft_lengths)


def _expected_proposal(
    planner: RoundPlanner, source: Source, continuation: list[int] | None, settings: DraftSettings
) -> int:
    """The tokens a request's round is expected to propose: its lookup continuation, or the drafter's running mean
    (its confidence cuts end blocks early) up to the length its planner chose, or that length while it is untried."""
    if source is Source.LOOKUP:
        return len(continuation)
    if source is Source.DRAFTER:
        proposed = planner.records[Source.DRAFTER].proposed
        return planner.draft_length if proposed is None else max(1, min(round(proposed), planner.draft_length))
    return 0


@torch.no_grad()
def propose_blocks(
    drafter: LongSparkDrafterModel,
    context: DraftContext | None,
    requests: DraftRequests,
    settings: DraftSettings,
    plan: RoundPlan,
) -> Proposal:
    """This round's proposal for `n` requests, as `plan` chose: the lookup continuation (up to `lookup_num_tokens`
    tokens at no drafter cost, proposed with the point-mass law, one-hot logits, which is exactly how they were
    chosen), the drafter's block (one forward for those requests, `draft_tokens`; `context` may be `None` when none
    of them drafts), or nothing."""
    if plan.draft_lengths:  # each drafting request's block ends at the length its planner chose
        room = requests.room.clone()
        for r, k in plan.draft_lengths.items():
            room[r] = min(int(room[r]), k)
        requests = replace(requests, room=room)
    sequences, rows, lengths = requests.sequences, requests.rows, requests.lengths
    n, device, vocab_size = len(rows), sequences.device, drafter.config.vocab_size
    if plan.sources == [Source.DRAFTER] * n:
        return draft_tokens(drafter, context, requests, settings)
    drafter_rows, drafted = plan.rows_from(Source.DRAFTER, device), None
    if len(drafter_rows):
        drafted = draft_tokens(drafter, context.select(drafter_rows), requests.select(drafter_rows), settings)
    width = max([len(c) for c in plan.continuations.values()] + [drafted.tokens.shape[1] if drafted else 0])
    proposal = Proposal(
        tokens=sequences.new_zeros(n, width),
        logits=torch.zeros(n, width, vocab_size, device=device) if settings.return_logits else None,
        num_drafted=lengths.new_zeros(n),
        sources=list(plan.sources),
    )
    if drafted is not None:
        k = drafted.tokens.shape[1]
        proposal.tokens[drafter_rows, :k] = drafted.tokens
        if settings.return_logits:
            proposal.logits[drafter_rows, :k] = drafted.logits
        proposal.num_drafted[drafter_rows] = drafted.num_drafted
        proposal.forward_seconds = drafted.forward_seconds
    for r, continuation in plan.continuations.items():
        ids = torch.tensor(continuation, device=device)
        proposal.tokens[r, : len(ids)] = ids
        if settings.return_logits:
            proposal.logits[r, : len(ids)] = point_mass_logits(ids, vocab_size)
        proposal.num_drafted[r] = len(ids)
        sequences[rows[r], lengths[r] : lengths[r] + len(ids)] = ids  # the logits processors read the drafts
    return proposal


__all__ = [
    "LOOKUP_MAX_NGRAM",
    "DraftRequests",
    "DraftSettings",
    "Proposal",
    "block_continues",
    "draft_tokens",
    "plan_round",
    "propose_blocks",
]
