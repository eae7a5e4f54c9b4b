"""Helpers shared by the test modules: tiny random targets and drafters built in-process (no downloads), the
chi-square machinery of the exact-law tests, and small writers of training data and vLLM cache blocks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.generation import utils as generation_utils
from transformers.generation.logits_process import LogitsProcessor

from transformers_longspark import (  # also installs the generate() hook
    LongSparkConfig,
    LongSparkDrafterModel,
    packed_linear,
)
from transformers_longspark.training.run import TrainingConfig

# vLLM runs in its own environment (`scripts/install_vllm.sh` makes `.venv-vllm/`; `LONGSPARK_VLLM_PYTHON` points
# at another interpreter); the tests that need it are skipped, with this reason, without it.
VLLM_PYTHON = Path(
    os.environ.get("LONGSPARK_VLLM_PYTHON", Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python")
)
requires_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"vLLM is not installed: {VLLM_PYTHON} does not exist (`bash scripts/install_vllm.sh` makes it, or set "
    "LONGSPARK_VLLM_PYTHON)",
)
TARGETS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


# --- targets and drafters ----------------------------------------------------------------------------------------


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


def context_target(kind: str, seed: int = 2, vocab_size: int = 64):
    """A random target whose layers are damped (x0.3) so that a bigram oracle drafter agrees with it often but not
    always: acceptance lengths vary from round to round and row to row, and attention still matters (a row that saw
    a rejected draft or a wrong position generates something else)."""
    target = make_target(kind, vocab_size=vocab_size, seed=seed)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.3)
            layer.mlp.down_proj.weight.mul_(0.3)
        target.lm_head.weight.mul_(3.0)
    return target


# --- generation --------------------------------------------------------------------------------------------------


# A permutation of 64 token ids into 6-token cycles (60..63 go to 0): `FollowTheLastToken` makes a target walk them.
CYCLE = torch.tensor([(t // 6) * 6 + (t + 1) % 6 if t < 60 else 0 for t in range(64)])


class FollowTheLastToken(LogitsProcessor):
    """Adds `boost` to `CYCLE[last token]` of each row: a logits processor that reads the recent sequence (not a set of
    tokens, as the repetition penalty does), so a position processed with a stale prefix boosts another token. The
    processed target walks 6-token cycles: its text repeats, and lookup continuations are accepted."""

    def __init__(self, boost: float = 30.0):
        self.boost = boost

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        scores[torch.arange(len(scores)), CYCLE[input_ids[:, -1]]] += self.boost
        return scores


def longest_earlier_match(tokens: list[int], min_ngram: int = 2, max_ngram: int = 6) -> tuple[int, int]:
    """Brute force: the longest suffix of `tokens` (up to `max_ngram`) that occurred earlier with a token after it,
    and where the latest such occurrence's continuation starts (`(0, -1)`: none of at least `min_ngram`)."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 1, n - 1, -1):  # the occurrence tokens[end - n : end] is followed by tokens[end]
            if tokens[end - n : end] == suffix:
                return n, end
    return 0, -1


def greedy_pair(target, drafter, prompt, **kwargs):
    """Greedy `generate` of one prompt, plain and assisted by `drafter`."""
    reference = target.generate(prompt, do_sample=False, **kwargs)
    assisted = target.generate(prompt, do_sample=False, assistant_model=drafter, **kwargs)
    return reference, assisted


