"""`LongSparkProposer`: LongSpark drafting inside vLLM's speculative decoding (V1 model runner, `custom_class`).

    from vllm import LLM
    llm = LLM(target_dir, dtype="float32", enforce_eager=True, speculative_config={
        "method": "custom_class", "model": "transformers_longspark.vllm.LongSparkProposer",
        "num_speculative_tokens": 7})        # with LONGSPARK_DRAFTER=<drafter folder> in the environment

Per step, vLLM verifies the drafts of the last step, then calls `propose` with each running request's accepted
tokens. For every request that sampled, the proposer keeps a `LongSparkContextState` keyed by vLLM's request id and
does what the transformers loop does each round, with the same code (`drafting.py`): fold the request's new KV rows
into the global summary, take the recent window and the boundary states at the last accepted position; then
`propose_blocks` proposes for every such request: the lookup source's continuation where the request's suffix occurred
before (with `lookup_min_match` set in the drafter's generation config, `lookup.py`), else a block drafted by one
drafter forward shared by those requests. Only the place the rows come from differs: vLLM's paged KV cache
(`paged_kv.py`), and hooks on the target's decoder layers for the hidden states.

A request's state is created at its first sampled token (after its last prefill chunk: the prompt's rows are all in
the cache then) and dropped once the request leaves vLLM's batch (finished, preempted, or not scheduled in a step);
if it comes back, the state is rebuilt from its rows in the cache. Its source choice (`RoundPlanner`, with its lookup
index, `SuffixIndex`) lives and dies with it: the index is extended each step with the request's tokens since the
last (`token_ids_cpu`) and rebuilt from its whole history. vLLM does not report accepted counts back, so the choice
has no past rounds to weigh: a request takes the lookup continuation where its suffix matches and the drafter's block
elsewhere, and never a round without drafts (the cost model is for CPUs, where a verified token is dear).
Drafts are argmax tokens or lookup continuations, at most `num_speculative_tokens` of them; vLLM's rejection sampler
takes custom drafts as one-hot proposals, which is exact under sampling for both (each is a point mass given the
request's tokens). On vLLM's CPU backend, sampling with drafts needs `cpu_sampling.fix_cpu_expand`, which the proposer
installs in the engine's worker.

vLLM passes this interface neither request ids nor hidden states, so the proposer reads the model runner's batch
(`input_batch`, `query_start_loc`): the runner is found once, as the caller of `load_model` (see `_find_runner`).
This is vLLM's experimental interface (0.32, V1 runner only); a production GPU path would be a proposer in the V2
runner. What it cannot serve is refused by name: tensor- or pipeline-parallel engines, sliding-window (hybrid) targets,
several KV-cache groups, and compiled (non-eager) models.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..context_state import DraftContext, LongSparkContextState, boundary_states, stack_contexts
from ..inference.drafting import DraftRequests, DraftSettings
from ..inference.planning import RoundPlanner
from ..inference.session import DraftSession
from ..inference.stats import DraftingStats
from ..modeling_longspark import LongSparkDrafterModel
from ..targets import HiddenStateCapture, TargetModules, check_target_compatible, sliding_window_layers
from .cpu_sampling import fix_cpu_expand
from .paged_kv import PagedRequestRows

DRAFTER_ENV = "LONGSPARK_DRAFTER"
"""Environment variable naming the drafter folder (vLLM's `speculative_config.model` holds the class path)."""
DRAFT_LOG_ENV = "LONGSPARK_VLLM_DRAFT_LOG"
"""Optional: a JSONL file that receives one line per request and drafting round: its request id and place in vLLM's
batch, cache rows, anchor, drafts, their source (`"drafter"` or `"lookup"`), and whether its state was (re)built."""
RUNNER_SEARCH_DEPTH = 8
"""How many frames above `load_model` are searched for the model runner (vLLM calls it from the runner's own
`load_model`, one frame up; the rest leaves room for decorators and wrappers)."""


class _Weight(nn.Module):
    """Holds the target's LM-head weight for the drafter (vLLM's head is not an `nn.Linear`)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight


class LongSparkProposer:
    """A vLLM `custom_class` proposer that drafts with a LongSpark drafter (one block per request and step).

    Args:
        vllm_config: vLLM's config. The drafter folder comes from the `LONGSPARK_DRAFTER` environment variable. At
            most `speculative_config.num_speculative_tokens` tokens are proposed per request and step (vLLM verifies
            no more): drafted blocks of at most the drafter's `block_size`, lookup continuations of at most
            `lookup_num_tokens` (`max_proposal_tokens`).
    """

    def __init__(self, vllm_config: Any):
        path = os.environ.get(DRAFTER_ENV)
        if not path:
            raise ValueError(
                f"LongSparkProposer needs its drafter folder: set {DRAFTER_ENV}=<folder saved by `longspark train`> "
                "in the environment of the process that creates the vLLM engine."
            )
        model_config = vllm_config.model_config
        self.hf_config = model_config.hf_config
        self.dtype = model_config.dtype
        self.drafter = LongSparkDrafterModel.from_pretrained(path, dtype=self.dtype).eval().requires_grad_(False)
        config = self.drafter.config
        target = _ConfigOnly(self.hf_config, str(model_config.model))
        check_target_compatible(config, target, drafter_name=path)
        self.num_tokens = int(vllm_config.speculative_config.num_speculative_tokens)
        settings = DraftSettings.from_drafter(self.drafter)
        longest = settings.max_proposal_tokens
        if not 1 <= self.num_tokens <= longest:
            raise ValueError(
                f"num_speculative_tokens={self.num_tokens}, but the LongSpark drafter at {path} proposes at most "
                f"{longest} tokens (blocks of {config.block_size}, and its lookup continuations); use 1 <= "
                f"num_speculative_tokens <= {longest}."
            )
        _check_eager(vllm_config)
        _check_single_worker(vllm_config.parallel_config)
        self.vllm_config = vllm_config
        self.layer_ids = list(config.target_layer_ids)
        _check_full_attention(self.hf_config, self.layer_ids)
        # vLLM adds the EOS ids to every request's stop tokens; its one-hot verification takes argmax drafts.
        self.settings = replace(settings, eos_token_ids=eos_token_ids(model_config))
        self.session: DraftSession | None = None  # built by `load_model`, with the target's modules
        self.capture: HiddenStateCapture | None = None  # hooks on the selected decoder layers, set by `load_model`
        self.states: dict[str, LongSparkContextState] = {}
        # Each request's source choice and, with lookup on (`lookup_min_match`), its lookup index: kept, dropped and
        # rebuilt with its state. vLLM does not report accepted counts back, so a request takes the lookup
        # continuation where its suffix matches and the drafter's block elsewhere.
        self.planners: dict[str, RoundPlanner] = {}
        self.lookup_on = bool(self.settings.lookup_min_match)
        self.runner = None
        self.states_built = 0
        self.draft_log = os.environ.get(DRAFT_LOG_ENV)
        fix_cpu_expand()  # else vLLM's CPU sampler verifies sampled drafts against garbage logits (cpu_sampling.py)

    @property
    def stats(self) -> DraftingStats:
        """The drafting counters (`rounds` counts one proposal per request and step)."""
        return self.session.stats

    def load_model(self, target_model: nn.Module) -> None:
        """Called by vLLM's model runner with the loaded target: finds that runner (`_find_runner`), binds the drafter
        to the target's embedding, final norm, LM head and rotary embedding, and hooks the selected decoder layers
        (each step's `capture.states[slot]` is then `(num_tokens, hidden_size)`, the rows of the step's forward)."""
        self.runner = _find_runner(self)
        target = _target_modules(target_model, self.hf_config, self.dtype)
        self.session = DraftSession(self.drafter, target, self.settings, capture=False)
        layers = target_model.model.layers
        self.capture = HiddenStateCapture(layers, self.layer_ids, keep=None, hidden_of=_vllm_hidden, any_thread=True)

    @torch.inference_mode()
    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: Any,
        token_ids_cpu: Any,
        slot_mappings: Any = None,
        **kwargs: Any,
    ) -> list[list[int]]:
        """One block of drafts per request of the runner's batch, in batch order (`[]` for a request still in
        prefill); called after the step's tokens were sampled and booked (`num_tokens_no_spec` includes them)."""
        if self.runner is None:
            raise RuntimeError("LongSparkProposer.propose was called before load_model bound it to vLLM's runner.")
        batch = self.runner.input_batch
        request_ids = list(batch.req_ids[: len(sampled_token_ids)])
        for request_id in set(self.states) - set(request_ids):  # finished, preempted or not scheduled
            del self.states[request_id]
            self.planners.pop(request_id, None)
        query_start = self.runner.query_start_loc.np
        kv_caches, block_table = self._kv_caches(), _single_block_table(batch.block_table)
        drafting = [i for i in range(len(request_ids)) if sampled_token_ids[i]]  # the others are still in prefill
        contexts, anchors, lengths, built = [], [], [], []
        for i in drafting:
            num_rows = int(num_tokens_no_spec[i]) - 1  # the last sampled token (the anchor) has no KV row yet
            boundary_row = step_row(request_ids[i], num_rows - 1, int(batch.num_computed_tokens_cpu[i]),
                                    int(query_start[i]), int(query_start[i + 1]))  # fmt: skip
            block_ids = block_table.block_table.np[i, : block_table.num_blocks_per_row[i]]
            rows = PagedRequestRows(kv_caches, block_ids, num_rows, self.dtype)
            context, new_state = self._context(request_ids[i], rows, boundary_row)
            lookup = self.planners[request_ids[i]].lookup
            if lookup is not None:
                lookup.extend(token_ids_cpu[i, len(lookup) : num_rows + 1].tolist())  # up to the anchor
            contexts.append(context)
            anchors.append(int(token_ids_cpu[i, num_rows]))
            lengths.append(num_rows)
            built.append(new_state)
        drafts: list[list[int]] = [[] for _ in request_ids]
        if drafting:
            planners = [self.planners[request_ids[i]] for i in drafting]
            blocks, from_lookup = self._propose(stack_contexts(contexts), anchors, planners)
            for r, i in enumerate(drafting):
                drafts[i] = blocks[r]
                entry = dict(request_id=request_ids[i], batch_index=i, num_rows=lengths[r], anchor=anchors[r])
                self._log(**entry, drafts=blocks[r], source="lookup" if from_lookup[r] else "drafter", built=built[r])
        return drafts

    def _context(self, request_id: str, rows: PagedRequestRows, boundary_row: int) -> tuple[DraftContext, bool]:
        """This round's context of one request whose cache holds `rows` (its boundary is row `boundary_row` of the
        step's forward), and whether its state was (re)built (its lookup index then starts empty)."""
        state = self.states.get(request_id)
        built = state is None or state.num_absorbed > rows.num_rows
        if built:
            state = self.states[request_id] = self.session.new_state()
            self.planners[request_id] = self.session.new_planner()
            self.states_built += 1
        step_states = [h[None] for h in self.capture.states]  # (1, num_tokens, hidden): the step's forward
        state.boundary_states = boundary_states(step_states, torch.tensor([boundary_row])).to(self.dtype)
        return self.session.read_context(state, rows, rows.num_rows), built

    def _propose(
        self, context: DraftContext, anchors: list[int], planners: list[RoundPlanner]
    ) -> tuple[list[list[int]], list[bool]]:
        """Each request's proposal after its anchor (`propose_blocks`: one drafter forward for the requests that do
        not take a lookup continuation), and whether it came from lookup.

        Each lookup index already holds its request's tokens up to the anchor, the only column of `sequences` before
        the drafts, so `propose_blocks` adds nothing to it."""
        n = len(anchors)
        sequences = torch.tensor([[anchor] + [0] * self.num_tokens for anchor in anchors])
        ones = torch.ones(n, dtype=torch.long)
        requests = DraftRequests(sequences, rows=torch.arange(n), lengths=ones, room=ones * self.num_tokens)
        proposal = self.session.draft_round(requests, planners, lambda: context)
        num_drafted = proposal.num_drafted.tolist()
        blocks = [proposal.tokens[r, : num_drafted[r]].tolist() for r in range(n)]
        return blocks, proposal.from_lookup.tolist()

    def _log(self, built: bool, **entry: Any) -> None:
        if self.draft_log:
            with open(self.draft_log, "a") as log:
                log.write(json.dumps({**entry, "state_built": built}) + "\n")

    def _kv_caches(self) -> dict[int, tuple[torch.Tensor, str]]:
        """Target layer index -> (its KV-cache tensor, layout), read at each step (vLLM binds caches after load).
        `unpack_blocks` refuses layouts it cannot read, naming them."""
        context = self.vllm_config.compilation_config.static_forward_context
        attention = {i: context[f"model.layers.{i}.self_attn.attn"] for i in self.layer_ids}
        return {i: (layer.kv_cache, getattr(layer, "isa", None)) for i, layer in attention.items()}


