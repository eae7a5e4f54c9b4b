"""`LongSparkProposer` against a fake vLLM model runner (`vllm_fakes.py`), without vLLM: its drafts.

The drafts it returns for each request must equal the transformers path's for that request alone, lookup rounds
included, whatever the request's place in the batch. The hidden states the proposer's hooks compose from vLLM-style
decoder layers (`(mlp output, residual)` pairs, buffers overwritten in place by the next layer) are checked against
the transformers target's, without vLLM too. What it cannot serve is refused by name: `test_vllm_proposer_checks.py`.
"""

from __future__ import annotations

import json

import pytest
import torch

from vllm_fakes import FakeRunner, Scheduled, make_served, run_steps, run_target, write_step


@pytest.fixture
def served(tmp_path, monkeypatch):
    return make_served(tmp_path, monkeypatch)


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
