"""The drafting side of one speculative decoding call: `DraftSession`.

transformers' batch-1 loop (`generation.py`), the batched loop (`batched.py`) and vLLM's proposer (`../vllm/`) are
thin drivers of a session. Each knows where its target's cache rows, hidden states and tokens are; the session does
the rest, the same way for all three: it binds the drafter to the target, captures the boundary states, chooses each
request's source (the lookup source, one drafter forward, or no proposal, `planning.py`), reads the round's context
views where the drafter runs (`context_state.read_context`), proposes (`drafting.propose_blocks`): one call per round,
`draft_round`; and it keeps
the counters (`DraftingStats`, on `drafter.drafting_stats`) and what each request's verified rounds measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from ..context_state import DraftContext, LongSparkContextState, boundary_states, read_context
from ..modeling_longspark import LongSparkDrafterModel
from ..targets import HiddenStateCapture, TargetModules, check_sliding_window
from .drafting import DraftRequests, DraftSettings, Proposal, plan_round, propose_blocks
from .planning import RoundPlanner, Source
from .stats import DraftingStats


class DraftSession:
    """Drafts for the requests of one `generate` call (or one serving engine).

    Args:
        drafter: the drafter; bound here to `target`'s embedding, final norm, LM head and rotary embedding.
        target: the target model, or a serving engine's `TargetModules`.
        settings: what the proposals follow (`DraftSettings`).
        capture: hook the selected target layers and keep their last `max_proposal_tokens + 1` positions
            (`captured_boundary`); False when the driver reads the hidden states itself (vLLM).
    """

    def __init__(
        self,
        drafter: LongSparkDrafterModel,
        target: PreTrainedModel | TargetModules,
        settings: DraftSettings,
        capture: bool = True,
    ):
        drafter.bind_target(target)
        self.drafter, self.config, self.settings = drafter, drafter.config, settings
        self.capture = None
        if capture:
            keep = settings.max_proposal_tokens + 1
            self.capture = HiddenStateCapture(drafter.target.layers, self.config.target_layer_ids, keep=keep)
        self.stats = drafter.drafting_stats = DraftingStats()

    @classmethod
    def for_generate(
        cls,
        target: PreTrainedModel,
        drafter: LongSparkDrafterModel,
        input_ids: torch.LongTensor,
        settings: DraftSettings,
    ) -> DraftSession:
        """The session of `target.generate(input_ids, assistant_model=drafter, ...)` with the call's `settings`
        (`DraftSettings.for_generate`). `generate` has checked the drafter against the target before any forward
        (`generation._validate_generation_mode`); this refuses sliding-window layers that the prompt would overflow."""
        check_sliding_window(target, drafter.config.target_layer_ids, input_ids.shape[1])
        return cls(drafter, target, settings)

    def new_state(self) -> LongSparkContextState:
        """An empty context state (no row absorbed yet) for one request or a batch of them."""
        return LongSparkContextState(self.config.num_draft_layers, self.config.summary_chunk_size)

    def new_planner(self, offset: int = 0) -> RoundPlanner:
        """The source choice of one request whose tokens start at column `offset` (with its lookup index)."""
        return self.settings.new_planner(offset)

    def captured_boundary(self, positions: torch.LongTensor) -> torch.Tensor:
        """`(n, D * hidden_size)`: the boundary states at `positions` `(n,)` of the last target forward, batch row
        `r` for request `r` (positions index the kept positions: -1 is the last)."""
        positions = positions.to(self.capture.states[0].device)
        return boundary_states(self.capture.states, positions, torch.arange(len(positions), device=positions.device))

    def read_context(
        self,
        state: LongSparkContextState,
        cache,
        num_columns: int,
        column_mask: torch.BoolTensor | None = None,
    ) -> DraftContext:
        """This round's context views (`context_state.read_context`); `state.boundary_states` must be set."""
        start = time.perf_counter()
        context = read_context(self.config, self.drafter.summary_queries, state, cache, num_columns, column_mask)
        self.stats.context_update_seconds += time.perf_counter() - start
        self.stats.context_state_bytes = state.nbytes
        return context

    def draft_round(
        self,
        requests: DraftRequests,
        planners: list[RoundPlanner],
        read_context: Callable[[], DraftContext],
    ) -> Proposal:
        """One round's proposal for `requests`, counted in `stats`: each request's source (`drafting.plan_round`),
        then, only when some request drafts, the context views (`read_context()`, the driver's read of its cache,
        e.g. `self.read_context(...)`), and the proposal (`drafting.propose_blocks`)."""
        start = time.perf_counter()
        plan = plan_round(requests, self.settings, planners)
        planning = time.perf_counter() - start
        context = read_context() if plan.drafts else None
        start = time.perf_counter()
        proposal = propose_blocks(self.drafter, context, requests, self.settings, plan)
        self.stats.planning_seconds += planning
        self.stats.proposal_seconds += planning + time.perf_counter() - start
        self.stats.drafter_forward_seconds += proposal.forward_seconds
        self.stats.drafter_rounds += int(Source.DRAFTER in proposal.sources)
        self.stats.rounds += len(requests.rows)
        self.stats.batch_rounds += 1
        self.stats.drafted_tokens += int(proposal.num_drafted.sum())
        self.stats.lookup_rounds += plan.sources.count(Source.LOOKUP)
        self.stats.plain_rounds += plan.sources.count(Source.NONE)
        return proposal

    def record_accepted(self, proposal: Proposal, accepted: list[int], planners: list[RoundPlanner]) -> None:
        """Counts a verified round of each request (`accepted[r]` of `proposal`'s drafts kept), and tells each
        request's planner, which chooses the next sources from it. Rounds without a proposal are not acceptance
        samples (`DraftingStats.acceptance_rates`)."""
        proposed = proposal.num_drafted.tolist()
        self.stats.record_accepted([a for a, s in zip(accepted, proposal.sources) if s is not Source.NONE])
        for planner, source, k, a in zip(planners, proposal.sources, proposed, accepted, strict=True):
            planner.record(source, k, a)

    def close(self) -> None:
        """Removes the hidden-state hooks from the target (when decoding ends or fails)."""
        if self.capture is not None:
            self.capture.remove()


__all__ = ["DraftSession"]
