"""Warm start: a drafter initialised from its target, "an efficient distilled version of the Target" (paper).

Draft layer `j` attends over the K/V rows of target layer `S[j]`, so that layer's own projections already produce
queries that match those keys. `init_from_target` copies, for each draft layer `j`, target layer `S[j]`'s attention
(`q/k/v/o`, and its head norms where the target has them), MLP and both RMSNorms; starts the input projection so that
each slot reads its token embedding (`[I, 0]` over `[embedding; boundary]`, block-position embeddings at zero); and
leaves the boundary fusion and the Markov correction neutral (their output is ignored or zero at the start). At step 0
the anchor slot is thus the target's own computation through `D` of its layers, and training starts from there.

A drafter MLP narrower than the target's keeps the target's neurons of largest weight (`|up_n| * |gate_n| * |down_n|`).

`select_target_layers` starts a shallower drafter from a trained one instead: it keeps the draft layers (and their
summary queries and boundary-fusion columns) of a subset of the selected target layers. `widen_mlp` starts a wider one
from a trained one: each draft layer gains the target neurons its warm start left out, computing the same function
until training moves their output weights off zero.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from ..configuration_longspark import LongSparkConfig
from ..modeling_longspark import LongSparkDrafterModel


def warm_start_config(target: PreTrainedModel, **overrides: Any) -> LongSparkConfig:
    """The drafter config for `target` with head norms where the target has them (`use_qk_norm`)."""
    attention = target.get_decoder().layers[0].self_attn
    overrides.setdefault("use_qk_norm", hasattr(attention, "q_norm"))
    return LongSparkConfig.from_target_config(target.config, **overrides)


@torch.no_grad()
def init_from_target(drafter: LongSparkDrafterModel, target: PreTrainedModel) -> LongSparkDrafterModel:
    """Copies target layer `S[j]` into draft layer `j` (see the module docstring); returns `drafter`."""
    config = drafter.config
    has_head_norms = hasattr(target.get_decoder().layers[0].self_attn, "q_norm")
    if has_head_norms != config.use_qk_norm:
        raise ValueError(
            f"The target {'has' if has_head_norms else 'has no'} per-head q/k norms but the drafter's use_qk_norm is "
            f"{config.use_qk_norm}; build the drafter config with `warm_start_config(target)`."
        )
    target_layers = target.get_decoder().layers
    for draft_layer, layer_id in zip(drafter.layers, config.target_layer_ids):
        source = target_layers[layer_id]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", *(("q_norm", "k_norm") if has_head_norms else ())):
            _copy(getattr(draft_layer.self_attn, name), getattr(source.self_attn, name))
        _copy(draft_layer.input_layernorm, source.input_layernorm)
        _copy(draft_layer.post_attention_layernorm, source.post_attention_layernorm)
        _copy_mlp(draft_layer.mlp, source.mlp)
    hidden = config.hidden_size
    drafter.project_inputs.weight.zero_()
    drafter.project_inputs.weight[:, :hidden].copy_(torch.eye(hidden))
    drafter.block_positions.weight.zero_()
    drafter.markov_proj.weight.zero_()
    return drafter


@torch.no_grad()
def select_target_layers(drafter: LongSparkDrafterModel, target_layer_ids: list[int]) -> LongSparkDrafterModel:
    """A copy of `drafter` that reads only `target_layer_ids`, a subset of its `target_layer_ids`, in its order:
    draft layer `j` of the copy is the draft layer of `target_layer_ids[j]`, with that layer's summary queries and
    the columns of `fuse_boundary` that read its boundary state; every other weight is shared by all layers."""
    current = list(drafter.config.target_layer_ids)
    missing = [i for i in target_layer_ids if i not in current]
    if missing or not target_layer_ids or sorted(set(target_layer_ids)) != list(target_layer_ids):
        raise ValueError(
            f"target_layer_ids {list(target_layer_ids)} must be a non-empty increasing subset of the init drafter's "
            f"{current} to select its layers; start a fresh drafter for others."
        )
    keep = [current.index(i) for i in target_layer_ids]
    config = copy.deepcopy(drafter.config)
    config.target_layer_ids = list(target_layer_ids)
    model = type(drafter)(config).to(device=drafter.device, dtype=drafter.dtype)
    model.generation_config = copy.deepcopy(drafter.generation_config)
    hidden = config.hidden_size
    state = {}
    for name, tensor in drafter.state_dict().items():
        if name.startswith("layers."):
            index, rest = name[len("layers.") :].split(".", 1)
            if int(index) in keep:
                state[f"layers.{keep.index(int(index))}.{rest}"] = tensor
        elif name == "summary_queries":
            state[name] = tensor[keep]
        elif name == "fuse_boundary.weight":
            state[name] = torch.cat([tensor[:, j * hidden : (j + 1) * hidden] for j in keep], dim=1)
        else:
            state[name] = tensor
    model.load_state_dict(state)
    return model


@torch.no_grad()
def widen_mlp(drafter: LongSparkDrafterModel, intermediate_size: int, target: PreTrainedModel) -> LongSparkDrafterModel:
    """A copy of `drafter` whose MLPs are `intermediate_size` wide and compute the same function. Draft layer `j`
    keeps its neurons and gains the next ones of target layer `S[j]` in warm start's order (largest weight first,
    skipping those warm start kept): their gate and up rows from the target, their down columns zero, so that training
    starts where `drafter` stands. The drafter's few-row forward is bound by dispatch more than by its weights' bytes,
    so width is cheap capacity: SmolLM2's drafter at 1,536 instead of 1,024 prices a round 7% higher
    (docs/results.md, "Stage 8")."""
    width = drafter.config.intermediate_size
    target_layers = target.get_decoder().layers
    available = target_layers[0].mlp.up_proj.out_features
    if not width < intermediate_size <= available:
        raise ValueError(
            f"intermediate_size {intermediate_size} must be wider than the init drafter's {width} and at most the "
            f"target's {available}, whose neurons the new ones are."
        )
    config = copy.deepcopy(drafter.config)
    config.intermediate_size = intermediate_size
    model = type(drafter)(config).to(device=drafter.device, dtype=drafter.dtype)
    model.generation_config = copy.deepcopy(drafter.generation_config)
    others = {name: tensor for name, tensor in drafter.state_dict().items() if ".mlp." not in name}
    model.load_state_dict(others, strict=False)  # the MLPs, whose shapes differ, below
    for old, new, layer_id in zip(drafter.layers, model.layers, config.target_layer_ids, strict=True):
        source = target_layers[layer_id].mlp
        added = _neurons_by_weight(source)[width:intermediate_size]
        for name in ("gate_proj", "up_proj"):
            rows = torch.cat([getattr(old.mlp, name).weight, getattr(source, name).weight[added]])
            getattr(new.mlp, name).weight.copy_(rows)
        new.mlp.down_proj.weight.zero_()
        new.mlp.down_proj.weight[:, :width].copy_(old.mlp.down_proj.weight)
    return model


def _neurons_by_weight(mlp: nn.Module) -> torch.Tensor:
    """The indices of a SwiGLU MLP's neurons, largest weight (`|up_n| * |gate_n| * |down_n|`) first."""
    weight = mlp.gate_proj.weight.norm(dim=1) * mlp.up_proj.weight.norm(dim=1) * mlp.down_proj.weight.norm(dim=0)
    return weight.argsort(descending=True, stable=True)


def _copy(destination: nn.Module, source: nn.Module) -> None:
    for name, tensor in source.state_dict().items():
        destination.state_dict()[name].copy_(tensor)


def _copy_mlp(destination: nn.Module, source: nn.Module) -> None:
    """SwiGLU `down(act(gate(x)) * up(x))`: all neurons, or the `width` of largest weight when narrower."""
    width = destination.up_proj.out_features
    gate, up, down = source.gate_proj.weight, source.up_proj.weight, source.down_proj.weight
    if width > gate.shape[0]:
        raise ValueError(f"The drafter's MLP ({width}) is wider than the target's ({gate.shape[0]}).")
    keep = _neurons_by_weight(source)[:width].sort().values
    destination.gate_proj.weight.copy_(gate[keep])
    destination.up_proj.weight.copy_(up[keep])
    destination.down_proj.weight.copy_(down[:, keep])


__all__ = ["init_from_target", "select_target_layers", "warm_start_config", "widen_mlp"]
