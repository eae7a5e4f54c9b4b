"""The drafting EOS cut reads target token ids, not draft-vocabulary columns.

A drafter with a draft vocabulary draws columns of its own logits; column `c` is target token `draft_vocab[c]`. A
block must end right after a drafted EOS *id* (tokens after it can never be kept), and never because a column's index
happens to equal an EOS id. Here the draft vocabulary lists the tokens in reverse, so no column is its own id, and the
EOS id is a token of the greedy chain whose column is drafted mid-block.
"""

from __future__ import annotations

import pytest
import torch

from helpers import make_bigram_target, make_oracle_drafter
from transformers_longspark.inference import drafting

BLOCK = 4


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_drafted_eos_id_ends_the_block(batch_size, monkeypatch):
    target = make_bigram_target("llama", vocab_size=64, seed=2)
    prompts = torch.tensor([[5, 9, 28], [7, 1, 40]])[:batch_size]
    chains = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=30, do_sample=False)
    chain = chains[0, 3:].tolist()
    eos = chain[6]  # reached after a few rounds, mid-block
    tokens = sorted(set(chains[:, 3:].flatten().tolist()) | {eos})
    others = [t for t in range(64) if t not in tokens][: 32 - len(tokens)]
    draft_vocab = torch.tensor(tokens + others).flip(0)
    drafter = make_oracle_drafter(target, block_size=BLOCK).with_draft_vocab(draft_vocab)
    drafter.generation_config.assistant_confidence_threshold = 0.0
    assert not (draft_vocab == torch.arange(len(draft_vocab))).any() and eos in draft_vocab.tolist()
    blocks, draft_tokens = [], drafting.draft_tokens

    def spy(drafter, context, requests, settings):
        proposal = draft_tokens(drafter, context, requests, settings)
        for r in range(len(requests.rows)):
            room = min(int(requests.room[r]), BLOCK)
            blocks.append((proposal.tokens[r, : int(proposal.num_drafted[r])].tolist(), room))
        return proposal

    monkeypatch.setattr(drafting, "draft_tokens", spy)
    options = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=30, do_sample=False, eos_token_id=eos,
                   pad_token_id=0)  # fmt: skip
    reference = target.generate(prompts, **options)
    assisted = target.generate(prompts, assistant_model=drafter, **options)
    assert torch.equal(assisted, reference)
    ended = [block for block, _ in blocks if eos in block]
    assert ended, "some block drafted the EOS id"
    for block, room in blocks:
        if eos in block:
            assert block.index(eos) == len(block) - 1, (block, eos)  # cut right after it
        else:
            assert len(block) == room, (block, room)  # and nowhere else (no thresholds)
