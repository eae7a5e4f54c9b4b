"""Assisted generation with a LongSpark drafter is lossless: greedy equality, and the exact law when sampling."""

from dataclasses import replace

import pytest
import torch
from transformers import TextStreamer
from transformers.generation import utils as generation_utils

from helpers import (
    LAW_VOCAB,
    chi_square_pvalue,
    exact_law,
    greedy_pair,
    make_bigram_target,
    make_drafter,
    make_oracle_drafter,
    make_target,
    sampled_counts,
    spy_on_verifier,
)

WINDOW, BLOCK = 8, 4


@pytest.mark.parametrize("prompt_length", [3, WINDOW, WINDOW + 1, 5 * WINDOW])
@pytest.mark.parametrize("max_new_tokens", [1, 2, BLOCK, BLOCK + 1, 40])
def test_greedy_equals_target_with_random_drafter(target_kind, prompt_length, max_new_tokens):
    target = make_target(target_kind)
    drafter = make_drafter(target, window_size=WINDOW, block_size=BLOCK)
    prompt = torch.randint(0, 64, (1, prompt_length), generator=torch.Generator().manual_seed(prompt_length))
    reference, assisted = greedy_pair(target, drafter, prompt, max_new_tokens=max_new_tokens)
    assert torch.equal(reference, assisted)
    assert assisted.shape[1] == prompt_length + max_new_tokens


@pytest.mark.parametrize("agree_on", [None, lambda ids: ids % 3 != 0], ids=["full", "partial"])
@pytest.mark.parametrize("max_new_tokens", [1, 2, BLOCK, BLOCK + 1, 30])
def test_greedy_equals_target_when_drafts_are_accepted(target_kind, agree_on, max_new_tokens):
    target = make_bigram_target(target_kind, vocab_size=64, seed=2)
    drafter = make_oracle_drafter(target, agree_on=agree_on, window_size=WINDOW, block_size=BLOCK)
    prompt = torch.tensor([[5, 9, 28]])
    reference, assisted = greedy_pair(target, drafter, prompt, max_new_tokens=max_new_tokens)
    assert torch.equal(reference, assisted)
    stats = drafter.drafting_stats
    if agree_on is None and max_new_tokens == 30:
        assert (max_new_tokens - 1) / stats.rounds > BLOCK  # whole blocks are accepted


def test_eos_inside_a_drafted_block(target_kind):
    target = make_bigram_target(target_kind, vocab_size=64, seed=2)
    drafter = make_oracle_drafter(target, window_size=WINDOW, block_size=BLOCK)
    prompt = torch.tensor([[5, 9, 28]])
    chain = target.generate(prompt, max_new_tokens=8, do_sample=False)[0, 3:].tolist()
    assert len(set(chain[:4])) == 4, "the test needs a greedy chain without early repeats"
    eos = chain[2]  # first generated token comes from prefill; the first block drafts chain[1], chain[2]=EOS, ...
    reference, assisted = greedy_pair(target, drafter, prompt, max_new_tokens=20, eos_token_id=eos)
    assert torch.equal(reference, assisted)
    assert assisted[0, -1].item() == eos and assisted.shape[1] == 3 + 3
    assert drafter.drafting_stats.drafted_tokens == 2  # the block was cut at the EOS


def test_streamer_and_dict_outputs():
    target = make_bigram_target("qwen3", vocab_size=64, seed=2)
    drafter = make_oracle_drafter(target, agree_on=lambda ids: ids % 2 == 0, block_size=BLOCK)
    prompt = torch.tensor([[5, 9, 28]])

    class Collect(TextStreamer):
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens += value.flatten().tolist()

        def end(self):
            pass

    streamer = Collect()
    kwargs = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True)
    reference = target.generate(prompt, **kwargs)
    assisted = target.generate(prompt, assistant_model=drafter, streamer=streamer, **kwargs)
    assert torch.equal(reference.sequences, assisted.sequences)
    assert streamer.tokens == assisted.sequences[0].tolist()
    assert len(assisted.scores) == 12
    for ref_scores, scores in zip(reference.scores, assisted.scores):
        torch.testing.assert_close(ref_scores, scores, rtol=1e-4, atol=1e-4)