def _vllm_hidden(output: Any) -> torch.Tensor:
    """The transformers hidden state of a vLLM decoder layer's output: `mlp output + residual`. The sum is a new
    tensor (the next layer's fused add-norm overwrites both in place), as is the clone of a plain output."""
    return output[0] + output[1] if isinstance(output, tuple) else output.clone()


@dataclass
class _ConfigOnly:
    """What `check_target_compatible` reads of a target, for a vLLM model."""

    config: Any
    name_or_path: str


def step_row(request_id: str, position: int, num_computed: int, query_start: int, query_end: int) -> int:
    """The row of the step's flattened forward `(num_tokens, hidden)` that holds `position` of one request.

    The step ran the request's positions `[num_computed, num_computed + query_end - query_start)` as rows
    `[query_start, query_end)`. A position outside them (the runner's bookkeeping is not what this proposer reads it
    as) would silently take another request's hidden state, so it raises instead, naming the request."""
    row = query_start + position - num_computed
    if not query_start <= row < query_end:
        raise RuntimeError(
            f"LongSparkProposer: position {position} of request {request_id!r} is row {row} of this step's forward, "
            f"outside the request's rows [{query_start}, {query_end}) (it had {num_computed} computed tokens before "
            "the step). vLLM's batch does not hold the request's last accepted token where this proposer reads it; it "
            "was written for vLLM 0.32's V1 model runner."
        )
    return row


