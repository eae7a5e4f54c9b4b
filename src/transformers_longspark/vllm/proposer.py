"""`LongSparkProposer`: LongSpark drafting inside vLLM's speculative decoding (V1 model runner, `custom_class`).

    from vllm import LLM
    llm = LLM(target_dir, dtype="float32", enforce_eager=True, speculative_config={
        "method": "custom_class", "model": "transformers_longspark.vllm.LongSparkProposer",
        "num_speculative_tokens": 7})        # with LONGSPARK_DRAFTER=<drafter folder> in the environment

Per step, vLLM verifies the drafts of the last step, then calls `propose` with each running request's accepted
tokens. For every request that sampled, the proposer keeps a `LongSparkContextState` keyed by vLLM's request id and
does what the transformers loop does each round, with the same code (`drafting.py`): fold the request's new KV rows
into the global summary, take the recent window and the boundary states at the last accepted position; then one
drafter forward drafts a block for every such request. Only the place the rows come from differs: vLLM's paged KV
cache (`paged_kv.py`), and hooks on the target's decoder layers for the hidden states.

A request's state is created at its first sampled token (after its last prefill chunk: the prompt's rows are all in
the cache then) and dropped once the request leaves vLLM's batch (finished, preempted, or not scheduled in a step);
if it comes back, the state is rebuilt from its rows in the cache. Drafts are argmax tokens (vLLM's rejection
sampler takes custom drafts as one-hot proposals, which is exact under sampling too).

vLLM passes this interface neither request ids nor hidden states, so the proposer reads the model runner's batch
(`input_batch`, `query_start_loc`): the runner is found once, as the caller of `load_model`. This is vLLM's
experimental interface (0.32, V1 runner only); a production GPU path would be a proposer in the V2 runner.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..context_state import DraftContext, LongSparkContextState, stack_contexts
from ..drafting import draft_tokens, drafting_thresholds, read_draft_context
from ..modeling_longspark import LongSparkDrafterModel
from ..targets import TargetModules, check_target_compatible
from .paged_kv import PagedRequestRows

DRAFTER_ENV = "LONGSPARK_DRAFTER"
"""Environment variable naming the drafter folder (vLLM's `speculative_config.model` holds the class path)."""
DRAFT_LOG_ENV = "LONGSPARK_VLLM_DRAFT_LOG"
"""Optional: a JSONL file that receives one line per drafting round (request id, cache rows, anchor, drafts)."""


@dataclass
class ProposerStats:
    """Counters of one proposer (one vLLM worker)."""

    rounds: int = 0
    drafted_tokens: int = 0
    states_built: int = 0
    seconds: float = 0.0


class _Weight(nn.Module):
    """Holds the target's LM-head weight for the drafter (vLLM's head is not an `nn.Linear`)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight


class LongSparkProposer:
    """A vLLM `custom_class` proposer that drafts with a LongSpark drafter (one block per request and step).

    Args:
        vllm_config: vLLM's config. The drafter folder comes from the `LONGSPARK_DRAFTER` environment variable; the
            block length is `speculative_config.num_speculative_tokens`, at most the drafter's `block_size`.
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
        if not 1 <= self.num_tokens <= config.block_size:
            raise ValueError(
                f"num_speculative_tokens={self.num_tokens}, but the LongSpark drafter at {path} drafts blocks of at "
                f"most {config.block_size} tokens; use 1 <= num_speculative_tokens <= {config.block_size}."
            )
        _check_eager(vllm_config)
        self.vllm_config = vllm_config
        self.layer_ids = list(config.target_layer_ids)
        self.token_threshold, self.block_threshold = drafting_thresholds(self.drafter)
        eos = getattr(self.hf_config, "eos_token_id", None)
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_token_ids = torch.tensor(eos, dtype=torch.long) if eos else None
        self.states: dict[str, LongSparkContextState] = {}
        self.hidden_states: list[torch.Tensor | None] = [None] * len(self.layer_ids)
        self.runner = None
        self.stats = ProposerStats()
        self.draft_log = os.environ.get(DRAFT_LOG_ENV)

    def load_model(self, target_model: nn.Module) -> None:
        """Called by vLLM's CPU runner with the loaded target: binds the drafter to the target's embedding, final
        norm, LM head and rotary embedding, and hooks the selected decoder layers."""
        self.runner = _find_runner(self)
        self.drafter.bind_target(_target_modules(target_model, self.hf_config, self.dtype))
        layers = target_model.model.layers
        for slot, layer_id in enumerate(self.layer_ids):
            layers[layer_id].register_forward_hook(self._capture_hook(slot))

    def _capture_hook(self, slot: int):
        def hook(module, args, output):
            # vLLM's decoder layers return (mlp output, residual); the transformers hidden state is their sum. The
            # sum is a new tensor: the next layer's fused add-norm overwrites both in place.
            self.hidden_states[slot] = output[0] + output[1] if isinstance(output, tuple) else output.clone()

        return hook

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
        start = time.perf_counter()
        batch = self.runner.input_batch
        request_ids = list(batch.req_ids[: len(sampled_token_ids)])
        for request_id in set(self.states) - set(request_ids):  # finished, preempted or not scheduled
            del self.states[request_id]
        query_start = self.runner.query_start_loc.np
        kv_caches, block_table = self._kv_caches(), batch.block_table[0]  # one KV-cache group (full attention)
        drafting = [i for i in range(len(request_ids)) if sampled_token_ids[i]]  # the others are still in prefill
        contexts, anchors, lengths, built = [], [], [], []
        for i in drafting:
            num_rows = int(num_tokens_no_spec[i]) - 1  # the last sampled token (the anchor) has no KV row yet
            boundary_row = int(query_start[i]) + (num_rows - 1) - int(batch.num_computed_tokens_cpu[i])
            block_ids = block_table.block_table.np[i, : block_table.num_blocks_per_row[i]]
            rows = PagedRequestRows(kv_caches, block_ids, num_rows, self.dtype)
            context, new_state = self._context(request_ids[i], rows, boundary_row)
            contexts.append(context)
            anchors.append(int(token_ids_cpu[i, num_rows]))
            lengths.append(num_rows)
            built.append(new_state)
        drafts: list[list[int]] = [[] for _ in request_ids]
        if drafting:
            blocks = self._draft_blocks(stack_contexts(contexts), anchors)
            for i, block, anchor, num_rows, new_state in zip(drafting, blocks, anchors, lengths, built):
                drafts[i] = block
                self._log(request_ids[i], num_rows, anchor, block, new_state)
        self.stats.seconds += time.perf_counter() - start
        return drafts

    def _context(self, request_id: str, rows: PagedRequestRows, boundary_row: int) -> tuple[DraftContext, bool]:
        """This round's context of one request whose cache holds `rows` (its boundary is row `boundary_row` of the
        step's forward), and whether its state was (re)built."""
        config = self.drafter.config
        state = self.states.get(request_id)
        built = state is None or state.num_absorbed > rows.num_rows
        if built:
            state = self.states[request_id] = LongSparkContextState(config.num_draft_layers, config.summary_chunk_size)
            self.stats.states_built += 1
        state.boundary_states = torch.cat([h[boundary_row] for h in self.hidden_states])[None].to(self.dtype)
        return read_draft_context(self.drafter, state, rows, rows.num_rows), built

    def _draft_blocks(self, context: DraftContext, anchors: list[int]) -> list[list[int]]:
        """One drafter forward for every request: a block after each anchor."""
        n = len(anchors)
        sequences = torch.tensor([[anchor] + [0] * self.num_tokens for anchor in anchors])
        rows, ones = torch.arange(n), torch.ones(n, dtype=torch.long)
        tokens, _, num_drafted = draft_tokens(
            self.drafter, context, sequences, rows, ones, ones * self.num_tokens, None, False,
            self.token_threshold, self.eos_token_ids, self.block_threshold,
        )  # fmt: skip
        blocks = [tokens[r, : int(num_drafted[r])].tolist() for r in range(n)]
        self.stats.rounds += n
        self.stats.drafted_tokens += sum(map(len, blocks))
        return blocks

    def _log(self, request_id: str, num_rows: int, anchor: int, drafts: list[int], built: bool) -> None:
        if self.draft_log:
            with open(self.draft_log, "a") as log:
                log.write(json.dumps({"request_id": request_id, "num_rows": num_rows, "anchor": anchor,
                                      "drafts": drafts, "state_built": built}) + "\n")  # fmt: skip

    def _kv_caches(self) -> dict[int, tuple[torch.Tensor, str]]:
        """Target layer index -> (its KV-cache tensor, layout), read at each step (vLLM binds caches after load).
        `unpack_blocks` refuses layouts it cannot read, naming them."""
        context = self.vllm_config.compilation_config.static_forward_context
        attention = {i: context[f"model.layers.{i}.self_attn.attn"] for i in self.layer_ids}
        return {i: (layer.kv_cache, getattr(layer, "isa", None)) for i, layer in attention.items()}


@dataclass
class _ConfigOnly:
    """What `check_target_compatible` reads of a target, for a vLLM model."""

    config: Any
    name_or_path: str


def _check_eager(vllm_config: Any) -> None:
    from vllm.config import CompilationMode

    if vllm_config.compilation_config.mode != CompilationMode.NONE:
        raise ValueError(
            "LongSparkProposer reads the target's hidden states with forward hooks, which torch.compile bypasses; "
            "create the engine with `enforce_eager=True`."
        )


def _find_runner(proposer: LongSparkProposer) -> Any:
    """The model runner whose `drafter` is `proposer`: the caller of `load_model`, else found among live objects."""
    caller = sys._getframe(2).f_locals.get("self")
    if getattr(caller, "drafter", None) is proposer:
        return caller
    for candidate in gc.get_objects():
        if getattr(candidate, "drafter", None) is proposer and hasattr(candidate, "input_batch"):
            return candidate
    raise RuntimeError("LongSparkProposer could not find vLLM's model runner; it needs vLLM's V1 model runner.")


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


__all__ = ["DRAFTER_ENV", "DRAFT_LOG_ENV", "LongSparkProposer", "ProposerStats"]
