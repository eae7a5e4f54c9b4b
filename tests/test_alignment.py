"""The drafter sees the right context: inference views over many verification rounds equal the teacher-forced
training views at the same anchors, and the training batch is aligned token by token with the sequence.

A drafter that reads a shifted boundary, window, position or token still generates losslessly (the target verifies
every draft), so exactness tests cannot see these bugs; they only lower tau. `scripts/mutation_check.py` checks that
the tests here catch the plausible one-line off-by-ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pytest
import torch
from transformers import DynamicCache

from helpers import make_drafter, make_target
from transformers_longspark.context_state import DraftContext
from transformers_longspark.inference.drafting import DraftSettings
from transformers_longspark.inference.generation import LongSparkCandidateGenerator
from transformers_longspark.training.data import Sequence, load_sequences
from transformers_longspark.training.distillation import sample_anchors, teacher_forced_batch

WINDOW, BLOCK, VOCAB = 8, 4, 64
VIEW_TOL = {"rtol": 1e-5, "atol": 1e-5}
LOGIT_TOL = {"rtol": 1e-4, "atol": 1e-4}
# Accepted drafts per round: every length 0..B, repeated, in an order that mixes short and full blocks.
SCHEDULE = [0, 4, 1, 3, 2, 4, 0, 2, 4, 1, 3, 0, 4, 2]
ABLATIONS = [{}, {"use_global_summary": False}, {"use_boundary_state": False}, {"use_recent_window": False},
             {"full_prefix_context": True}, {"draft_vocab_size": 40}]  # fmt: skip


def alignment_drafter(target, seed: int = 1, **overrides):
    """A random drafter whose Markov correction is not zero, so a wrong predecessor changes its logits."""
    draft_vocab_size = overrides.pop("draft_vocab_size", None)
    drafter = make_drafter(target, seed=seed, window_size=WINDOW, block_size=BLOCK, **overrides)
    with torch.no_grad():
        drafter.markov_proj.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
    if draft_vocab_size is not None:
        vocab = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:draft_vocab_size]
        drafter = drafter.with_draft_vocab(vocab).eval()
    drafter.generation_config.assistant_confidence_threshold = 0.0  # whole blocks: the schedule forces acceptance
    drafter.linear_dtype = torch.float32  # the training views run in fp32: compare logits at the same precision
    drafter.bind_target(target)
    return drafter


# --- 1. inference views over many rounds == training views at the same anchors ---------------------------------


@dataclass
class Round:
    """What one drafting round saw and produced. `t` = cached target rows when it ran, `drafted` = `[a, y_1..y_n]`."""

    t: int
    accepted: int
    block_ids: torch.Tensor
    context: DraftContext
    base_logits: torch.Tensor
    drafted: torch.Tensor
    logits: torch.Tensor


def _clone_context(context: DraftContext) -> DraftContext:
    clone = [t.clone() for t in (context.boundary_states, context.positions)]
    mask = None if context.window_mask is None else context.window_mask.clone()
    return DraftContext(clone[0], [k.clone() for k in context.window_keys], [v.clone() for v in context.window_values],
                        mask, [s.clone() for s in context.summary_values], clone[1])  # fmt: skip


def forced_generate(target, drafter, prompt, schedule, monkeypatch) -> tuple[torch.Tensor, list[Round]]:
    """Greedy assisted `generate` in which round `r` accepts exactly `schedule[r]` drafts: after the drafter proposes,
    its first `k` tokens are replaced by the target's greedy tokens and the next one by a wrong token. Records the
    drafter's actual inputs (via a forward hook) and the logits `get_candidates` returns for its own drafts."""
    reference = target.generate(prompt, do_sample=False, max_new_tokens=1 + sum(k + 1 for k in schedule))
    rounds, seen = [], {}

    def record_forward(module, args, output):
        seen.update(block_ids=args[0].clone(), context=_clone_context(args[1]), base_logits=output.base_logits.clone())

    original_get_candidates = LongSparkCandidateGenerator.get_candidates

    def get_candidates(self, *args, **kwargs):
        candidate_ids, logits = original_get_candidates(self, *args, **kwargs)
        if logits is None:  # the prefill: no drafts
            return candidate_ids, logits
        input_ids = args[0] if args else kwargs["input_ids"]
        t, n = input_ids.shape[1] - 1, logits.shape[1]
        k = min(schedule[len(rounds)], n)
        forced = candidate_ids.clone()
        forced[0, t + 1 : t + 1 + k] = reference[0, t + 1 : t + 1 + k]
        if k < n:
            forced[0, t + 1 + k] = (reference[0, t + 1 + k] + 1) % target.config.vocab_size
        rounds.append(Round(t, k, drafted=candidate_ids[0, t:].clone(), logits=logits[0].clone(), **seen))
        return forced, logits

    handle = drafter.register_forward_hook(record_forward)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(LongSparkCandidateGenerator, "get_candidates", get_candidates)
            # Greedy rounds skip their logits (the verifier compares tokens); keep them to compare with training.
            for_generate = DraftSettings.for_generate.__func__
            keep_logits = classmethod(lambda cls, *a, **k: replace(for_generate(cls, *a, **k), return_logits=True))
            patch.setattr(DraftSettings, "for_generate", keep_logits)
            output = target.generate(prompt, do_sample=False, max_new_tokens=reference.shape[1] - prompt.shape[1],
                                     assistant_model=drafter)  # fmt: skip
    finally:
        handle.remove()
    assert torch.equal(output, reference)
    # Each round advanced the sequence by exactly its scheduled acceptance plus one token.
    ends = [r.t for r in rounds[1:]] + [output.shape[1] - 1]
    assert [end - r.t - 1 for r, end in zip(rounds, ends)] == [r.accepted for r in rounds] == schedule[: len(rounds)]
    return output, rounds


