"""A fake vLLM model runner for `LongSparkProposer`'s tests (`test_vllm_proposer*.py`), without vLLM.

The fake holds what the proposer reads of vLLM 0.32's V1 runner: the batch (`input_batch`: request ids in batch order,
computed tokens, the block table of one KV-cache group), `query_start_loc`, the paged KV cache (written with the
reference packer `helpers.pack_blocks`, rejected drafts' rows left in it as noise) and the step's hidden states. For
each request, the reference is the transformers path's drafts for that request alone: the same target rows in a
`DynamicCache`, the same boundary states, a `DraftSession`'s `read_context` + `propose` with a state (and, with lookup
on, a lookup index) kept per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace

import numpy as np
import torch

from helpers import make_drafter, make_target, pack_blocks
from transformers_longspark.context_state import LongSparkContextState, boundary_states
from transformers_longspark.inference.drafting import DraftRequests, DraftSettings
from transformers_longspark.inference.planning import RoundPlanner
from transformers_longspark.inference.session import DraftSession
from transformers_longspark.targets import HiddenStateCapture
from transformers_longspark.vllm import DRAFT_LOG_ENV, DRAFTER_ENV, LongSparkProposer

BLOCK = 16  # rows per paged-cache block
NUM_BLOCKS = 24  # physical blocks of the fake cache
MAX_REQS, MAX_LEN = 6, 64  # the runner's preallocated batch rows and token columns
NUM_SPECULATIVE = 4


def fake_vllm_config(
    hf_config, tensor_parallel=1, pipeline_parallel=1, mode=0, generation_config=None, num_speculative=NUM_SPECULATIVE
):
    """The attributes of vLLM's `VllmConfig` that the proposer reads (KV caches are bound later, as in vLLM)."""
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf_config, dtype=torch.float32, model="target",
                                     try_get_generation_config=lambda: dict(generation_config or {})),
        speculative_config=SimpleNamespace(num_speculative_tokens=num_speculative),
        compilation_config=SimpleNamespace(mode=mode, static_forward_context={}),
        parallel_config=SimpleNamespace(tensor_parallel_size=tensor_parallel, pipeline_parallel_size=pipeline_parallel),
    )  # fmt: skip


class FakeRunner:
    """vLLM's model runner as the proposer sees it: it owns the proposer (`drafter`) and calls its `load_model`."""

    def __init__(self, proposer: LongSparkProposer, model: torch.nn.Module):
        self.drafter, self.model = proposer, model
        self.input_batch = self.query_start_loc = None

    def load_model(self) -> None:
        self.drafter.load_model(self.model)


@dataclass
class Request:
    """One request: its true tokens, its physical cache blocks, and the transformers path's state and source choice
    (the reference)."""

    request_id: str
    tokens: list[int]
    block_ids: list[int]
    state: LongSparkContextState | None = field(default=None, repr=False)
    planner: RoundPlanner | None = field(default=None, repr=False)


@dataclass
class Reference:
    """The transformers path's proposal for one request and round, and whether it is the lookup continuation."""

    drafts: list[int]
    from_lookup: bool


@dataclass
class Scheduled:
    """A request in one step: the forward ran its positions `[num_computed, num_computed + num_scheduled)`; after
    sampling it holds `num_rows` valid cache rows and a sampled token at position `num_rows` (`None`: still in
    prefill). Rows in `[num_rows, num_computed + num_scheduled)` are rejected drafts: noise in the fake cache."""

    request: Request
    num_computed: int
    num_scheduled: int
    num_rows: int | None

    @property
    def end(self) -> int:
        return self.num_computed + self.num_scheduled


def run_target(target, layer_ids: list[int], tokens: list[int]):
    """The target alone on `tokens`: its `DynamicCache`, and each selected layer's outputs `(len(tokens), hidden)`."""
    capture = HiddenStateCapture(target.model.layers, layer_ids, keep=None)
    with torch.no_grad():
        cache = target(torch.tensor([tokens]), use_cache=True).past_key_values
    capture.remove()
    return cache, [state[0] for state in capture.states]


