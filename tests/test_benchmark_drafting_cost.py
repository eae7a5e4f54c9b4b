"""The drafting-cost benchmark: its fields, fixed context-state bytes against the full-prefix baseline's, its plot."""

import json
from itertools import pairwise

import pytest
import torch

from helpers import make_drafter, make_target
from transformers_longspark.benchmarks import DraftingCostSettings, run_drafting_cost
from transformers_longspark.benchmarks.drafting_cost import full_prefix_state_bytes, plot_drafting_cost
from transformers_longspark.benchmarks.models import make_full_prefix_drafter

# --- drafting cost ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cost_result():
    target = make_target("qwen3", max_position_embeddings=256)
    drafter = make_drafter(target, window_size=8, block_size=4)
    settings = DraftingCostSettings(prefix_lengths=(16, 32, 64, 512), rounds=2, warmup=1)
    return drafter, run_drafting_cost(target, drafter, settings)


def test_drafting_cost_fields(cost_result):
    _, result = cost_result
    fields = ("prefix_lengths", "longspark_ms", "full_prefix_ms", "longspark_state_bytes", "full_prefix_state_bytes")
    for field in fields:
        assert len(result[field]) == 3, field
    assert result["prefix_lengths"] == [16, 32, 64]
    assert all(ms > 0 for ms in result["longspark_ms"] + result["full_prefix_ms"])
    assert [skip["prefix_length"] for skip in result["skipped"]] == [512]  # beyond max_position_embeddings
    assert "max_position_embeddings=256" in result["skipped"][0]["reason"]
    json.dumps(result)


def test_state_bytes_fixed_for_longspark_and_linear_for_full_prefix(cost_result):
    drafter, result = cost_result
    config = drafter.config
    assert len(set(result["longspark_state_bytes"])) == 1
    lengths, full = result["prefix_lengths"], result["full_prefix_state_bytes"]
    per_row = config.num_draft_layers * 2 * config.num_key_value_heads * config.head_dim * 4  # float32 K and V
    assert [b - a for a, b in pairwise(full)] == [per_row * (t2 - t1) for t1, t2 in pairwise(lengths)]
    assert full == [full_prefix_state_bytes(config, t) for t in lengths] == result["full_prefix_state_bytes_formula"]
    # LongSpark keeps D summaries (m values + m log-normalisers per KV head, float32) and the boundary.
    d, h, m = config.num_draft_layers, config.num_key_value_heads, config.num_summary_queries
    assert result["longspark_state_bytes"][0] == 4 * (d * h * m * (config.head_dim + 1) + d * config.hidden_size)


def test_drafting_cost_uses_given_prefix_tokens():
    target = make_target("llama")
    drafter = make_drafter(target, window_size=8, block_size=4)
    settings = DraftingCostSettings(prefix_lengths=(16,), rounds=1, warmup=0)
    result = run_drafting_cost(target, drafter, settings, prefix_ids=list(range(17)))
    assert result["prefix_source"] == "given" and result["prefix_lengths"] == [16]
    with pytest.raises(ValueError, match="prefix_ids"):
        settings = DraftingCostSettings(prefix_lengths=(32,), rounds=1, warmup=0)
        run_drafting_cost(target, drafter, settings, prefix_ids=list(range(17)))


def test_plot_is_written(cost_result, tmp_path):
    _, result = cost_result
    path = plot_drafting_cost(result, tmp_path / "figs" / "drafting_cost.png")
    assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_full_prefix_drafter_shares_the_weights_and_the_confidence_threshold():
    target = make_target("qwen3")
    drafter = make_drafter(target)
    drafter.generation_config.assistant_confidence_threshold = 0.125
    baseline = make_full_prefix_drafter(drafter)
    assert baseline.generation_config.assistant_confidence_threshold == 0.125
    assert baseline.config.full_prefix_context and not drafter.config.full_prefix_context
    for (name, a), (_, b) in zip(drafter.state_dict().items(), baseline.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