@pytest.mark.parametrize("overrides", ABLATIONS, ids=lambda o: ",".join(o) or "full")
def test_multi_round_inference_views_equal_training_views(target_kind, overrides, monkeypatch):
    """Over 14 rounds accepting 0..B drafts, each round's block ids, position, boundary states (the last ACCEPTED
    position), window and summary equal the teacher-forced views at anchor t on the final sequence; its logits equal
    the training-context logits given its own predecessors, and the batched training logits where those predecessors
    are the true ones. For the full model and every ablation switch."""
    target = make_target(target_kind)
    drafter = alignment_drafter(target, **overrides)
    config = drafter.config
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    output, rounds = forced_generate(target, drafter, prompt, SCHEDULE, monkeypatch)
    assert len(rounds) == len(SCHEDULE)
    ids = output[0]
    anchors = torch.tensor([r.t for r in rounds])
    batch = teacher_forced_batch(target, drafter, Sequence(ids, prompt.shape[1]), anchors)
    own_previous = torch.full_like(batch.previous_ids, config.mask_token_id)
    for a, r in enumerate(rounds):
        own_previous[a, : r.logits.shape[0]] = r.drafted[: r.logits.shape[0]]
    with torch.no_grad():
        trained = drafter(batch.block_ids, batch.context, batch.previous_ids)
        own = drafter(batch.block_ids, batch.context, own_previous).logits

    use_window = config.use_recent_window or config.full_prefix_context
    use_summary = config.use_global_summary and not config.full_prefix_context
    for a, r in enumerate(rounds):
        context, expected = r.context, batch.context
        assert context.positions.tolist() == [r.t] == [int(expected.positions[a])], f"round {a}: RoPE position"
        assert torch.equal(r.block_ids[0], batch.block_ids[a]), f"round {a}: block ids"
        torch.testing.assert_close(context.boundary_states[0], expected.boundary_states[a], **VIEW_TOL,
                                   msg=f"round {a} (t={r.t}, accepted {r.accepted}): boundary states")  # fmt: skip
        assert len(context.window_keys) == len(expected.window_keys) == (config.num_draft_layers if use_window else 0)
        assert len(context.summary_values) == len(expected.summary_values) == (config.num_draft_layers * use_summary)
        real = slice(None) if expected.window_mask is None else expected.window_mask[a]
        for j in range(len(context.window_keys)):
            assert context.window_keys[j].shape[2] == (r.t if config.full_prefix_context else min(WINDOW, r.t))
            torch.testing.assert_close(context.window_keys[j][0], expected.window_keys[j][a][:, real], **VIEW_TOL,
                                       msg=f"round {a}: window keys, layer {j}")  # fmt: skip
            torch.testing.assert_close(context.window_values[j][0], expected.window_values[j][a][:, real], **VIEW_TOL)
        for j in range(len(context.summary_values)):
            torch.testing.assert_close(context.summary_values[j][0], expected.summary_values[j][a], **VIEW_TOL,
                                       msg=f"round {a}: summary, layer {j}")  # fmt: skip
        torch.testing.assert_close(r.base_logits[0], trained.base_logits[a], **LOGIT_TOL)
        n = r.logits.shape[0]
        torch.testing.assert_close(r.logits, drafter.to_target_vocab(own[a, :n]), **LOGIT_TOL,
                                   msg=f"round {a}: logits given the round's own predecessors")  # fmt: skip
        coincide = (r.drafted[:n] == ids[r.t : r.t + n]).nonzero()[:, 0]
        assert 0 in coincide.tolist()  # slot 0's predecessor is the anchor token a = ids[t]
        torch.testing.assert_close(
            r.logits[coincide],
            drafter.to_target_vocab(trained.logits[a, coincide]),
            **LOGIT_TOL,
            msg=f"round {a}: logits where the predecessors are the true ones",
        )


