"""`summary_key_positions`: with "block_start" the summary keys `U` carry the block's start position, so the block
queries' scores against them depend on the offset within the block only; with "none" they depend on the absolute
position. (Train/inference equivalence of both is in test_training.py.)"""

import pytest
import torch
import torch.nn.functional as F

from helpers import make_drafter, make_target
from transformers_longspark import LongSparkConfig
from transformers_longspark.context_state import DraftContext
from transformers_longspark.training.run import TrainingConfig, build_drafter


def summary_scores(drafter, position: int, monkeypatch) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per draft layer, the `(heads, B, m)` attention logits `q . U` of one block at absolute position `position`
    (same block content, boundary and summary values for every position), and the drafter's logits."""
    config = drafter.config
    g = torch.Generator().manual_seed(0)
    n, m, d = 1, config.num_summary_queries, config.head_dim
    boundary = torch.randn(n, config.num_draft_layers * config.hidden_size, generator=g)
    values = [torch.randn(n, config.num_key_value_heads, m, d, generator=g) for _ in range(config.num_draft_layers)]
    context = DraftContext(boundary, [], [], None, values, torch.tensor([position]))
    block_ids = torch.tensor([[5] + [config.mask_token_id] * (config.block_size - 1)])

    scores, original = [], F.scaled_dot_product_attention

    def capture(q, k, v, **kwargs):
        keys = k[:, :, -m:].repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # the summary keys, one per head
        scores.append((q @ keys.transpose(-1, -2))[0])
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", capture)
    with torch.no_grad():
        logits = drafter(block_ids, context).logits
    monkeypatch.undo()
    return scores, logits


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_block_start_summary_scores_are_invariant_to_the_absolute_position(kind, monkeypatch):
    target = make_target(kind)
    drafter = make_drafter(target, summary_key_positions="block_start")
    drafter.bind_target(target)
    near, near_logits = summary_scores(drafter, 7, monkeypatch)
    far, far_logits = summary_scores(drafter, 1007, monkeypatch)
    assert len(near) == drafter.config.num_draft_layers
    for a, b in zip(near, far):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # Without a window, block-block attention is relative too, so the whole drafter is shift-invariant.
    torch.testing.assert_close(near_logits, far_logits, rtol=1e-4, atol=1e-4)


def test_unrotated_summary_scores_depend_on_the_absolute_position(monkeypatch):
    target = make_target("qwen3")
    drafter = make_drafter(target)
    assert drafter.config.summary_key_positions == "none"
    drafter.bind_target(target)
    near, _ = summary_scores(drafter, 7, monkeypatch)
    far, _ = summary_scores(drafter, 1007, monkeypatch)
    assert (near[0] - far[0]).abs().max() > 1e-2  # layer 0 sees identical inputs, so only RoPE differs


def test_block_start_keys_at_position_zero_are_the_unrotated_queries(monkeypatch):
    target = make_target("llama")
    drafters = [make_drafter(target, summary_key_positions=p) for p in ("none", "block_start")]
    results = []
    for drafter in drafters:
        drafter.bind_target(target)
        results.append(summary_scores(drafter, 0, monkeypatch))
    for a, b in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(a, b)


def test_invalid_summary_key_positions_and_overrides_of_a_saved_drafter(tmp_path):
    with pytest.raises(ValueError, match="summary_key_positions"):
        LongSparkConfig(summary_key_positions="absolute")
    target = make_target("llama")
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    config = TrainingConfig(output_dir=str(tmp_path / "run"), train_data="unused",
                            init_drafter=str(tmp_path / "drafter"),
                            drafter={"summary_key_positions": "block_start"})  # fmt: skip
    assert build_drafter(config, target, []).config.summary_key_positions == "block_start"
    config.drafter = {"summary_key_positions": "rotated"}
    with pytest.raises(ValueError, match="summary_key_positions"):
        build_drafter(config, target, [])
