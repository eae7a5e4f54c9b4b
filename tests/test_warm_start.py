"""Warm start from the target: the copied layers compute what they computed in the target."""

import pytest
import torch
from transformers import DynamicCache

from helpers import make_drafter, make_target
from transformers_longspark.context_state import LongSparkContextState, read_context
from transformers_longspark.modeling_longspark import LongSparkDrafterModel
from transformers_longspark.training.data import Sequence
from transformers_longspark.training.distillation import teacher_forced_batch
from transformers_longspark.training.warm_start import (
    init_from_target,
    select_target_layers,
    warm_start_config,
    widen_mlp,
)


def teacher_forced_logits(target, drafter) -> torch.Tensor:
    """`drafter`'s logits at four anchors of one fixed random sequence, on its teacher-forced view of it."""
    sequence = Sequence(torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(0)), prompt_length=3)
    drafter.bind_target(target)
    batch = teacher_forced_batch(target, drafter, sequence, torch.tensor([3, 9, 20, 27]))
    return drafter(batch.block_ids, batch.context, batch.previous_ids).logits


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


def test_selected_layers_compute_what_they_computed_in_the_deeper_drafter():
    """With the dropped draft layers made identities (zero output projections: each adds 0 to the residual) and their
    boundary-fusion columns zero, the deeper drafter computes exactly what its selected layers do: the selected
    drafter's logits, on its own teacher-forced views of the same sequence, equal the deeper one's."""
    target = make_target("qwen3")
    deep = make_drafter(target, num_selected_layers=4)
    layer_ids = deep.config.target_layer_ids
    keep = [0, 2]
    with torch.no_grad():
        for j in set(range(4)) - set(keep):
            deep.layers[j].self_attn.o_proj.weight.zero_()
            deep.layers[j].mlp.down_proj.weight.zero_()
            hidden = deep.config.hidden_size
            deep.fuse_boundary.weight[:, j * hidden : (j + 1) * hidden].zero_()
    shallow = select_target_layers(deep, [layer_ids[j] for j in keep])
    assert shallow.config.num_draft_layers == 2 and shallow.config.target_layer_ids == [layer_ids[0], layer_ids[2]]
    with torch.no_grad():
        logits = [teacher_forced_logits(target, drafter) for drafter in (deep, shallow)]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer_ids", [[], [1, 99], "reversed"])
def test_selecting_layers_the_drafter_lacks_is_refused(layer_ids):
    drafter = make_drafter(make_target("llama"), num_selected_layers=3)
    layer_ids = drafter.config.target_layer_ids[::-1] if layer_ids == "reversed" else layer_ids
    with pytest.raises(ValueError, match="increasing subset of the init drafter"):
        select_target_layers(drafter, layer_ids)


def test_a_widened_mlp_computes_what_the_narrower_drafter_did_and_gains_the_target_neurons_it_lacked():
    """Widening adds the target's next neurons with zero output columns: the same logits at the start, the old neurons
    kept in place, the new rows the target's (none of them already in the drafter), and a gradient on the new output
    columns (so training grows into them)."""
    target = make_target("llama")  # intermediate 64 (tests/helpers.py)
    narrow = init_from_target(LongSparkDrafterModel(warm_start_config(target, intermediate_size=16)), target)
    target_rows = [tuple(row.tolist()) for row in target.model.layers[0].mlp.up_proj.weight]
    kept = {target_rows.index(tuple(row.tolist())) for row in narrow.layers[0].mlp.up_proj.weight}
    with torch.no_grad():  # a trained drafter's weights have moved off the target's
        for parameter in narrow.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    wide = widen_mlp(narrow, 40, target)
    assert wide.config.intermediate_size == 40 and narrow.config.intermediate_size == 16
    old, new = narrow.layers[0].mlp, wide.layers[0].mlp
    torch.testing.assert_close(new.up_proj.weight[:16], old.up_proj.weight)
    added = [target_rows.index(tuple(row.tolist())) for row in new.up_proj.weight[16:]]
    assert len(set(added)) == 24 and not set(added) & kept
    logits = [teacher_forced_logits(target, drafter) for drafter in (narrow, wide)]
    torch.testing.assert_close(logits[1], logits[0].detach(), rtol=1e-5, atol=1e-5)
    logits[1].square().sum().backward()
    assert new.down_proj.weight.grad[:, 16:].abs().sum() > 0


@pytest.mark.parametrize("width", [16, 8, 65])
def test_widening_to_no_wider_or_past_the_target_is_refused(width):
    target = make_target("llama")
    narrow = init_from_target(LongSparkDrafterModel(warm_start_config(target, intermediate_size=16)), target)
    with pytest.raises(ValueError, match="wider than the init drafter's 16 and at most the target's 64"):
        widen_mlp(narrow, width, target)