# --- 2. the training batch, token by token, against direct reads of the target ---------------------------------


def reference_summary(queries, keys, values):
    """softmax(U K^T / sqrt(d)) V in float64, `(heads, m, d)` for keys/values `(heads, rows, d)`."""
    scores = torch.einsum("hmd,htd->hmt", queries.double(), keys.double()) / queries.shape[-1] ** 0.5
    return torch.einsum("hmt,htd->hmd", scores.softmax(-1), values.double())


@torch.no_grad()
def assert_batch_aligned(target, drafter, ids: torch.Tensor, anchors: torch.Tensor, batch) -> None:
    """Asserts a `TeacherForcedBatch` built for `anchors` of the token sequence `ids` is aligned with it, against one
    plain target forward (hidden states, a `DynamicCache`, logits): block ids, predecessors, labels, validity,
    positions, boundary states at t - 1, window = cache rows [t - W, t), summary over rows [0, t) and `p_i`.
    Reusable for any sequence layout whose anchor `t` means "the target cached ids[:t], a = ids[t]"."""
    config = drafter.config
    num_tokens, block = ids.shape[0], config.block_size
    cache = DynamicCache(config=target.config)
    out = target(ids[None], cache=cache, use_cache=True, output_hidden_states=True)
    last_layer = target.config.num_hidden_layers - 1
    hidden, size = out.hidden_states, config.hidden_size
    use_window = config.use_recent_window or config.full_prefix_context
    use_summary = config.use_global_summary and not config.full_prefix_context
    assert torch.equal(batch.context.positions, anchors), "positions (RoPE) are not the anchors"
    for a, t in enumerate(anchors.tolist()):
        assert batch.block_ids[a, 0] == ids[t], f"anchor t={t}: block_ids[0] is not a = ids[t]"
        assert (batch.block_ids[a, 1:] == config.mask_token_id).all()
        steps = [i for i in range(block) if t + 1 + i < num_tokens]
        assert batch.valid[a].tolist() == [i in steps for i in range(block)]
        assert batch.previous_ids[a, steps].tolist() == ids[t : t + len(steps)].tolist(), f"t={t}: predecessors"
        labels = drafter.draft_indices(ids[t + 1 : t + 1 + len(steps)])
        assert batch.labels[a, steps].tolist() == labels.tolist(), f"t={t}: labels are not ids[t + 1 + i]"
        p = out.logits[0, t : t + len(steps)].float().softmax(-1)
        if config.draft_vocab_size is not None:
            p = p[:, drafter.draft_vocab]
        torch.testing.assert_close(batch.target_probs[a, steps], p, rtol=1e-4, atol=1e-6)

        for j, layer in enumerate(config.target_layer_ids):
            state = batch.context.boundary_states[a, j * size : (j + 1) * size]
            if layer == last_layer:  # the last entry of `hidden_states` is after the final norm
                state, expected = target.model.norm(state), hidden[-1][0, t - 1]
            else:
                expected = hidden[layer + 1][0, t - 1]
            torch.testing.assert_close(state, expected, **VIEW_TOL, msg=f"t={t}: boundary of layer {layer}")
            keys, values = cache.layers[layer].keys[0], cache.layers[layer].values[0]
            if use_window:
                width = t if config.full_prefix_context else min(config.window_size, t)
                mask = batch.context.window_mask[a]
                assert mask.sum() == width and mask[mask.shape[0] - width :].all(), f"t={t}: window mask"
                for name, got, rows in (("keys", batch.context.window_keys[j], keys),
                                        ("values", batch.context.window_values[j], values)):  # fmt: skip
                    torch.testing.assert_close(got[a][:, mask], rows[:, t - width : t], **VIEW_TOL,
                                               msg=f"t={t}: window {name} are not rows [t - W, t)")  # fmt: skip
            if use_summary:
                expected = reference_summary(drafter.summary_queries[j], keys[:, :t], values[:, :t])
                torch.testing.assert_close(batch.context.summary_values[j][a].double(), expected, **VIEW_TOL,
                                           msg=f"t={t}: summary is not over rows [0, t)")  # fmt: skip
    assert len(batch.context.window_keys) == config.num_draft_layers * use_window
    assert len(batch.context.summary_values) == config.num_draft_layers * use_summary


