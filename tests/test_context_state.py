"""The summary math: incremental folding equals recomputation, and training's prefix summaries equal inference's."""

import torch
from transformers import DynamicCache, GenerationConfig

from helpers import make_drafter, make_target
from transformers_longspark.context_state import (
    LongSparkContextState,
    merge_summaries,
    prefix_summaries,
    summarize_rows,
)
from transformers_longspark.inference.generation import LongSparkCandidateGenerator


def reference_summary(queries, keys, values):
    """softmax(U K^T / sqrt(d)) V computed directly, `(1, heads, m, d)`."""
    scores = torch.einsum("hmd,nhtd->nhmt", queries.double(), keys.double()) / queries.shape[-1] ** 0.5
    return torch.einsum("nhmt,nhtd->nhmd", scores.softmax(-1), values.double())


def test_merge_equals_union():
    torch.manual_seed(0)
    queries, keys, values = torch.randn(2, 4, 8), 3 * torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
    la, oa = summarize_rows(queries, keys[:, :, :11], values[:, :, :11])
    lb, ob = summarize_rows(queries, keys[:, :, 11:], values[:, :, 11:])
    log_norm, out = merge_summaries(la, oa, lb, ob)
    full_log_norm, full_out = summarize_rows(queries, keys, values)
    torch.testing.assert_close(log_norm, full_log_norm)
    torch.testing.assert_close(out, full_out)
    torch.testing.assert_close(out.double(), reference_summary(queries, keys, values), rtol=1e-5, atol=1e-5)


def test_chunked_absorb_is_stable_for_large_scores():
    torch.manual_seed(0)
    queries, keys, values = torch.randn(2, 4, 8), 60 * torch.randn(1, 2, 100, 8), torch.randn(1, 2, 100, 8)
    state = LongSparkContextState(num_layers=1, chunk_size=7)
    state.absorb(queries[None], [keys], [values])
    assert torch.isfinite(state.summaries[0]).all()
    reference = reference_summary(queries, keys, values)
    torch.testing.assert_close(state.summaries[0].double(), reference, rtol=1e-5, atol=1e-5)


def test_incremental_summary_equals_recomputation_over_50_rounds_with_crops(target_kind):
    """Drives the candidate generator like assisted decoding does: prefill, then 50 rounds that append a block to the
    target cache and crop it to a random acceptance length. After every update the summary must equal a from-scratch
    softmax(U K^T / sqrt(d)) V over all retained rows."""
    target = make_target(target_kind)
    drafter = make_drafter(target, window_size=8, summary_chunk_size=5)
    generator_rng = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 64, (1, 23), generator=generator_rng)
    config = GenerationConfig(max_length=10_000, do_sample=False)
    generator = LongSparkCandidateGenerator(target, drafter, prompt, config)
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        outputs = target(prompt, cache=cache)
    input_ids = torch.cat([prompt, outputs.logits[:, -1:].argmax(-1)], dim=1)
    n_matches = 0
    generator.get_candidates(input_ids, {"cache": cache}, outputs, is_first_iteration=True, n_last_matches=0)
    for _ in range(50):
        candidates, _ = generator.get_candidates(
            input_ids, {"cache": cache}, outputs, is_first_iteration=False, n_last_matches=n_matches
        )
        for j, layer_id in enumerate(drafter.config.target_layer_ids):
            layer = cache.layers[layer_id]
            expected = reference_summary(drafter.summary_queries[j].detach(), layer.keys, layer.values)
            torch.testing.assert_close(generator.state.summaries[j].double(), expected, rtol=1e-5, atol=1e-5)
        assert generator.state.num_absorbed == cache.get_seq_length() == input_ids.shape[1] - 1
        block = candidates[:, input_ids.shape[1] - 1 :]
        with torch.no_grad():
            outputs = target(block, cache=cache)
        n_matches = int(torch.randint(0, block.shape[1], (1,), generator=generator_rng))
        cache.crop(-(block.shape[1] - 1 - n_matches))
        bonus = torch.randint(0, 64, (1, 1), generator=generator_rng)
        input_ids = torch.cat([input_ids, block[:, 1 : 1 + n_matches], bonus], dim=1)


