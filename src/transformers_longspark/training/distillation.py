"""One training example and the distillation loss (the paper's Section 2.4, "Training and
inference", and Appendix B.2).

A training example is one regenerated chat (`Sequence`: the chat-templated prompt followed by the target's own
response, as `longspark regenerate` writes it) and a sample of anchors `t` in its response; each anchor's block
is `[a = ids[t], MASK, ...]`, labelled with the true continuation `ids[t + 1 + i]`.

For each sequence, ONE target forward gives every anchor's context: the selected layers' hidden states (boundary
states), their K/V rows (recent windows, and the global summaries through one causal prefix attention of the
summary queries) and the final hidden states (the target distributions `p_i`). The drafter then runs the same
forward as at inference on all anchors at once, with the Markov correction fed the true predecessors, and the loss
`L_i = w_i [lam * CE + (1 - lam) * ||p_i - q_i||_1]`, `w_i = exp(-(i - 1) / decay)`, is normalised by the weights.
`divergence="kl"` replaces the paper's L1 distance by the forward KL divergence `KL(p_i || q_i)` (EAGLE-3's soft
cross-entropy), a recipe option (docs/results.md, "Recipe campaign": it did not beat L1 here). `feature_weight > 0`
adds EAGLE's feature regression (a design option, not the paper's): the smooth-L1 distance between each slot's final
normed feature and the target's at the same position (the vector its LM head turns into `p_i`), with the same
position weights: a dense signal on every feature dimension where the L1 distance of two distributions has little
gradient on the tokens the target gives little mass (at weight 1 it lost to the paper's loss alone there too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..configuration_longspark import LongSparkConfig
from ..context_state import DraftContext, boundary_states, prefix_columns, prefix_summaries, window_views
from ..modeling_longspark import LongSparkDrafterModel
from ..targets import HiddenStateCapture, TargetModules, target_modules
from .data import Sequence

# The loss's defaults (`draft_loss`; `TrainingConfig` starts from them): lam, and the decay of the position weights.
CE_WEIGHT = 0.1
POSITION_DECAY = 4.0
DIVERGENCES = ("l1", "kl")  # the distance between p_i and q_i in the loss: the paper's L1, or forward KL


def sample_anchors(sequence: Sequence, max_anchors: int, generator: torch.Generator) -> torch.LongTensor:
    """Up to `max_anchors` distinct anchors `t` (cached rows), `anchor_start <= t <= T - 2`, sorted."""
    low, high = sequence.anchor_start, len(sequence.ids) - 1
    candidates = torch.arange(low, high)
    if len(candidates) > max_anchors:
        candidates = candidates[torch.randperm(len(candidates), generator=generator)[:max_anchors]].sort().values
    return candidates


# --- teacher-forced views and the loss ------------------------------------------------------------------------


@dataclass
class TeacherForcedBatch:
    """Everything one drafter forward and the loss need, for `A` anchors of one sequence."""

    block_ids: torch.LongTensor  # (A, B): [a, MASK, ...]
    previous_ids: torch.LongTensor  # (A, B): true predecessor of each draft token
    labels: torch.LongTensor  # (A, B): drafter-logit column of x[t+1+i]; -1 when the drafter cannot propose it
    valid: torch.BoolTensor  # (A, B): label exists
    target_probs: torch.Tensor  # (A, B, V'): teacher-forced p_i of the tokens the drafter scores
    target_features: torch.Tensor  # (A, B, hidden): the target's final normed features that give p_i
    context: DraftContext


@torch.no_grad()
def _target_pass(target, modules: TargetModules, config: LongSparkConfig, ids: torch.LongTensor):
    """One forward of the frozen target: selected hidden states, selected K/V rows, final normed hidden states."""
    from transformers import DynamicCache

    capture = HiddenStateCapture(modules.layers, config.target_layer_ids, keep=None)
    cache = DynamicCache(config=target.config)
    try:
        final_hidden = target.get_decoder()(input_ids=ids[None], cache=cache, use_cache=True).last_hidden_state
    finally:
        capture.remove()
    kv = [(cache.layers[i].keys, cache.layers[i].values) for i in config.target_layer_ids]
    return capture.states, kv, final_hidden[0]


def teacher_forced_batch(
    target,
    drafter: LongSparkDrafterModel,
    sequence: Sequence,
    anchors: torch.LongTensor,
    window_dropout: float = 0.0,
    generator: torch.Generator | None = None,
) -> TeacherForcedBatch:
    """Builds the anchors' context views from one target pass, exactly as inference would see them.

    `window_dropout`: the fraction of anchors (drawn with `generator`) whose recent window is masked out, so that
    they must draft from the boundary state and the global summary alone (a training option; 0: the paper's)."""
    config = drafter.config
    ids = sequence.ids.to(drafter.device)
    anchors = anchors.to(ids.device)
    modules = target_modules(target)
    hidden, kv, final_hidden = _target_pass(target, modules, config, ids)
    num_rows = ids.shape[0]
    steps = torch.arange(config.block_size, device=ids.device)

    label_positions = anchors[:, None] + 1 + steps  # x[t+1+i], i = 0..B-1
    valid = label_positions < num_rows
    label_positions = label_positions.clamp(max=num_rows - 1)
    previous_ids = ids[label_positions - 1]
    block_ids = torch.full_like(previous_ids, config.mask_token_id)
    block_ids[:, 0] = ids[anchors]
    labels = drafter.draft_indices(ids[label_positions])
    # Anchors' blocks overlap, so the target distributions are computed once per distinct position.
    positions, inverse = torch.unique(label_positions - 1, return_inverse=True)
    with torch.no_grad():
        log_p = modules.lm_head(final_hidden[positions]).float().log_softmax(dim=-1)
        if config.draft_vocab_size is not None:
            log_p = log_p[:, drafter.draft_vocab.to(log_p.device)]
        target_probs = log_p.exp()[inverse]
    target_features = final_hidden[label_positions - 1]

    # The same context views as inference reads (context_state.py), for every anchor's prefix `ids[:t]` at once.
    boundary = boundary_states(hidden, anchors - 1)
    window_keys, window_values, window_mask = [], [], None
    if config.reads_window:
        columns = prefix_columns(anchors, num_rows)
        window_keys, window_values, window_mask = window_views(kv, columns, config.window_width(int(anchors.max())))
        if window_dropout > 0:
            dropped = torch.rand(len(anchors), generator=generator) < window_dropout
            window_mask = window_mask & ~dropped.to(window_mask.device)[:, None]
    summary_values = []
    if config.reads_summary:
        for j, (keys, values) in enumerate(kv):
            summary_values.append(prefix_summaries(drafter.summary_queries[j], keys, values, anchors))
    context = DraftContext(boundary, window_keys, window_values, window_mask, summary_values, anchors)
    return TeacherForcedBatch(block_ids, previous_ids, labels, valid, target_probs, target_features, context)


def draft_loss(
    logits: torch.Tensor,
    target_probs: torch.Tensor,
    labels: torch.LongTensor,
    valid: torch.BoolTensor,
    ce_weight: float = CE_WEIGHT,
    position_decay: float = POSITION_DECAY,
    divergence: str = "l1",
) -> torch.Tensor:
    """`sum_i w_i [lam * -log q_i(x) + (1 - lam) * D(p_i, q_i)] / sum_i w_i` over valid positions, where `D` is
    `||p_i - q_i||_1` (`divergence="l1"`, the paper's) or `KL(p_i || q_i)` (`"kl"`).

    With a draft vocabulary, `q_i` is 0 outside it: those tokens add their target mass `1 - sum(target_probs)` to
    the L1 distance, KL compares `q_i` with `p_i` renormalised over the draft vocabulary (outside it, KL would be
    infinite), and a label outside it (`-1`) adds no cross-entropy term (its `-log q` is infinite).

    Args:
        logits: `(A, B, V')` drafter logits. target_probs: `(A, B, V')` target probabilities of the same tokens.
        labels: `(A, B)` column of the true token in `logits`, or `-1`. valid: `(A, B)`, False past the sequence.
    """
    log_q = F.log_softmax(logits.float(), dim=-1)
    nll = -log_q.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * (labels >= 0)
    if divergence == "l1":
        unreachable_mass = (1.0 - target_probs.sum(-1)).clamp(min=0.0)
        distance = (target_probs - log_q.exp()).abs().sum(-1) + unreachable_mass
    elif divergence == "kl":
        p = target_probs / target_probs.sum(-1, keepdim=True).clamp(min=1e-12)
        distance = (torch.xlogy(p, p) - p * log_q).sum(-1)
    else:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}.")
    positions = torch.arange(labels.shape[1], device=labels.device, dtype=torch.float32)
    weights = torch.exp(-positions / position_decay)[None].expand_as(nll) * valid
    per_position = ce_weight * nll + (1.0 - ce_weight) * distance
    return (weights * per_position).sum() / weights.sum()