def test_generation_without_a_longspark_drafter_is_unchanged(monkeypatch):
    """With the generate() hook installed (a LongSpark drafter on the same target is routed to its candidate
    generator), plain `generate` makes no candidate generator and prompt lookup keeps transformers' own."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
    from transformers.generation.utils import GenerationMixin

    from transformers_longspark.inference.generation import LongSparkCandidateGenerator

    made = []
    routed = GenerationMixin._get_candidate_generator

    def spy(self, *args, **kwargs):
        made.append(routed(self, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", spy)
    target = make_target("llama")
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    plain = target.generate(prompt, max_new_tokens=8, do_sample=False)
    assert made == []
    lookup = target.generate(prompt, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3)
    assisted = target.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=make_drafter(target))
    assert torch.equal(plain, lookup) and torch.equal(plain, assisted)
    assert [type(generator) for generator in made] == [PromptLookupCandidateGenerator, LongSparkCandidateGenerator]


def test_draft_logits_are_the_distributions_the_candidates_were_sampled_from(monkeypatch):
    """With every sampling option on, the logits handed to the verifier are the processed ones: tokens outside the
    top-k are -inf in them, and every drafted token is finite there."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=BLOCK)
    # In bfloat16 (the fast path's default on CPUs with native bf16) logits tie more often, and top-k keeps ties.
    drafter.linear_dtype = torch.float32
    seen = spy_on_verifier(monkeypatch)
    options = dict(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3, max_new_tokens=20)
    target.generate(torch.randint(0, 64, (1, 6)), assistant_model=drafter, **options)
    assert seen
    for tokens, logits in seen:
        finite = torch.isfinite(logits)
        assert (finite.sum(-1) <= 5).all()
        assert finite[torch.arange(len(tokens)), tokens].all()


# --- sampling is lossless: chi-square test of the joint law of the first three sampled tokens -------------------


def broken_speculative_sampling(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs):
    """A deliberately wrong verifier: after a rejection it resamples from p instead of norm(max(p - q, 0))."""
    drafted = candidate_input_ids[:, -candidate_length:]
    q, p = candidate_logits.softmax(-1), new_logits.softmax(-1)
    positions = torch.arange(candidate_length)
    ratio = p[0, positions, drafted[0]] / q[0, positions, drafted[0]]
    n_matches = int(torch.cumprod((torch.rand_like(ratio) <= ratio).long(), 0).sum())
    token = torch.multinomial(p[:, n_matches], 1)
    return torch.cat([drafted[:, :n_matches], token], dim=1), n_matches


@pytest.fixture(scope="module")
def sampling_setup():
    """A bigram target with a spread-out law, and a drafter whose law overlaps it without equalling it: many drafts
    are accepted and many rejected, so both the acceptance test and the residual resampling are exercised."""
    target = make_bigram_target("llama", vocab_size=LAW_VOCAB, seed=3, temperature=0.05)
    drafter = make_oracle_drafter(target, strength=2.0, block_size=3, seed=5)
    prompt = torch.tensor([[1, 4, 2, 5]])
    return target, drafter, prompt, exact_law(target, prompt)


# Whole blocks, and both confidence cuts at the shipped thresholds; each cut rule alone is checked where it is cheaper,
# on hand-set laws (`test_exactness.py::test_emitted_law_is_the_target_law_under_every_cut`).
@pytest.mark.parametrize("thresholds", [(0.0, 0.0), (0.3, 0.25)], ids=["whole-blocks", "shipped-cuts"])
def test_sampling_matches_the_exact_target_law(sampling_setup, thresholds, monkeypatch):
    target, drafter, prompt, law = sampling_setup
    monkeypatch.setattr(drafter.generation_config, "assistant_confidence_threshold", thresholds[0])
    monkeypatch.setattr(drafter.generation_config, "block_confidence_threshold", thresholds[1], raising=False)
    counts = sampled_counts(target, drafter, prompt)
    assert drafter.drafting_stats.drafted_tokens > 0
    assert chi_square_pvalue(counts, law) > 1e-3