def _single_block_table(block_tables: Any) -> Any:
    """The `BlockTable` of the runner's only KV-cache group (`input_batch.block_table`, a `MultiGroupBlockTable`)."""
    groups = block_tables.block_tables
    if len(groups) != 1:
        raise RuntimeError(
            f"LongSparkProposer reads one KV-cache group (a target whose layers all use full attention), but this "
            f"engine has {len(groups)} KV-cache groups (a hybrid model: sliding-window, Mamba or other mixed layers "
            "keep their blocks in groups of their own). Serve a full-attention target."
        )
    return groups[0]


def eos_token_ids(model_config: Any) -> torch.LongTensor | None:
    """`(n,)` sorted token ids that end a request: the target's generation config's `eos_token_id` (vLLM adds those to
    every request's stop tokens) together with its model config's, or `None` if neither names one.

    `model_config` is vLLM's `ModelConfig`: `try_get_generation_config()` returns the non-default fields of the
    target's `generation_config.json` as a dict (`{}` without one), and `hf_config` is the target's config."""
    ids: set[int] = set()
    for value in (model_config.try_get_generation_config().get("eos_token_id"),
                  getattr(model_config.hf_config, "eos_token_id", None)):  # fmt: skip
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return torch.tensor(sorted(ids), dtype=torch.long) if ids else None