def feature_loss(
    features: torch.Tensor,
    target_features: torch.Tensor,
    valid: torch.BoolTensor,
    position_decay: float = POSITION_DECAY,
) -> torch.Tensor:
    """`sum_i w_i * mean_d smooth_l1(h_i, h*_i) / sum_i w_i` over valid positions (EAGLE's feature regression).

    Args:
        features: `(A, B, H)` the drafter's final normed slot features. target_features: `(A, B, H)` the target's
            at the same positions. valid: `(A, B)`, False past the sequence.
    """
    distance = F.smooth_l1_loss(features.float(), target_features.float(), reduction="none").mean(-1)
    positions = torch.arange(valid.shape[1], device=valid.device, dtype=torch.float32)
    weights = torch.exp(-positions / position_decay)[None].expand_as(distance) * valid
    return (weights * distance).sum() / weights.sum()


def sequence_loss(
    target,
    drafter,
    sequence: Sequence,
    anchors: torch.LongTensor,
    ce_weight: float = CE_WEIGHT,
    position_decay: float = POSITION_DECAY,
    window_dropout: float = 0.0,
    generator: torch.Generator | None = None,
    divergence: str = "l1",
    feature_weight: float = 0.0,
) -> torch.Tensor:
    """`draft_loss` (plus `feature_weight` times `feature_loss`) of the anchors of one sequence; `drafter` may be
    wrapped (DDP: `.module`)."""
    model = drafter.module if hasattr(drafter, "module") else drafter
    batch = teacher_forced_batch(target, model, sequence, anchors, window_dropout, generator)
    output = drafter(batch.block_ids, batch.context, batch.previous_ids)
    loss = draft_loss(
        output.logits, batch.target_probs, batch.labels, batch.valid, ce_weight, position_decay, divergence
    )
    if feature_weight:
        loss = loss + feature_weight * feature_loss(
            output.hidden_states, batch.target_features, batch.valid, position_decay
        )
    return loss


__all__ = [
    "CE_WEIGHT",
    "POSITION_DECAY",
    "DIVERGENCES",
    "sample_anchors",
    "TeacherForcedBatch",
    "teacher_forced_batch",
    "draft_loss",
    "feature_loss",
    "sequence_loss",
]
