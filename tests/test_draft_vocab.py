"""Draft vocabularies: a drafter that proposes only some target tokens stays lossless and scores them as before."""

import pytest
import torch
from transformers import AutoModel

from helpers import (
    chi_square_pvalue,
    exact_law,
    greedy_pair,
    make_bigram_target,
    make_drafter,
    make_oracle_drafter,
    make_target,
    sampled_counts,
    spy_on_verifier,
    tiny_config,
)
from transformers_longspark import LongSparkConfig
from transformers_longspark.training.data import Sequence
from transformers_longspark.training.distillation import teacher_forced_batch
from transformers_longspark.training.run import Trainer, most_frequent_tokens

BLOCK = 4


def chain_tokens(target, prompt, n=30):
    return target.generate(prompt, max_new_tokens=n, do_sample=False)[0, prompt.shape[1] :].unique()


@pytest.mark.parametrize("coverage", ["chain", "partial"])
def test_greedy_equals_target(target_kind, coverage):
    """An oracle restricted to the greedy chain's tokens (all, or every other one) keeps greedy outputs identical."""
    target = make_bigram_target(target_kind, vocab_size=64, seed=2)
    prompt = torch.tensor([[5, 9, 28]])
    chain = chain_tokens(target, prompt)
    kept = chain if coverage == "chain" else chain[::2]
    others = torch.tensor([t for t in range(64) if t not in set(chain.tolist())][: 24 - len(kept)])
    drafter = make_oracle_drafter(target, block_size=BLOCK).with_draft_vocab(torch.cat([kept, others]))
    reference, assisted = greedy_pair(target, drafter, prompt, max_new_tokens=30)
    assert torch.equal(reference, assisted)
    tau = 29 / drafter.drafting_stats.rounds
    assert tau > BLOCK if coverage == "chain" else 1 < tau < BLOCK


def test_restricted_drafter_scores_its_tokens_exactly_as_the_full_one():
    target = make_target("qwen3")
    full = make_drafter(target, block_size=BLOCK)
    with torch.no_grad():
        full.markov_proj.weight.normal_()
    token_ids = torch.tensor([40, 3, 17, 0, 63, 8])
    restricted = full.with_draft_vocab(token_ids)
    full.bind_target(target)
    restricted.bind_target(target)
    batch = teacher_forced_batch(target, full, Sequence(torch.randint(0, 64, (20,)), 2), torch.tensor([2, 9, 17]))
    with torch.no_grad():
        expected = full(batch.block_ids, batch.context, batch.previous_ids).logits
        got = restricted(batch.block_ids, batch.context, batch.previous_ids).logits
    torch.testing.assert_close(got, expected[..., token_ids])
    back = restricted.to_target_vocab(got)
    torch.testing.assert_close(back[..., token_ids], got)
    assert torch.isneginf(back).sum(-1).eq(64 - len(token_ids)).all()
    assert restricted.draft_indices(torch.tensor([17, 5, 63])).tolist() == [2, -1, 4]


def test_save_load_keeps_the_draft_vocabulary(tmp_path):
    target = make_target("llama")
    drafter = make_drafter(target, draft_vocab_size=10)
    drafter.set_draft_vocab(torch.tensor([9, 1, 33, 2, 60, 7, 11, 50, 4, 0]))
    drafter.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.draft_vocab, drafter.draft_vocab)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_verifier_gets_zero_draft_probability_outside_the_vocabulary(monkeypatch):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=BLOCK, draft_vocab_size=12)
    drafter.set_draft_vocab(torch.arange(12) * 5)
    seen = spy_on_verifier(monkeypatch)
    target.generate(torch.randint(0, 64, (1, 6)), assistant_model=drafter, do_sample=True, max_new_tokens=20)
    assert seen
    outside = torch.ones(64, dtype=torch.bool)
    outside[drafter.draft_vocab] = False
    for tokens, logits in seen:
        assert torch.isneginf(logits[:, outside]).all() and torch.isfinite(logits[:, ~outside]).all()
        assert (tokens % 5 == 0).all()


def test_sampling_matches_the_exact_target_law():
    """The chi-square test of `test_generation`, with a drafter that cannot propose two of the six tokens."""
    target = make_bigram_target("llama", vocab_size=6, seed=3, temperature=0.05)
    drafter = make_oracle_drafter(target, strength=2.0, block_size=3, seed=5)
    drafter = drafter.with_draft_vocab(torch.tensor([0, 2, 3, 5]))
    prompt = torch.tensor([[1, 4, 2, 5]])
    counts = sampled_counts(target, drafter, prompt)
    assert drafter.drafting_stats.drafted_tokens > 0
    assert chi_square_pvalue(counts, exact_law(target, prompt)) > 1e-3