def _check_single_worker(parallel_config: Any) -> None:
    """Refuses engines that split the target across workers (vLLM's `ParallelConfig`)."""
    split = {name: getattr(parallel_config, name) for name in ("tensor_parallel_size", "pipeline_parallel_size")}
    split = {name: size for name, size in split.items() if size > 1}
    if split:
        settings = ", ".join(f"{name}={size}" for name, size in split.items())
        raise ValueError(
            f"LongSparkProposer needs one worker that holds the whole target, but this engine splits it ({settings}): "
            "a worker would hold only some KV heads (tensor parallel) or some layers (pipeline parallel) of the "
            "layers the drafter reads. Use tensor_parallel_size=1 and pipeline_parallel_size=1; to serve more "
            "requests, run data-parallel replicas (`data_parallel_size`) instead."
        )


def _check_full_attention(hf_config: Any, layer_ids: list[int]) -> None:
    """Refuses targets with sliding-window layers, whichever layers the drafter reads."""
    window, sliding = sliding_window_layers(hf_config)
    if not sliding:
        return
    read = [i for i in layer_ids if i in sliding]
    which = f"the drafter reads {read} of them" if read else "the drafter reads none of them"
    raise ValueError(
        f"LongSparkProposer does not serve sliding-window targets: layers {sliding} of this target attend to their "
        f"last {window} tokens only ({which}). vLLM's paged cache frees a sliding layer's blocks once they leave the "
        "window, so the rows are gone before the drafter's global summary absorbs them, and it keeps sliding layers "
        "in KV-cache groups of their own, while this proposer reads one group. Serve a full-attention target, or "
        "draft with transformers (`generate(assistant_model=drafter)`) using a drafter whose target_layer_ids are "
        "full-attention layers."
    )