def spy_on_verifier(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Records `(drafted tokens, draft logits)` of every speculative-sampling verification."""
    seen = []
    original = generation_utils._speculative_sampling

    def spy(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs):
        seen.append((candidate_input_ids[0, -candidate_length:], candidate_logits[0]))
        return original(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs)

    monkeypatch.setattr(generation_utils, "_speculative_sampling", spy)
    return seen


# --- the exact law of the first sampled tokens, and the chi-square test against it --------------------------------

SAMPLING = dict(do_sample=True, temperature=0.9, top_k=4, repetition_penalty=1.2)
LAW_VOCAB, LAW_TOKENS = 6, 3  # the law is over the first LAW_TOKENS new tokens of a LAW_VOCAB-token target


def exact_law(target, input_ids, attention_mask=None, sampling: dict | None = None) -> torch.Tensor:
    """`(V, V, V)` probability of each 3-token continuation of one prompt (left-padded or not) under plain `generate`
    with `sampling` (default SAMPLING); its logits processors read the padded row, as they do in a batch."""
    sampling = SAMPLING if sampling is None else sampling
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)

    def next_law(ids):
        mask = torch.cat([attention_mask, torch.ones(1, ids.shape[1] - attention_mask.shape[1], dtype=torch.long)], 1)
        out = target.generate(ids, attention_mask=mask, max_new_tokens=1, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=0, **sampling)  # fmt: skip
        return out.scores[0][0].softmax(-1).double()

    law = torch.zeros((LAW_VOCAB,) * LAW_TOKENS, dtype=torch.float64)
    first = next_law(input_ids)
    for a in range(LAW_VOCAB):
        second = next_law(torch.cat([input_ids, torch.tensor([[a]])], 1))
        for b in range(LAW_VOCAB):
            law[a, b] = first[a] * second[b] * next_law(torch.cat([input_ids, torch.tensor([[a, b]])], 1))
    return law


def sampled_counts(target, drafter, prompt, draws: int = 2000, sampling: dict | None = None) -> torch.Tensor:
    """Counts of the first three new tokens of `draws` assisted samples of one prompt, one `generate` each, with
    `sampling` (default SAMPLING)."""
    sampling = SAMPLING if sampling is None else sampling
    torch.manual_seed(1234)
    counts = torch.zeros(LAW_VOCAB**LAW_TOKENS, dtype=torch.float64)
    for _ in range(draws):
        out = target.generate(prompt, max_new_tokens=LAW_TOKENS, assistant_model=drafter, **sampling)
        a, b, c = out[0, prompt.shape[1] :].tolist()
        counts[(a * LAW_VOCAB + b) * LAW_VOCAB + c] += 1
    return counts


def chi_square_pvalue(counts, law) -> float:
    expected = law.flatten() / law.sum() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a continuation of probability zero was sampled"
    # Pool the rare cells so that every expected count is >= 5.
    rare = keep & (expected < 5)
    observed = torch.cat([counts[keep & ~rare], counts[rare].sum().view(1)])
    expected = torch.cat([expected[keep & ~rare], expected[rare].sum().view(1)])
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


# --- training data -----------------------------------------------------------------------------------------------


def write_records(path, num=6, length=24, prompt=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    with (path / "part-00000.jsonl").open("w") as f:
        for i in range(num):
            ids = torch.randint(0, 64, (length,), generator=g).tolist()
            f.write(json.dumps({"id": i, "prompt_ids": ids[:prompt], "response_ids": ids[prompt:]}) + "\n")
    return path


def tiny_config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "run"), train_data=str(write_records(tmp_path / "data")),
        drafter=dict(window_size=8, num_summary_queries=4, markov_rank=8, block_size=4, num_selected_layers=3),
        anchors_per_sequence=8, gradient_accumulation_steps=2, learning_rate=3e-3, max_steps=6, epochs=100,
        checkpoint_every=2, eval_every=1000, tau_prompts=0, max_seq_len=64,
    )  # fmt: skip
    values.update(overrides)
    return TrainingConfig(**values)


# --- vLLM's paged KV cache ---------------------------------------------------------------------------------------


def pack_blocks(keys: torch.Tensor, values: torch.Tensor, layout: str, block_size: int) -> torch.Tensor:
    """Reference writer (the formulas of vLLM's CPU kernels): `(h, n * block_size, d)` K/V -> raw blocks."""
    heads, rows, head_dim = keys.shape
    n = rows // block_size
    blocks = torch.empty(n, heads, block_size, 2 * head_dim, dtype=keys.dtype)
    flat = blocks.view(n, heads, 2, block_size * head_dim)
    for b in range(n):
        for h in range(heads):
            k, v = keys[h, b * block_size : (b + 1) * block_size], values[h, b * block_size : (b + 1) * block_size]
            for t in range(block_size):
                for d in range(head_dim):
                    if layout == "amx":
                        k_at = (t // 16) * 16 * head_dim + (d // 2) * 32 + (t % 16) * 2 + d % 2
                        v_at = (d // 16) * block_size * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2
                    else:
                        k_at, v_at = d * block_size + t, t * head_dim + d
                    flat[b, h, 0, k_at], flat[b, h, 1, v_at] = k[t, d], v[t, d]
    return blocks


# --- packed linear layers (`test_packed_linear*.py`) ---------------------------------------------------------------


def layer(in_features: int = 24, out_features: int = 40, bias: bool = True, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, bias=bias).eval()


def was_packed(module: torch.nn.Linear) -> bool:
    return packed_linear.packed_copy(module.weight) is not None


def packed_weight_ids(dtype: torch.dtype | None = None) -> set[int]:
    """Ids of the weights with a packed copy (alone or stacked with others: `fused_linears`), in `dtype` or any."""
    entries = packed_linear._packed.items()
    return {
        i for (ids, key_dtype), (_, _, copy) in entries if copy is not None and dtype in (None, key_dtype) for i in ids
    }