def test_state_size_does_not_depend_on_prefix_length():
    target = make_target("qwen3")
    drafter = make_drafter(target)
    sizes = []
    for length in (5, 40, 300):
        prompt = torch.randint(0, 64, (1, length))
        target.generate(prompt, max_new_tokens=6, do_sample=False, assistant_model=drafter)
        sizes.append(drafter.drafting_stats.context_state_bytes)
    config = drafter.config
    per_layer = config.num_key_value_heads * config.num_summary_queries * (config.head_dim + 1) * 4
    expected = config.num_draft_layers * (per_layer + config.hidden_size * 4)
    assert sizes == [expected] * 3


def test_layers_absorbed_together_equal_each_layer_alone():
    torch.manual_seed(0)
    queries = torch.randn(3, 2, 4, 8)  # 3 layers
    keys, values = [3 * torch.randn(2, 2, 20, 8) for _ in range(3)], [torch.randn(2, 2, 20, 8) for _ in range(3)]
    mask = torch.rand(2, 20) > 0.3
    together = LongSparkContextState(num_layers=3, chunk_size=6)
    together.absorb(queries, [k[:, :, :9] for k in keys], [v[:, :, :9] for v in values], mask[:, :9])
    together.absorb(queries, [k[:, :, 9:] for k in keys], [v[:, :, 9:] for v in values], mask[:, 9:])
    for j in range(3):
        alone = LongSparkContextState(num_layers=1, chunk_size=20)
        alone.absorb(queries[j : j + 1], keys[j : j + 1], values[j : j + 1], mask)
        torch.testing.assert_close(together.summaries[j], alone.summaries[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(together.log_norm[j], alone.log_norm[0], rtol=1e-5, atol=1e-5)


def test_prefix_summaries_equal_incremental_summaries():
    torch.manual_seed(0)
    queries, keys, values = torch.randn(2, 4, 8), 2 * torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    anchors = torch.tensor([1, 7, 19, 40])
    batched = prefix_summaries(queries, keys, values, anchors)
    for a, t in enumerate(anchors.tolist()):
        state = LongSparkContextState(num_layers=1, chunk_size=3)
        state.absorb(queries[None], [keys[:, :, :t]], [values[:, :, :t]])
        torch.testing.assert_close(batched[a : a + 1], state.summaries[0], rtol=1e-5, atol=1e-5)


def test_stacked_contexts_draft_as_each_request_alone(target_kind):
    """`stack_contexts` (the vLLM proposer's one forward for all requests): requests with windows shorter than the
    longest are left-padded and masked, and their logits equal those of a forward over each context alone."""
    from transformers_longspark.context_state import boundary_states, read_context, stack_contexts
    from transformers_longspark.targets import HiddenStateCapture

    target = make_target(target_kind)
    drafter = make_drafter(target, window_size=8, summary_chunk_size=5).eval()
    drafter.bind_target(target)
    contexts, anchors = [], []
    for length in (5, 23, 12):  # a window of 5 rows, then two full ones
        prompt = torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(length))
        capture = HiddenStateCapture(target.model.layers, drafter.config.target_layer_ids, keep=1)
        cache = DynamicCache(config=target.config)
        with torch.no_grad():
            target(prompt, cache=cache)
        state = LongSparkContextState(drafter.config.num_draft_layers, drafter.config.summary_chunk_size)
        state.boundary_states = boundary_states(capture.states, torch.tensor([-1]))
        capture.remove()
        contexts.append(read_context(drafter.config, drafter.summary_queries, state, cache, length))
        anchors.append(int(prompt[0, -1]))
    mask = drafter.config.mask_token_id
    blocks = torch.tensor([[a] + [mask] * (drafter.config.block_size - 1) for a in anchors])
    stacked = stack_contexts(contexts)
    assert stacked.window_mask.tolist()[0] == [False] * 3 + [True] * 5
    with torch.no_grad():
        together = drafter(blocks, stacked).base_logits
        alone = torch.cat([drafter(blocks[i : i + 1], c).base_logits for i, c in enumerate(contexts)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