def test_score_only_processors_run_in_the_draft_vocabulary(monkeypatch):
    """Temperature and the top-k / top-p cuts give the same law over the draft vocabulary as over the whole target
    vocabulary, so drafts under them are drawn among the draft vocabulary's logits (no per-token target-vocabulary
    pass): the proposals handed to the verifier carry the cuts, and the output law is exact."""
    from transformers_longspark.inference import drafting

    def no_target_vocab_pass(*args, **kwargs):
        raise AssertionError("process_logits ran on target-vocabulary logits")

    monkeypatch.setattr(drafting, "process_logits", no_target_vocab_pass)
    sampling = dict(do_sample=True, temperature=0.8, top_k=3, top_p=0.95)
    target = make_bigram_target("llama", vocab_size=6, seed=3, temperature=0.05)
    drafter = make_oracle_drafter(target, strength=2.0, block_size=3, seed=5)
    drafter = drafter.with_draft_vocab(torch.tensor([0, 2, 3, 4, 5]))
    seen = spy_on_verifier(monkeypatch)
    prompt = torch.tensor([[1, 4, 2, 5]])
    counts = sampled_counts(target, drafter, prompt, draws=1000, sampling=sampling)
    assert seen and all((torch.isfinite(logits).sum(-1) <= 3).all() for _, logits in seen)  # top-k 3 applied
    assert chi_square_pvalue(counts, exact_law(target, prompt, sampling=sampling)) > 1e-3


@pytest.mark.parametrize("token_ids, message", [([1, 2], "10 distinct"), ([1] * 10, "1 distinct"),
                                                ([*range(9), 64], r"\[0, 64\)")])  # fmt: skip
def test_bad_draft_vocabularies_are_refused(token_ids, message):
    drafter = make_drafter(make_target("llama"), draft_vocab_size=10)
    with pytest.raises(ValueError, match=message):
        drafter.set_draft_vocab(torch.tensor(token_ids))


def test_invalid_draft_vocab_size_is_refused():
    with pytest.raises(ValueError, match="draft_vocab_size"):
        LongSparkConfig(vocab_size=100, draft_vocab_size=101)
    with pytest.raises(ValueError, match="full vocabulary"):
        make_drafter(make_target("llama")).set_draft_vocab(torch.arange(3))


def test_most_frequent_tokens():
    sequences = [Sequence(torch.tensor([5, 5, 5, 7, 7, 9]), 1), Sequence(torch.tensor([9, 9, 9, 3]), 1)]
    assert most_frequent_tokens(sequences, 3, vocab_size=12).tolist() == [5, 7, 9]
    assert most_frequent_tokens(sequences, 3, vocab_size=12, always=[11]).tolist() == [5, 9, 11]
    assert most_frequent_tokens(sequences, 6, vocab_size=12).tolist() == [0, 1, 3, 5, 7, 9]  # unseen: lowest ids


def test_training_restricts_the_vocabulary_and_resumes_with_it(tmp_path):
    target = make_target("llama")
    config = tiny_config(tmp_path, max_steps=2, drafter=dict(tiny_config(tmp_path).drafter, draft_vocab_size=20))
    trainer = Trainer(config, target=target)
    expected = most_frequent_tokens(trainer.train_sequences, 20, 64)
    assert torch.equal(trainer.model.draft_vocab, expected)
    final = trainer.train()

    (tmp_path / "data" / "part-00000.jsonl").write_text(
        '{"id": 0, "prompt_ids": [1, 2], "response_ids": [63, 63, 63, 63, 63, 63]}\n'
    )
    resumed = Trainer(config.__class__(**{**config.__dict__, "max_steps": 3}), target=target)
    assert not torch.equal(resumed.model.draft_vocab, expected)  # built from the new data...
    resumed.train(resume=True)
    assert torch.equal(resumed.model.draft_vocab, expected)  # ...then restored from the checkpoint
    torch.testing.assert_close(resumed.model.output_head.weight, target.lm_head.weight[expected])
    assert AutoModel.from_pretrained(final).config.draft_vocab_size == 20
