"""Golden logits of the shipped drafter: any change to the network's math (or to the shipped weights) shows.

The shipped SmolLM2 drafter runs one forward over a fixed block and a fixed synthetic context (boundary states,
window, summaries) with seeded random target modules (embedding, final norm, LM head, RoPE of SmolLM2's shapes),
so no target download or GGUF is needed. Its logits at a few fixed columns are compared with the values recorded in
`golden_shipped_drafter.json`. Training and inference share the forward, so an edit that changes both alike (which the
alignment tests cannot see) changes these numbers. After a deliberate change (new math or a newly shipped drafter),
record the new values with `python tests/test_golden.py` and say why in the commit.
"""

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from transformers_longspark import LongSparkDrafterModel
from transformers_longspark.context_state import DraftContext
from transformers_longspark.loading import SHIPPED_DRAFTER_DIR
from transformers_longspark.targets import TargetModules

GOLDEN = Path(__file__).with_name("golden_shipped_drafter.json")
COLUMNS = [0, 1, 2, 100, 1000, 5000, 16383]


def weights_sha256() -> str:
    return hashlib.sha256((SHIPPED_DRAFTER_DIR / "model.safetensors").read_bytes()).hexdigest()


def golden_logits() -> torch.Tensor:
    """`(N, B, len(COLUMNS))` float64 logits of the shipped drafter on the fixed input."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

    drafter = LongSparkDrafterModel.from_pretrained(SHIPPED_DRAFTER_DIR, dtype=torch.float32).eval()
    config = drafter.config
    generator = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator) * scale

    norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    norm.weight.data = 1.0 + randn(config.hidden_size, scale=0.1)
    rope_config = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                              head_dim=config.head_dim, rope_parameters=config.rope_parameters)  # fmt: skip
    head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    head.weight.data = randn(config.vocab_size, config.hidden_size, scale=0.05)
    drafter.bind_target(TargetModules(
        embed_tokens=nn.Embedding.from_pretrained(randn(config.vocab_size, config.hidden_size, scale=0.05)),
        norm=norm, lm_head=head, rotary_emb=LlamaRotaryEmbedding(rope_config), layers=nn.ModuleList(),
    ))  # fmt: skip
    n, window, heads, d = 2, 12, config.num_key_value_heads, config.head_dim
    layers = config.num_draft_layers
    context = DraftContext(
        boundary_states=randn(n, layers * config.hidden_size),
        window_keys=[randn(n, heads, window, d) for _ in range(layers)],
        window_values=[randn(n, heads, window, d) for _ in range(layers)],
        window_mask=torch.arange(window)[None].expand(n, -1) >= torch.tensor([[0], [3]]),  # row 1: 3 padded rows
        summary_values=[randn(n, heads, config.num_summary_queries, d) for _ in range(layers)],
        positions=torch.tensor([40, 700]),
    )
    block = torch.full((n, config.block_size), config.mask_token_id)
    block[:, 0] = torch.tensor([306, 4271])
    previous = torch.randint(0, config.vocab_size, (n, config.block_size), generator=generator)
    with torch.no_grad():
        logits = drafter(block, context, previous).logits
    return logits[..., COLUMNS].double()


def test_shipped_drafter_logits_equal_the_recorded_ones():
    golden = json.loads(GOLDEN.read_text())
    assert golden["weights_sha256"] == weights_sha256(), (
        "The shipped drafter's weights changed: record new golden logits with `python tests/test_golden.py`."
    )
    torch.testing.assert_close(golden_logits(), torch.tensor(golden["logits"], dtype=torch.float64),
                               rtol=1e-4, atol=1e-4)  # fmt: skip


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps({"weights_sha256": weights_sha256(), "columns": COLUMNS,
                                  "logits": golden_logits().tolist()}, indent=1) + "\n")  # fmt: skip
    print(f"recorded {GOLDEN}")
