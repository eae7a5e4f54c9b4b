"""`LongSparkProposer` against a fake vLLM model runner, without vLLM.

The fake holds what the proposer reads of vLLM 0.32's V1 runner: the batch (`input_batch`: request ids in batch order,
computed tokens, the block table of one KV-cache group), `query_start_loc`, the paged KV cache (written with the
reference packer of `test_vllm.py`, rejected drafts' rows left in it as noise) and the step's hidden states. The
drafts it returns for each request must equal the transformers path's for that request alone: the same target rows
in a `DynamicCache`, the same boundary states, a `DraftSession`'s `read_context` + `propose` with a state (and,
with lookup on, a lookup index) kept per request. What it cannot serve is refused by name. The hidden states the
proposer's hooks compose from vLLM-style decoder layers (`(mlp output, residual)` pairs, buffers overwritten in place
by the next layer) are checked against the transformers target's, without vLLM too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import make_drafter, make_target, pack_blocks
from transformers_longspark.context_state import LongSparkContextState, boundary_states
from transformers_longspark.inference.drafting import DraftRequests, DraftSettings
from transformers_longspark.inference.planning import RoundPlanner
from transformers_longspark.inference.session import DraftSession
from transformers_longspark.targets import HiddenStateCapture
from transformers_longspark.vllm import DRAFT_LOG_ENV, DRAFTER_ENV, LongSparkProposer
from transformers_longspark.vllm.proposer import eos_token_ids, step_row

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
    context = session.read_context(request.state, cache, num_rows)
    sequences = torch.tensor([request.tokens[: num_rows + 1] + [0] * NUM_SPECULATIVE])
    row = torch.zeros(1, dtype=torch.long)
    requests = DraftRequests(sequences, row, lengths=row + num_rows + 1, room=row + NUM_SPECULATIVE)
    proposal = session.propose(context, requests, session.plan(requests, [request.planner]))
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


@pytest.fixture
def served(tmp_path, monkeypatch):
    return make_served(tmp_path, monkeypatch)


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


def test_drafts_equal_the_transformers_path_per_request(served):
    """Two steps, batch order permuted against insertion order and between steps: a prefill chunk, a last prefill
    chunk, decodes with rejected drafts in the cache, a request that left. Mixed-up requests, rows or boundary
    states (the requests' prompts and so their drafts differ) would change some request's drafts."""
    a, b, c, d = (served.requests[name] for name in "abcd")
    rounds = run_steps(served, [
        [Scheduled(c, 0, 16, None), Scheduled(a, 20, 5, 23), Scheduled(d, 30, 5, 35), Scheduled(b, 16, 21, 37)],
        [Scheduled(b, 37, 5, 38), Scheduled(c, 16, 10, 26), Scheduled(a, 23, 5, 28)],  # d left; a's state is kept
    ])  # fmt: skip
    assert served.proposer.states_built == 4  # a, d, b in step 1, c in step 2; a and b were kept
    assert not any(r.from_lookup for r in rounds) and served.proposer.stats.lookup_rounds == 0


def test_lookup_and_drafted_proposals_equal_the_transformers_path(tmp_path, monkeypatch):
    """With lookup on (`lookup_min_match=2`, continuations of up to 6 tokens, cut to the 4 vLLM verifies): requests
    whose suffix occurred before take the lookup continuation, the others a drafted block, both in one step; a
    request switches from drafting to lookup once its text repeats; one leaves and comes back (state and index
    rebuilt from its whole history); one's rows go back. Each request's proposal and its source equal the
    transformers path's, and the draft log names the source of each round."""
    served = make_served(tmp_path, monkeypatch, lookup_min_match=2, lookup_num_tokens=6)
    a, b, e, f = (served.requests[name] for name in "abef")
    rounds = run_steps(served, [
        [Scheduled(e, 0, 22, 22), Scheduled(a, 20, 5, 23), Scheduled(f, 0, 20, 20)],  # e drafts (random so far)
        [Scheduled(a, 23, 5, 26), Scheduled(e, 22, 5, 27), Scheduled(b, 0, 30, 30)],  # e repeats; f leaves
        [Scheduled(f, 0, 33, 33), Scheduled(e, 27, 5, 31), Scheduled(a, 26, 5, 27)],  # f back: rebuilt
    ])  # fmt: skip
    # e's rows go back (its state has absorbed more than its cache now holds): state and index are rebuilt; b is back.
    e.state = e.planner = None
    rounds += run_steps(served, [[Scheduled(e, 20, 5, 24), Scheduled(b, 30, 5, 32)]])
    sources = [r.from_lookup for r in rounds]
    assert sources == [False, False, True, False, True, False, True, True, False, True, False]
    assert served.proposer.stats.lookup_rounds == 5 and served.proposer.states_built == 7
    log = [json.loads(line) for line in served.log.read_text().splitlines()]
    assert [entry["source"] == "lookup" for entry in log] == sources
    built = [entry["request_id"][4:] for entry in log if entry["state_built"]]
    assert built == ["e", "a", "f", "b", "f", "e", "b"]


def test_boundary_row_outside_the_request_slice_is_refused(served):
    a, b = served.requests["a"], served.requests["b"]
    scheduled = [Scheduled(b, 16, 21, 37), Scheduled(a, 20, 5, 23)]
    arguments, _ = write_step(served.proposer, served.runner, served.target, served.drafter, scheduled)
    served.runner.input_batch.num_computed_tokens_cpu[1] = 25  # a's boundary 22 would be row 21 + 22 - 25 = 18: b's
    with pytest.raises(RuntimeError, match=r"position 22 of request 'req-a' is row 18 .* rows \[21, 26\)"):
        served.proposer.propose(*arguments)


def test_step_row():
    assert step_row("r", 22, 20, 21, 26) == 23
    for position in (19, 25):  # before the step, and past the rows it ran
        with pytest.raises(RuntimeError, match="request 'r'"):
            step_row("r", position, 20, 21, 26)


def test_several_kv_cache_groups_are_refused(served):
    a = served.requests["a"]
    arguments, _ = write_step(served.proposer, served.runner, served.target, served.drafter, [Scheduled(a, 20, 5, 23)])
    groups = served.runner.input_batch.block_table.block_tables
    groups.append(groups[0])  # e.g. a hybrid model's sliding-window layers
    with pytest.raises(RuntimeError, match=r"reads one KV-cache group .* has 2 KV-cache groups"):
        served.proposer.propose(*arguments)


class WrappingRunner(FakeRunner):
    """A runner whose `load_model` reaches the proposer's through a helper function (a frame without `self`)."""

    def load_model(self) -> None:
        load_drafter(self.drafter, self.model)


def load_drafter(proposer: LongSparkProposer, model: torch.nn.Module) -> None:
    proposer.load_model(model)


def test_runner_is_the_caller_that_owns_the_proposer(served):
    """Two engines in one process: each proposer binds to its own runner (also through a helper frame); a caller
    that is no runner is refused."""
    other = LongSparkProposer(fake_vllm_config(served.target.config))
    other_runner = WrappingRunner(other, served.target)
    other_runner.load_model()
    assert other.runner is other_runner and served.proposer.runner is served.runner
    stray = LongSparkProposer(fake_vllm_config(served.target.config))
    with pytest.raises(RuntimeError, match="could not find vLLM's model runner"):
        stray.load_model(served.target)  # not called by a runner (the served runner's drafter is another proposer)
    with pytest.raises(RuntimeError, match="before load_model"):
        stray.propose([], None, None)


@pytest.fixture
def saved_drafter(tmp_path, monkeypatch):
    target = make_target("qwen3")
    make_drafter(target).save_pretrained(tmp_path)
    monkeypatch.setenv(DRAFTER_ENV, str(tmp_path))
    return target


@pytest.mark.parametrize(("options", "setting"), [
    (dict(tensor_parallel=2), "tensor_parallel_size=2"),
    (dict(pipeline_parallel=4), "pipeline_parallel_size=4"),
    (dict(tensor_parallel=2, pipeline_parallel=2), "tensor_parallel_size=2, pipeline_parallel_size=2"),
])  # fmt: skip
def test_parallel_targets_are_refused(saved_drafter, options, setting):
    with pytest.raises(ValueError, match=rf"splits it \({setting}\).*data_parallel_size"):
        LongSparkProposer(fake_vllm_config(saved_drafter.config, **options))


@pytest.mark.parametrize(("layer_types", "message"), [
    (["full_attention", "full_attention", "sliding_attention", "sliding_attention"], r"\[2, 3\] of them"),
    (["full_attention", "sliding_attention", "full_attention", "full_attention"], "none of them"),
])  # fmt: skip
def test_sliding_window_targets_are_refused(saved_drafter, layer_types, message):
    """The drafter reads layers [0, 2, 3]; a sliding layer anywhere is refused (its own KV-cache group)."""
    sliding = make_target("qwen3", sliding_window=16, use_sliding_window=True, layer_types=layer_types).config
    pattern = rf"sliding-window targets: layers .* last 16 tokens only \(the drafter reads {message}\)"
    with pytest.raises(ValueError, match=pattern):
        LongSparkProposer(fake_vllm_config(sliding))


def test_compiled_targets_are_refused(saved_drafter):
    with pytest.raises(ValueError, match="enforce_eager=True"):
        LongSparkProposer(fake_vllm_config(saved_drafter.config, mode=3))  # CompilationMode.VLLM_COMPILE


def test_eos_ids_come_from_the_generation_config_and_the_model_config(saved_drafter):
    def model_config(generation_eos, config_eos):
        hf_config = SimpleNamespace(eos_token_id=config_eos)
        return SimpleNamespace(hf_config=hf_config, try_get_generation_config=lambda: {"eos_token_id": generation_eos})

    assert eos_token_ids(model_config([7, 5], 2)).tolist() == [2, 5, 7]
    assert eos_token_ids(model_config(9, None)).tolist() == [9]
    assert eos_token_ids(model_config(None, [3, 4])).tolist() == [3, 4]
    assert eos_token_ids(model_config(None, None)) is None
    proposer = LongSparkProposer(fake_vllm_config(saved_drafter.config, generation_config={"eos_token_id": [11, 12]}))
    assert proposer.settings.eos_token_ids.tolist() == [11, 12]  # the target's config names none (make_target)


def test_lookup_continuations_may_be_longer_than_drafted_blocks(tmp_path, monkeypatch):
    """vLLM verifies up to `num_speculative_tokens` per step: with lookup on, up to the longer of the block size (4)
    and `lookup_num_tokens` (6); more is refused, naming the limit."""
    target = make_target("qwen3")
    drafter = make_drafter(target)
    drafter.generation_config.lookup_min_match, drafter.generation_config.lookup_num_tokens = 2, 6
    drafter.save_pretrained(tmp_path)
    monkeypatch.setenv(DRAFTER_ENV, str(tmp_path))
    assert LongSparkProposer(fake_vllm_config(target.config, num_speculative=6)).num_tokens == 6
    with pytest.raises(ValueError, match=r"num_speculative_tokens=7, .* proposes at most 6 tokens \(blocks of 4"):
        LongSparkProposer(fake_vllm_config(target.config, num_speculative=7))


# --- the hidden states as vLLM's decoder layers return them -----------------------------------------------------


class VllmStyleLayer(torch.nn.Module):
    """A transformers decoder layer behind vLLM's interface: `(positions, hidden_states, residual)` in, over the step's
    flattened tokens `(num_tokens, hidden)`. With `split`, it returns `(mlp output, residual)`, whose sum is the
    transformers hidden state, and the next layer's fused add-norm adds the pair into `residual` and writes the normed
    input over `hidden_states`, both in place (vLLM's `fused_add_rms_norm`); else it returns the hidden state, and the
    next layer reuses that buffer (overwrites it) once it has read it."""

    def __init__(self, layer, rotary_emb, split: bool):
        super().__init__()
        self.layer, self.rotary_emb, self.split = layer, rotary_emb, split

    def forward(self, positions, hidden_states, residual=None):
        if self.split and residual is not None:
            residual.add_(hidden_states)
            hidden_states.zero_()  # stands for the normed input written in place
            hidden_in = residual.clone()
        else:
            hidden_in = hidden_states.clone()
            hidden_states.zero_()
        x, position_ids = hidden_in[None], positions[None]
        out = self.layer(x, position_ids=position_ids, position_embeddings=self.rotary_emb(x, position_ids))[0]
        return (out - hidden_in, hidden_in) if self.split else out


class VllmStyleModel(torch.nn.Module):
    """What `LongSparkProposer.load_model` reads of vLLM's loaded target (`model.layers`, `model.embed_tokens`,
    `model.norm`, `lm_head`), sharing a transformers target's weights; its layers are `VllmStyleLayer`s."""

    def __init__(self, target, split: bool):
        super().__init__()
        self.split = split
        self.model = torch.nn.Module()
        self.model.embed_tokens, self.model.norm = target.model.embed_tokens, target.model.norm
        layers = [VllmStyleLayer(layer, target.model.rotary_emb, split) for layer in target.model.layers]
        self.model.layers = torch.nn.ModuleList(layers)
        self.lm_head = target.lm_head

    def forward(self, input_ids: torch.LongTensor) -> None:
        positions = torch.arange(len(input_ids))
        hidden, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            if self.split:
                hidden, residual = layer(positions, hidden, residual)
            else:
                hidden = layer(positions, hidden)
        if self.split:  # the final norm's fused add, in place
            residual.add_(hidden)
        hidden.zero_()


@pytest.mark.parametrize("split", [True, False], ids=["mlp-output-and-residual", "hidden-state"])
def test_hidden_states_of_vllm_style_layers_are_the_transformers_ones(served, split):
    """The proposer's hooks on vLLM-style layers (`load_model`) compose each selected layer's transformers hidden
    state, and keep it although the next layers overwrite their inputs in place: a one-chunk prefill of request `a`
    that samples, through the vLLM-style model's forward, gives the hidden states of the target alone, and the
    proposer's drafts are the transformers path's."""
    a = served.requests["a"]
    model = VllmStyleModel(served.target, split)
    runner = FakeRunner(served.proposer, model)
    runner.load_model()
    scheduled = [Scheduled(a, 0, 23, 23)]
    arguments, references = write_step(served.proposer, runner, served.target, served.drafter, scheduled)
    _, hidden = run_target(served.target, served.proposer.layer_ids, a.tokens[:23])
    with torch.inference_mode():
        model(torch.tensor(a.tokens[:23]))  # the step's forward: its hooks replace the states write_step laid out
    for captured, expected in zip(served.proposer.capture.states, hidden, strict=True):
        torch.testing.assert_close(captured, expected, rtol=1e-5, atol=1e-5)
    assert served.proposer.propose(*arguments) == [references[0].drafts]