def write_chat_records(path, target, num: int = 2, prompt_length: int = 6, response_length: int = 30) -> None:
    """Regenerated-chat JSONL records (`prompt_ids`, `response_ids` sampled from the target), as `regenerate` writes."""
    torch.manual_seed(7)
    with path.open("w") as f:
        for i in range(num):
            prompt = torch.randint(0, VOCAB, (1, prompt_length + i))
            response = target.generate(prompt, do_sample=True, max_new_tokens=response_length)[0, prompt.shape[1] :]
            f.write(json.dumps({"id": i, "prompt_ids": prompt[0].tolist(), "response_ids": response.tolist()}) + "\n")


@pytest.mark.parametrize("overrides", ABLATIONS, ids=lambda o: ",".join(o) or "full")
def test_teacher_forced_batch_is_aligned_with_the_sequence(target_kind, overrides, tmp_path):
    """For regenerated-chat records and sampled anchors (plus the first and last response anchors): a = ids[t],
    predecessors ids[t:t+B], labels ids[t+1:t+1+B] (draft columns), window rows [t-W, t), summary over [0, t),
    boundary at t-1, p_i from position t+i; for every ablation switch and with a draft vocabulary."""
    target = make_target(target_kind)
    drafter = alignment_drafter(target, **overrides)
    write_chat_records(tmp_path / "part-00000.jsonl", target)
    sequences = load_sequences(tmp_path, max_seq_len=64)
    assert len(sequences) == 2
    generator = torch.Generator().manual_seed(0)
    for sequence in sequences:
        ids, low = sequence.ids, sequence.prompt_length
        anchors = sample_anchors(sequence, 6, generator)
        anchors = torch.cat([anchors, torch.tensor([low, low + 1, len(ids) - 3, len(ids) - 2])]).unique()
        assert anchors.min() == low and anchors.max() == len(ids) - 2 and (anchors < WINDOW).any()
        batch = teacher_forced_batch(target, drafter, sequence, anchors)
        assert_batch_aligned(target, drafter, ids, anchors, batch)
    if drafter.config.draft_vocab_size is not None:
        assert (batch.labels == -1).any() and (batch.labels >= 0).any()  # both kinds of labels were checked
