"""Tiny random targets and drafters, built in-process (no downloads)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from transformers_longspark import LongSparkConfig, LongSparkDrafterModel  # also installs the generate() hook

# The models here are tiny: one thread is faster than several, and leaves a core to other jobs.
torch.set_num_threads(1)

TARGETS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def make_target(kind: str = "qwen3", vocab_size: int = 64, seed: int = 0, **overrides):
    config_cls, model_cls = TARGETS[kind]
    fields = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    fields.update(overrides)
    torch.manual_seed(seed)
    return model_cls(config_cls(**fields)).eval()


def make_drafter(target, seed: int = 1, **overrides) -> LongSparkDrafterModel:
    fields = dict(window_size=8, num_summary_queries=4, markov_rank=8, block_size=4, num_selected_layers=3)
    fields.update(overrides)
    torch.manual_seed(seed)
    return LongSparkDrafterModel(LongSparkConfig.from_target_config(target.config, **fields)).eval()


def make_bigram_target(kind: str = "llama", vocab_size: int = 16, seed: int = 0, temperature: float = 1.0):
    """A target whose next-token law depends on the previous token only: every layer's output projections are zero,
    so the residual stream is the token embedding and `p(. | prev) = softmax(lm_head(norm(embed(prev))))`."""
    target = make_target(kind, vocab_size=vocab_size, seed=seed)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        target.lm_head.weight.mul_(1.0 / temperature)
    return target


def bigram_logits(target) -> torch.Tensor:
    """`(V, V)` next-token logits of a bigram target, row = previous token."""
    with torch.no_grad():
        embeds = target.model.embed_tokens.weight
        return target.lm_head(target.model.norm(embeds[:, None]))[:, 0].float()


def make_oracle_drafter(target, strength: float = 100.0, agree_on=None, **overrides) -> LongSparkDrafterModel:
    """A drafter whose Markov correction copies a bigram target's logits (`strength` times), so its greedy drafts are
    the target's greedy tokens; `agree_on(prev_ids)` limits that to some previous tokens (partial acceptance)."""
    vocab = target.config.vocab_size
    drafter = make_drafter(target, markov_rank=vocab, **overrides)
    table = bigram_logits(target)
    if agree_on is not None:
        table[~agree_on(torch.arange(vocab))] = 0.0
    with torch.no_grad():
        drafter.markov_embed.weight.copy_(torch.eye(vocab))
        drafter.markov_proj.weight.copy_(strength * table.T)
    return drafter


@pytest.fixture(params=sorted(TARGETS))
def target_kind(request) -> str:
    return request.param