def _eager_mode() -> int:
    """vLLM's `CompilationMode.NONE`; its value (an `IntEnum` 0) where vLLM is not installed (unit tests)."""
    try:
        from vllm.config import CompilationMode
    except ImportError:
        return 0
    return CompilationMode.NONE


def _check_eager(vllm_config: Any) -> None:
    if vllm_config.compilation_config.mode != _eager_mode():
        raise ValueError(
            "LongSparkProposer reads the target's hidden states with forward hooks, which torch.compile bypasses; "
            "create the engine with `enforce_eager=True`."
        )


def _find_runner(proposer: LongSparkProposer) -> Any:
    """The model runner that owns `proposer`, found among the callers of `proposer.load_model`.

    vLLM 0.32's V1 runner (`GPUModelRunner`, and `CPUModelRunner` which extends it) builds a `custom_class` proposer
    from the config alone (`create_custom_proposer(vllm_config)` in its `__init__`, stored as `runner.drafter`) and
    never hands it a reference to itself; `propose` gets token ids only. The one place the runner shows itself is its
    own `load_model`, which calls `self.drafter.load_model(self.model)`. So the runner is the `self` of the nearest
    calling frame (at most `RUNNER_SEARCH_DEPTH` up) whose `drafter` is this very proposer (identity: two engines in
    one process each find their own) and that has an `input_batch`. Nothing else is searched: where no caller
    qualifies, it raises rather than guess."""
    frame = sys._getframe(1).f_back  # the caller of `proposer.load_model`
    try:
        for _ in range(RUNNER_SEARCH_DEPTH):
            if frame is None:
                break
            candidate = frame.f_locals.get("self")
            if getattr(candidate, "drafter", None) is proposer and hasattr(candidate, "input_batch"):
                return candidate
            frame = frame.f_back
    finally:
        del frame  # frames hold their locals: do not keep them alive
    raise RuntimeError(
        "LongSparkProposer could not find vLLM's model runner: load_model must be called by the runner that holds "
        "this proposer as its `drafter` (vLLM 0.32's V1 model runner, `speculative_config.method='custom_class'`), "
        f"within {RUNNER_SEARCH_DEPTH} frames."
    )


def _target_modules(target_model: nn.Module, hf_config: Any, dtype: torch.dtype) -> TargetModules:
    """The transformers modules the drafter borrows, sharing the weights of vLLM's loaded target."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # only to learn the architecture's norm and rotary classes
        skeleton = AutoModelForCausalLM.from_config(hf_config).get_decoder()
    vocab_size = hf_config.vocab_size
    decoder = target_model.model
    embed_tokens = nn.Embedding.from_pretrained(decoder.embed_tokens.weight[:vocab_size], freeze=True)
    norm = type(skeleton.norm)(hf_config.hidden_size, eps=hf_config.rms_norm_eps).to(dtype)
    norm.weight.data = decoder.norm.weight.data
    head = getattr(target_model, "lm_head", None) or decoder.embed_tokens
    rotary_emb = type(skeleton.rotary_emb)(config=hf_config)
    return TargetModules(embed_tokens=embed_tokens, norm=norm, lm_head=_Weight(head.weight[:vocab_size]),
                         rotary_emb=rotary_emb, layers=decoder.layers)  # fmt: skip


__all__ = ["DRAFTER_ENV", "DRAFT_LOG_ENV", "LongSparkProposer", "eos_token_ids", "step_row"]
