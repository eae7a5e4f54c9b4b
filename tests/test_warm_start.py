"""Warm start from the target: the copied layers compute what they computed in the target."""

import pytest
import torch
from transformers import DynamicCache

from helpers import make_target
from transformers_longspark.context_state import LongSparkContextState, read_context
from transformers_longspark.modeling_longspark import LongSparkDrafterModel
from transformers_longspark.training.warm_start import init_from_target, warm_start_config


@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # without and with per-head q/k norms
def test_anchor_slot_is_the_target_when_every_layer_is_copied(kind):
    """With every target layer selected, a window over the whole prefix and no summary, the warm-started drafter's
    anchor slot attends to exactly the rows the target's last position does, through the same layers: its logits are
    the target's next-token logits. (The block is the anchor alone: slots attend to each other bidirectionally.)"""
    target = make_target(kind, hidden_act="silu")
    config = warm_start_config(target, num_selected_layers=4, window_size=64, use_global_summary=False, block_size=3)
    drafter = init_from_target(LongSparkDrafterModel(config).eval(), target)
    drafter.bind_target(target)
    prompt = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        expected = target(prompt).logits[0, -1]
        target(prompt[:, :-1], cache=cache, use_cache=True)
        state = LongSparkContextState(config.num_draft_layers, config.summary_chunk_size)
        state.boundary_states = torch.randn(1, config.num_draft_layers * config.hidden_size)  # ignored at the start
        context = read_context(config, drafter.summary_queries, state, cache, prompt.shape[1] - 1)
        logits = drafter(prompt[:, -1:], context).base_logits[0, 0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_a_narrower_mlp_keeps_the_largest_neurons_and_mismatched_norms_are_refused():
    target = make_target("llama")
    drafter = LongSparkDrafterModel(warm_start_config(target, intermediate_size=16))
    init_from_target(drafter, target)
    source, copied = target.model.layers[0].mlp, drafter.layers[0].mlp
    rows = {tuple(row.tolist()) for row in source.up_proj.weight}
    assert all(tuple(row.tolist()) in rows for row in copied.up_proj.weight)
    with pytest.raises(ValueError, match="use_qk_norm"):
        init_from_target(LongSparkDrafterModel(warm_start_config(target, use_qk_norm=True)), target)