def test_chi_square_detects_a_broken_verifier(sampling_setup, monkeypatch):
    target, drafter, prompt, law = sampling_setup
    monkeypatch.setattr(generation_utils, "_speculative_sampling", broken_speculative_sampling)
    counts = sampled_counts(target, drafter, prompt)
    assert chi_square_pvalue(counts, law) < 1e-6


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_greedy_equals_target_on_qwen2_and_mistral(kind):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}
    config_cls, model_cls = classes[kind]
    torch.manual_seed(0)
    target = model_cls(config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  max_position_embeddings=1024)).eval()  # fmt: skip
    prompt = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    reference, assisted = greedy_pair(target, make_drafter(target), prompt, max_new_tokens=25)
    assert torch.equal(reference, assisted)


@pytest.mark.parametrize(
    "ablation", ["use_global_summary", "use_boundary_state", "use_recent_window", "full_prefix_context"]
)
def test_ablations_generate_losslessly(ablation):
    target = make_bigram_target("qwen3", vocab_size=64, seed=2)
    flag = {ablation: ablation == "full_prefix_context"}
    drafter = make_oracle_drafter(target, agree_on=lambda ids: ids % 3 != 0, block_size=BLOCK, **flag)
    prompt = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(1))
    reference, assisted = greedy_pair(target, drafter, prompt, max_new_tokens=20)
    assert torch.equal(reference, assisted)


@pytest.mark.parametrize("threshold", [0.0, 0.5, 1.0])
def test_confidence_threshold_ends_blocks_early_and_stays_exact(target_kind, threshold, monkeypatch):
    """`assistant_confidence_threshold` drops every drafted token after the first whose draft probability is below
    it: 1.0 leaves one token per round, 0 whole blocks."""
    from transformers_longspark.inference.planning import Source
    from transformers_longspark.inference.session import DraftSession

    rounds = []  # (tokens allowed, draft probabilities of the tokens proposed)
    original = DraftSession.draft_round

    def spy(self, requests, planners, read_context):
        self.settings = replace(self.settings, return_logits=True)  # greedy rounds skip them: keep them to inspect
        proposal = original(self, requests, planners, read_context)
        if proposal.sources[0] is not Source.DRAFTER:  # the last round has no room left
            return proposal
        k = int(proposal.num_drafted[0])
        drafted, logits = proposal.tokens[0, :k], proposal.logits[0, :k]
        allowed = min(int(requests.room[0]), self.config.block_size)
        rounds.append((allowed, logits.softmax(-1)[torch.arange(k), drafted]))
        return proposal

    monkeypatch.setattr(DraftSession, "draft_round", spy)
    target = make_bigram_target(target_kind, vocab_size=64, seed=2)
    drafter = make_oracle_drafter(target, strength=20.0, window_size=WINDOW, block_size=BLOCK)  # q of 0.2 to 0.9
    drafter.generation_config.assistant_confidence_threshold = threshold
    prompt = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    reference, assisted = greedy_pair(target, drafter, prompt, max_new_tokens=30)
    assert torch.equal(reference, assisted)
    for allowed, probs in rounds:
        assert (probs[1:] >= threshold).all()
        assert len(probs) == (1 if threshold == 1.0 else allowed if threshold == 0.0 else len(probs))
    if threshold == 0.5:  # some blocks are cut, and some keep more than their first token
        assert any(len(p) < allowed for allowed, p in rounds) and any(len(p) > 1 for _, p in rounds)