def transformers_drafts(drafter, request: Request, cache, hidden: list[torch.Tensor], num_rows: int) -> Reference:
    """The transformers path's round for one request alone, as `generation.py` runs it: its state absorbs the cache
    (boundary at the last row), its lookup index reads the request's tokens up to the anchor from the sequence."""
    session = DraftSession(drafter, drafter.target, DraftSettings.from_drafter(drafter), capture=False)
    if request.state is None:
        request.state, request.planner = session.new_state(), session.new_planner()
    request.state.boundary_states = boundary_states([h[None] for h in hidden], torch.tensor([num_rows - 1]))
    sequences = torch.tensor([request.tokens[: num_rows + 1] + [0] * NUM_SPECULATIVE])
    row = torch.zeros(1, dtype=torch.long)
    requests = DraftRequests(sequences, row, lengths=row + num_rows + 1, room=row + NUM_SPECULATIVE)
    read_context = partial(session.read_context, request.state, cache, num_rows)
    proposal = session.draft_round(requests, [request.planner], read_context)
    return Reference(proposal.tokens[0, : int(proposal.num_drafted[0])].tolist(), bool(proposal.from_lookup[0]))


def fake_block_table(scheduled: list[Scheduled]) -> SimpleNamespace:
    """vLLM's `MultiGroupBlockTable` with one group: `block_table.np` `(MAX_REQS, max blocks)`, `num_blocks_per_row`."""
    table = np.zeros((MAX_REQS, MAX_LEN // BLOCK), dtype=np.int32)
    counts = np.zeros(MAX_REQS, dtype=np.int32)
    for i, s in enumerate(scheduled):
        counts[i] = math.ceil(s.end / BLOCK)
        table[i, : counts[i]] = s.request.block_ids[: counts[i]]
    group = SimpleNamespace(block_table=SimpleNamespace(np=table), num_blocks_per_row=counts)
    return SimpleNamespace(block_tables=[group])


def write_step(proposer, runner, target, drafter, scheduled: list[Scheduled]):
    """Lays one step out as vLLM would (batch, paged cache, the forward's hidden states) and returns the arguments of
    `propose`, with each request's reference drafts (`None` for a request still in prefill)."""
    layer_ids, noise = proposer.layer_ids, torch.Generator().manual_seed(7)
    kv_caches = {i: proposer.vllm_config.compilation_config.static_forward_context[f"model.layers.{i}.self_attn.attn"]
                 .kv_cache for i in layer_ids}  # fmt: skip
    step_hidden, query_start, references = [[] for _ in layer_ids], [0], []
    token_ids = np.zeros((MAX_REQS, MAX_LEN), dtype=np.int32)
    num_tokens_no_spec, num_computed = np.zeros(MAX_REQS, dtype=np.int32), np.zeros(MAX_REQS, dtype=np.int32)
    for i, s in enumerate(scheduled):
        valid = s.end if s.num_rows is None else s.num_rows
        cache, hidden = run_target(target, layer_ids, s.request.tokens[:valid])
        num_blocks = math.ceil(s.end / BLOCK)
        for slot, layer_id in enumerate(layer_ids):
            keys, values = (torch.cat([t[0], torch.randn(*t.shape[1:2], num_blocks * BLOCK - valid, t.shape[3],
                                                         generator=noise)], dim=1)
                            for t in (cache.layers[layer_id].keys, cache.layers[layer_id].values))  # fmt: skip
            kv_caches[layer_id][s.request.block_ids[:num_blocks]] = pack_blocks(keys, values, "vec", BLOCK)
            rejected = torch.randn(s.end - valid, hidden[slot].shape[-1], generator=noise)
            step_hidden[slot].append(torch.cat([hidden[slot][s.num_computed : valid], rejected]))
        query_start.append(query_start[-1] + s.num_scheduled)
        known = valid if s.num_rows is None else s.num_rows + 1
        token_ids[i, :known], num_tokens_no_spec[i], num_computed[i] = s.request.tokens[:known], known, s.num_computed
        references.append(None if s.num_rows is None else transformers_drafts(drafter, s.request, cache, hidden, valid))
    # The forward's rows, padded as vLLM pads a step's tokens; set after the reference forwards (the hooks fire there).
    proposer.capture.states[:] = [torch.cat([*rows, torch.randn(3, rows[0].shape[-1], generator=noise)])
                                 for rows in step_hidden]  # fmt: skip
    runner.input_batch = SimpleNamespace(
        req_ids=[s.request.request_id for s in scheduled], num_computed_tokens_cpu=num_computed,
        block_table=fake_block_table(scheduled), num_tokens_no_spec=num_tokens_no_spec, token_ids_cpu=token_ids,
    )  # fmt: skip
    runner.query_start_loc = SimpleNamespace(np=np.array(query_start + [query_start[-1]] * (MAX_REQS - len(scheduled))))
    sampled = [[] if s.num_rows is None else s.request.tokens[s.num_rows : s.num_rows + 1] for s in scheduled]
    return (sampled, num_tokens_no_spec, token_ids), references


def make_served(tmp_path, monkeypatch, **generation_config) -> SimpleNamespace:
    """A tiny target, a drafter saved where `LONGSPARK_DRAFTER` points (with `generation_config` set), a proposer
    bound to a fake runner that logs its rounds (`DRAFT_LOG_ENV`), and six requests: `a` to `d` random, `e` random
    then repeating its tokens 10-23 (period 14), `f` periodic from the start (period 6)."""
    target = make_target("qwen3")
    drafter = make_drafter(target)
    drafter.generation_config.assistant_confidence_threshold = 0.0  # whole blocks: more tokens to compare
    for name, value in generation_config.items():
        setattr(drafter.generation_config, name, value)
    with torch.no_grad():  # a trained drafter's Markov correction is not zero: the anchor then shapes the drafts
        drafter.markov_proj.weight.normal_(std=1.0, generator=torch.Generator().manual_seed(5))
    folder = tmp_path / "drafter"
    drafter.save_pretrained(folder)
    monkeypatch.setenv(DRAFTER_ENV, str(folder))
    monkeypatch.setenv(DRAFT_LOG_ENV, str(tmp_path / "drafts.jsonl"))
    drafter.bind_target(target)
    proposer = LongSparkProposer(fake_vllm_config(target.config))
    config = target.config
    shape = (NUM_BLOCKS, config.num_key_value_heads, BLOCK, 2 * config.head_dim)
    proposer.vllm_config.compilation_config.static_forward_context.update(
        {f"model.layers.{i}.self_attn.attn": SimpleNamespace(kv_cache=torch.zeros(shape), isa="vec")
         for i in proposer.layer_ids})  # fmt: skip
    runner = FakeRunner(proposer, target)
    runner.load_model()
    blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3)).tolist()
    seeds = [torch.Generator().manual_seed(10 + n) for n in range(6)]
    tokens = [torch.randint(config.vocab_size, (MAX_LEN,), generator=seed).tolist() for seed in seeds]
    tokens[4] = tokens[4][:24] + [tokens[4][10 + k % 14] for k in range(MAX_LEN - 24)]
    tokens[5] = [tokens[5][k % 6] for k in range(MAX_LEN)]
    requests = {name: Request(f"req-{name}", tokens[n], blocks[4 * n : 4 * n + 4]) for n, name in enumerate("abcdef")}
    served = SimpleNamespace(target=target, drafter=drafter, proposer=proposer, runner=runner, requests=requests)
    served.log = tmp_path / "drafts.jsonl"
    return served


def run_steps(served, steps: list[list[Scheduled]]) -> list[Reference]:
    """Runs the steps through the proposer; each request's proposal must equal the transformers path's (whole
    blocks of distinct drafts), and the proposer keeps the state (and lookup index) of exactly the requests that
    sampled. Returns the references of all rounds, in order."""
    rounds = []
    for scheduled in steps:
        arguments, references = write_step(served.proposer, served.runner, served.target, served.drafter, scheduled)
        drafts = served.proposer.propose(*arguments)
        assert drafts == [[] if r is None else r.drafts for r in references]
        drafted = [tuple(r.drafts) for r in references if r is not None]
        assert all(len(r) == NUM_SPECULATIVE for r in drafted) and len(set(drafted)) == len(drafted)
        sampled = {s.request.request_id for s in scheduled if s.num_rows is not None}
        assert set(served.proposer.states) == sampled
        assert set(served.proposer.planners) == sampled
        assert all((p.lookup is not None) == served.proposer.lookup_on for p in served.proposer.planners.values())
        rounds += [r for r in references if r is not None]
    return rounds