@pytest.mark.parametrize("threshold", [0.2, 0.4])
def test_block_confidence_threshold_cuts_where_the_block_probability_falls(target_kind, threshold, monkeypatch):
    """`block_confidence_threshold` ends a block before the first token (after the first) at which the product of
    the block's draft probabilities falls below it; outputs stay exact."""
    from transformers_longspark.inference import drafting

    blocks = []  # (block probability after each drafted token, tokens kept, tokens drafted)
    original = drafting.draft_tokens

    def spy(drafter, context, requests, settings):
        proposal = original(drafter, context, requests, replace(settings, return_logits=True))  # kept to inspect
        tokens, logits = proposal.tokens, proposal.logits
        probs = logits[0].softmax(-1)[torch.arange(tokens.shape[1]), tokens[0]]
        blocks.append((probs.cumprod(0), int(proposal.num_drafted[0]), tokens.shape[1]))
        return proposal

    monkeypatch.setattr(drafting, "draft_tokens", spy)
    target = make_bigram_target(target_kind, vocab_size=64, seed=2)
    drafter = make_oracle_drafter(target, strength=20.0, window_size=WINDOW, block_size=BLOCK)  # q of 0.2 to 0.9
    drafter.generation_config.assistant_confidence_threshold = 0.0
    drafter.generation_config.block_confidence_threshold = threshold
    prompt = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    reference, assisted = greedy_pair(target, drafter, prompt, max_new_tokens=30)
    assert torch.equal(reference, assisted)
    for block_probability, kept, drafted in blocks:
        below = [i for i in range(1, drafted) if block_probability[i] < threshold]
        assert kept == (below[0] if below else drafted)
    assert any(kept < drafted for _, kept, drafted in blocks) and any(kept > 1 for _, kept, _ in blocks)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_processors_see_each_drafted_token_while_a_block_is_drafted(batch_size, monkeypatch):
    """While a block is drafted, the logits processors' i-th call sees the sequence followed by the block's first i
    drafts, as plain `generate` would show them that prefix. (A stale prefix keeps outputs exact and costs tau only:
    no exactness test sees it.)"""
    from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList

    from transformers_longspark.inference import drafting

    class Recorder(LogitsProcessor):
        def __call__(self, input_ids, scores):
            calls.append(input_ids.clone())
            return scores

    calls, rounds = [], []
    original = drafting.draft_tokens

    def spy(drafter, context, requests, settings):
        start = len(calls)
        proposal = original(drafter, context, requests, settings)
        rounds.append((requests.rows.clone(), requests.lengths.clone(), proposal.tokens.clone(), calls[start:]))
        return proposal

    monkeypatch.setattr(drafting, "draft_tokens", spy)
    target = make_bigram_target("llama", vocab_size=64, seed=2)
    drafter = make_drafter(target, window_size=WINDOW, block_size=BLOCK)
    drafter.generation_config.assistant_confidence_threshold = 0.0
    prompts = torch.tensor([[5, 9, 28], [7, 1, 40], [3, 3, 12]])[:batch_size]
    options = dict(max_new_tokens=12, logits_processor=LogitsProcessorList([Recorder()]), pad_token_id=0)
    target.generate(prompts, attention_mask=torch.ones_like(prompts), assistant_model=drafter, **options)
    assert rounds
    for rows, lengths, tokens, seen in rounds:
        if len(lengths.unique()) > 1:  # rows of different lengths get a call per length (test_batched covers them)
            continue
        assert len(seen) == tokens.shape[1]  # one call per drafted position
        for i, input_ids in enumerate(seen):
            assert input_ids.shape[1] == int(lengths[0]) + i
            assert torch.equal(input_ids[rows, int(lengths[0]) :], tokens[:, :i])


@pytest.mark.parametrize(
    ("sampling", "logits_kept"),
    [
        ({"do_sample": False}, False),
        ({"do_sample": True}, True),
        ({"do_sample": False, "assistant_ensemble_weight": 0.5}, True),
    ],
)
def test_proposals_carry_their_logits_only_where_the_verifier_reads_them(sampling, logits_kept, monkeypatch):
    """Greedy verification compares tokens, so greedy rounds skip the `(k, vocab)` logits; sampled verification and
    transformers' ensemble of target and drafter laws read them."""
    from transformers_longspark.inference.session import DraftSession

    proposals = []
    original = DraftSession.draft_round
    monkeypatch.setattr(DraftSession, "draft_round", lambda *a: proposals.append(original(*a)) or proposals[-1])
    target = make_bigram_target("llama", vocab_size=64, seed=2)
    drafter = make_oracle_drafter(target, window_size=WINDOW, block_size=BLOCK)
    prompt = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    target.generate(prompt, max_new_tokens=12, assistant_model=drafter, **sampling)
    drafted = [p for p in proposals if int(p.num_drafted.sum())]
    assert drafted and all((p.logits is not None) == logits_kept for p in drafted)
