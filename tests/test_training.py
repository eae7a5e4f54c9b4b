"""Training: the loss, training-time views equal inference-time views, learning, exact resumption."""

import json

import pytest
import torch
from transformers import GenerationConfig

from helpers import make_bigram_target, make_drafter, make_target, tiny_config
from transformers_longspark.inference.generation import LongSparkCandidateGenerator
from transformers_longspark.training.data import Sequence, load_sequences
from transformers_longspark.training.distillation import (
    draft_loss,
    feature_loss,
    sample_anchors,
    sequence_loss,
    teacher_forced_batch,
)
from transformers_longspark.training.run import Trainer, TrainingConfig


def direct_loss(logits, target_logits, labels, valid, lam=0.1, decay=4.0, divergence="l1"):
    """Equation (9) written out anchor by anchor, position by position, over the full vocabulary (with forward KL
    in place of the L1 distance when `divergence` is "kl")."""
    total = weight_sum = 0.0
    for a in range(labels.shape[0]):
        for i in range(labels.shape[1]):
            if not valid[a, i]:
                continue
            q, p = logits[a, i].softmax(-1), target_logits[a, i].softmax(-1)
            w = torch.exp(torch.tensor(-i / decay))
            nll = -torch.log(q[labels[a, i]]) if q[labels[a, i]] > 0 else 0.0  # no CE for undraftable labels
            if divergence == "l1":
                distance = (p - q).abs().sum()
            else:
                distance = sum(p[v] * (torch.log(p[v]) - torch.log(q[v])) for v in range(len(p)) if p[v] > 0)
            total += w * (lam * nll + (1 - lam) * distance)
            weight_sum += w
    return total / weight_sum


def loss_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits, target_logits = torch.randn(5, 7, 11, generator=g), 3 * torch.randn(5, 7, 11, generator=g)
    labels = torch.randint(0, 11, (5, 7), generator=g)
    valid = torch.ones(5, 7, dtype=torch.bool)
    valid[3, 4:] = valid[4, 1:] = False
    return logits, target_logits, labels, valid


def test_loss_matches_direct_computation():
    logits, target_logits, labels, valid = loss_case()
    expected = direct_loss(logits, target_logits, labels, valid)
    torch.testing.assert_close(draft_loss(logits, target_logits.softmax(-1), labels, valid), expected)


def test_kl_loss_matches_direct_computation_and_an_unknown_divergence_is_refused():
    logits, target_logits, labels, valid = loss_case(2)
    expected = direct_loss(logits, target_logits, labels, valid, divergence="kl")
    torch.testing.assert_close(draft_loss(logits, target_logits.softmax(-1), labels, valid, divergence="kl"), expected)
    with pytest.raises(ValueError, match="divergence must be one of"):
        draft_loss(logits, target_logits.softmax(-1), labels, valid, divergence="js")


def test_kl_loss_with_a_draft_vocabulary_compares_q_with_p_renormalised_over_it():
    """Outside the draft vocabulary KL would be infinite; inside, it is KL(p restricted and renormalised || q)."""
    logits, target_logits, labels, valid = loss_case(3)
    draft_vocab = torch.tensor([0, 2, 3, 7, 10])
    restricted = target_logits[..., draft_vocab]  # its softmax is p renormalised over the draft vocabulary
    index = torch.full((11,), -1)
    index[draft_vocab] = torch.arange(5)
    probs = target_logits.softmax(-1)[..., draft_vocab]
    loss = draft_loss(logits[..., draft_vocab], probs, index[labels], valid, ce_weight=0.0, divergence="kl")
    expected = direct_loss(logits[..., draft_vocab], restricted, index[labels], valid, lam=0.0, divergence="kl")
    torch.testing.assert_close(loss, expected)


def test_loss_with_a_draft_vocabulary_is_the_full_vocabulary_loss_with_q_zero_outside_it():
    logits, target_logits, labels, valid = loss_case(1)
    draft_vocab = torch.tensor([0, 2, 3, 7, 10])
    full_logits = torch.full_like(logits, float("-inf"))
    full_logits[..., draft_vocab] = logits[..., draft_vocab]
    index = torch.full((11,), -1)
    index[draft_vocab] = torch.arange(5)
    assert (index[labels] == -1).any() and (index[labels] >= 0).any()
    loss = draft_loss(logits[..., draft_vocab], target_logits.softmax(-1)[..., draft_vocab], index[labels], valid)
    torch.testing.assert_close(loss, direct_loss(full_logits, target_logits, labels, valid))


@pytest.mark.parametrize("overrides", [
    {}, {"use_global_summary": False}, {"use_recent_window": False}, {"use_boundary_state": False},
    {"full_prefix_context": True}, {"summary_key_positions": "block_start"},
    {"summary_key_positions": "block_start", "use_recent_window": False},
])  # fmt: skip
def test_training_views_and_logits_equal_inference(target_kind, overrides):
    """For each anchor t, the generator's inference context after the target cached x[:t] gives the same drafter
    logits as the batched teacher-forced context, for the full model and every ablation."""
    target = make_target(target_kind)
    drafter = make_drafter(target, window_size=8, **overrides)
    drafter.bind_target(target)
    ids = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(0))
    sequence = Sequence(ids, prompt_length=3)
    anchors = torch.tensor([3, 5, 8, 9, 20, 28])
    batch = teacher_forced_batch(target, drafter, sequence, anchors)
    with torch.no_grad():
        batched = drafter(batch.block_ids, batch.context, batch.previous_ids).logits
    for a, t in enumerate(anchors.tolist()):
        generator = LongSparkCandidateGenerator(target, drafter, ids[None, : t + 1], GenerationConfig(max_length=99))
        from transformers import DynamicCache

        cache = DynamicCache(config=target.config)
        with torch.no_grad():
            target(ids[None, :t], cache=cache)
        context = generator.update_context(cache, t, n_last_matches=0)
        torch.testing.assert_close(context.boundary_states, batch.context.boundary_states[a : a + 1],
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        for j in range(len(context.summary_values)):
            torch.testing.assert_close(context.summary_values[j], batch.context.summary_values[j][a : a + 1],
                                       rtol=1e-5, atol=1e-5)  # fmt: skip
        with torch.no_grad():
            single = drafter(batch.block_ids[a : a + 1], context, batch.previous_ids[a : a + 1]).logits
        torch.testing.assert_close(single, batched[a : a + 1], rtol=1e-4, atol=1e-4)
        p = target(ids[None, : t + 7]).logits[0, t : t + 7]
        n = int(batch.valid[a].sum())
        torch.testing.assert_close(batch.target_probs[a, :n], p[:n].softmax(-1), rtol=1e-4, atol=1e-5)


def test_a_few_steps_lower_the_loss_on_a_fixed_batch(tmp_path):
    target = make_bigram_target("llama", vocab_size=64, temperature=0.05)
    trainer = Trainer(tiny_config(tmp_path), target=target)
    torch.manual_seed(0)
    sequence = Sequence(target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=30, do_sample=True)[0], 3)
    anchors = torch.arange(sequence.prompt_length, len(sequence.ids) - 1)
    losses = []
    for _ in range(15):
        loss = sequence_loss(target, trainer.drafter, sequence, anchors)
        losses.append(loss.item())
        loss.backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()
    assert losses[-1] < 0.8 * losses[0]


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(tmp_path, monkeypatch):
    target = make_target("llama")
    straight = Trainer(tiny_config(tmp_path / "a"), target=target)
    straight.train()

    interrupted = Trainer(tiny_config(tmp_path / "b"), target=target)
    log = Trainer._log

    def log_then_stop(self, record):  # stopped after step 3, one step past the checkpoint of step 2
        log(self, record)
        if record["step"] == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "_log", log_then_stop)
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    monkeypatch.undo()
    resumed = Trainer(tiny_config(tmp_path / "b"), target=target)
    resumed.train(resume=True)
    assert resumed.step == straight.step == 6
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    logged = [json.loads(line) for line in (tmp_path / "b" / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]  # step 3 ran twice, and is logged once
    straight_log = [json.loads(line) for line in (tmp_path / "a" / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in logged] == [r["tokens"] for r in straight_log] == [48 * s for s in range(1, 7)]


def test_config_file_and_unknown_fields(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("output_dir: out\ntrain_data: data\nlearning_rate: 0.001\n")
    assert TrainingConfig.from_file(path).learning_rate == 0.001
    path.write_text("output_dir: out\ntrain_data: data\nlearning_rat: 0.001\n")
    with pytest.raises(ValueError, match="learning_rat"):
        TrainingConfig.from_file(path)
    path.write_text("output_dir: out\ntrain_data: data\ndivergence: js\n")
    with pytest.raises(ValueError, match="divergence must be one of"):
        TrainingConfig.from_file(path)
    path.write_text("output_dir: out\ntrain_data: data\nmixed_precision: bfloat16\n")
    with pytest.raises(ValueError, match="mixed_precision must be one of"):
        TrainingConfig.from_file(path)
    with pytest.raises(ValueError, match="longspark regenerate"):
        load_sequences(tmp_path, 64)


def test_an_init_drafter_with_fewer_target_layers_keeps_those_layers(tmp_path):
    """`drafter: {target_layer_ids: [...]}` with `init_drafter` selects those of its layers (a shallower drafter from
    a trained one) instead of failing on the weights' shapes."""
    from transformers_longspark.training.run import build_drafter

    target = make_target("llama")
    deep = make_drafter(target, num_selected_layers=3)
    deep.save_pretrained(tmp_path / "deep")
    layer_ids = [deep.config.target_layer_ids[0], deep.config.target_layer_ids[2]]
    config = tiny_config(tmp_path, init_drafter=str(tmp_path / "deep"), drafter={"target_layer_ids": layer_ids})
    shallow = build_drafter(config, target, [])
    assert shallow.config.target_layer_ids == layer_ids and len(shallow.layers) == 2
    torch.testing.assert_close(shallow.layers[1].mlp.up_proj.weight, deep.layers[2].mlp.up_proj.weight)


def test_model_card_from_a_benchmark_report(tmp_path):
    from transformers_longspark.model_card import push_drafter, write_model_card

    drafter = make_drafter(make_target("llama"))
    drafter.save_pretrained(tmp_path / "drafter")
    report = {"benchmark": "speed", "command": "longspark bench --json bench.json", "machine": {"cpu": "test cpu"},
              "rows": [{"workload": "short", "mode": "greedy", "method": "longspark", "label": "LongSpark", "tau": 3.25,
                        "tokens_per_s": 20.0, "speedup": 1.6, "greedy_identical": True}]}  # fmt: skip
    (tmp_path / "bench.json").write_text(json.dumps(report))
    config_path = tmp_path / "train.yaml"
    config_path.write_text("output_dir: out\ntrain_data: data\nlearning_rate: 0.001\n")
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "sequences": 4, "loss": 3.0}\n'
                   '{"step": 2, "sequences": 8, "loss": 2.0, "eval_loss": 2.5, "eval_tau": 1.25}\n')  # fmt: skip
    card = write_model_card(tmp_path / "drafter", tmp_path / "bench.json", config_path, training_log=log,
                            tokens_per_sequence=100).read_text()  # fmt: skip
    assert "| 2 | 8 | 800 | 2.500 | 1.25 |" in card
    metadata = card.split("---")[1]
    for field in ("base_model:", "library_name: transformers", "pipeline_tag: text-generation", "license:",
                  "speculative-decoding"):  # fmt: skip
        assert field in metadata
    assert "| 3.25 | 20.0 | 1.60x | - | - | yes |" in card and "longspark bench --json bench.json" in card
    assert f"{sum(p.numel() for p in drafter.parameters()):,} parameters" in card and "slower" not in card

    # Several reports (short and long prompts) go into one table; a slower case is named.
    long_report = {**report, "command": "longspark bench --workloads long", "rows": [
        {"workload": "long", "mode": "greedy", "method": "prompt_lookup_fast", "label": "prompt lookup (fast)",
         "tau": 2.0, "tokens_per_s": 9.0, "speedup": 1.1, "decode_speedup": 1.5, "greedy_identical": True},
        {"workload": "long", "mode": "greedy", "method": "longspark", "label": "LongSpark", "tau": 1.5,
         "tokens_per_s": 8.0, "speedup": 1.05, "decode_speedup": 0.9, "decode_speedup_vs_best_plain": 0.8,
         "greedy_identical": True}]}  # fmt: skip
    (tmp_path / "long.json").write_text(json.dumps(long_report))
    card = write_model_card(tmp_path / "drafter", [tmp_path / "bench.json", tmp_path / "long.json"]).read_text()
    longspark_row = card.index("| 1.50 | 8.0 | 1.05x | 0.90x | 0.80x |")  # with its speed-up over the best plain path
    assert card.index("prompt lookup (fast) | 2.00 | 9.0 | 1.10x | 1.50x") < longspark_row
    assert "slower than plain generation in: long greedy 0.90x" in card and "--workloads long" in card
    (tmp_path / "limits.md").write_text("Short prompts need tau 1.9.\n")
    card = write_model_card(tmp_path / "drafter", tmp_path / "bench.json", notes=tmp_path / "limits.md").read_text()
    assert "## Limits\n\nShort prompts need tau 1.9.\n" in card and "## Limits" not in card.split("## Measured")[0]

    # The acceptance-vs-length section, between the markers the docs check re-renders from the same report.
    curve = {"benchmark": "tau", "settings": {"max_new_tokens": 32, "drafter_alone": True}, "rows": [
        {"workload": f"long@{n}", "drafter": "shipped", "prompts": 4, "tau": t, "acceptance_rates": [a]}
        for n, t, a in ((256, 2.5, 0.75), (8192, 2.25, 0.5))]}  # fmt: skip
    (tmp_path / "curve.json").write_text(json.dumps(curve))
    card = write_model_card(tmp_path / "drafter", tmp_path / "bench.json", acceptance_curve=tmp_path / "curve.json")
    section = card.read_text().split("## Acceptance vs prefix length")[1]
    assert f"<!-- table:begin {(tmp_path / 'curve.json').as_posix()} -->" in section
    assert "| shipped | 2.50 (0.75) | 2.25 (0.50) |" in section and "the drafter alone" in section

    # Two stages: the second continues the first, so its sequences and tokens are counted after the first's.
    log2 = tmp_path / "log2.jsonl"
    log2.write_text('{"step": 3, "sequences": 12, "tokens": 1234, "loss": 1.0, "eval_loss": 1.5, "eval_tau": 2.5}\n')
    card = write_model_card(tmp_path / "drafter", tmp_path / "bench.json", [config_path, config_path],
                            training_log=[log, log2], tokens_per_sequence=100).read_text()  # fmt: skip
    assert "| 1 | 2 | 8 | 800 | 2.500 | 1.25 |" in card and "| 2 | 3 | 20 | 2,034 | 1.500 | 2.50 |" in card
    assert "in 2 stages" in card and "Stage 2, `longspark train --config train.yaml`" in card
    (tmp_path / "drafter" / "README.md").unlink()
    with pytest.raises(ValueError, match=r"README\.md"):
        push_drafter(tmp_path / "drafter", "org/name")


def test_summary_queries_start_from_n_0_1_over_d_and_the_markov_correction_starts_neutral():
    drafter = make_drafter(make_target("qwen3"), num_summary_queries=64)
    queries = drafter.summary_queries.detach()
    assert abs(queries.std().item() - drafter.config.head_dim**-0.5) < 0.05 and abs(queries.mean().item()) < 0.05
    assert drafter.markov_proj.weight.abs().sum() == 0


def test_every_trainable_parameter_gets_a_gradient_in_one_distillation_step(tmp_path):
    """A parameter cut off from the loss (a stray `detach`, an unused module) trains nothing and no loss curve shows
    it; one step's gradients must be nonzero for every trainable tensor (the Markov projection starts at zero, so
    its input embedding's gradient is checked after one update)."""
    target = make_bigram_target("llama", vocab_size=64, temperature=0.05)
    trainer = Trainer(tiny_config(tmp_path), target=target)
    torch.manual_seed(0)
    sequence = Sequence(target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=30, do_sample=True)[0], 3)
    anchors = sample_anchors(sequence, 64, torch.Generator().manual_seed(0))
    for _ in range(2):
        trainer.optimizer.zero_grad()
        sequence_loss(target, trainer.drafter, sequence, anchors).backward()
        trainer.optimizer.step()
    no_gradient = [name for name, p in trainer.drafter.named_parameters()
                   if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)]  # fmt: skip
    assert not no_gradient


def test_sequence_loss_uses_the_configs_loss_weights(tmp_path):
    """`ce_weight`, `position_decay`, `divergence` and `feature_weight` reach the loss as configured (distinct
    values: a swap shows)."""
    target = make_bigram_target("llama", vocab_size=64, temperature=0.05)
    config = tiny_config(tmp_path)
    config.ce_weight, config.position_decay, config.divergence, config.feature_weight = 0.3, 2.0, "kl", 0.7
    trainer = Trainer(config, target=target)
    sequence = Sequence(torch.tensor([1, 2, 3, 9, 4, 7, 7, 1, 30, 2, 5, 6]), 3)
    anchors = sample_anchors(sequence, config.anchors_per_sequence, torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = trainer.loss(trainer.drafter, sequence, torch.Generator().manual_seed(0))
        batch = teacher_forced_batch(target, trainer.drafter, sequence, anchors)
        output = trainer.drafter(batch.block_ids, batch.context, batch.previous_ids)
        expected = draft_loss(output.logits, batch.target_probs, batch.labels, batch.valid, ce_weight=0.3,
                              position_decay=2.0, divergence="kl")  # fmt: skip
        features = feature_loss(output.hidden_states, batch.target_features, batch.valid, position_decay=2.0)
    assert features > 0
    torch.testing.assert_close(loss, expected + 0.7 * features)


def test_feature_loss_matches_direct_computation_and_its_targets_are_the_features_that_give_p(tmp_path):
    """The feature loss written out position by position; the batch's target features are the target's final
    normed states one row before each label, i.e. its LM head turns them into the batch's `p_i` (an off-by-one in
    the positions fails here); a negative weight is refused."""
    g = torch.Generator().manual_seed(0)
    features, target_features = torch.randn(4, 7, 6, generator=g), 2 * torch.randn(4, 7, 6, generator=g)
    valid = torch.ones(4, 7, dtype=torch.bool)
    valid[2, 3:] = False
    total = weight_sum = 0.0
    for a in range(4):
        for i in range(7):
            if valid[a, i]:
                w = torch.exp(torch.tensor(-i / 4.0))
                d = features[a, i] - target_features[a, i]
                total += w * torch.where(d.abs() < 1, 0.5 * d**2, d.abs() - 0.5).mean()
                weight_sum += w
    torch.testing.assert_close(feature_loss(features, target_features, valid), total / weight_sum)
    assert feature_loss(target_features, target_features, valid) == 0

    target = make_target("llama")
    drafter = make_drafter(target)
    sequence = Sequence(torch.randint(3, target.config.vocab_size, (40,), generator=g), 5)
    batch = teacher_forced_batch(target, drafter, sequence, sample_anchors(sequence, 8, g))
    with torch.no_grad():
        probs = target.lm_head(batch.target_features).float().softmax(-1)
    torch.testing.assert_close(probs[batch.valid], batch.target_probs[batch.valid])
    (tmp_path / "run.yaml").write_text("output_dir: out\ntrain_data: data\nfeature_weight: -1\n")
    with pytest.raises(ValueError, match="feature_weight must be >= 0"):
        TrainingConfig.from_file(tmp_path / "run.yaml")


def test_sample_anchors_draws_distinct_sorted_anchors_over_the_whole_range():
    sequence = Sequence(torch.arange(40), prompt_length=10)
    everything = sample_anchors(sequence, 100, torch.Generator().manual_seed(0))
    assert everything.tolist() == list(range(10, 39))  # t <= T - 2: every anchor has a label
    drawn = [sample_anchors(sequence, 8, torch.Generator().manual_seed(seed)) for seed in range(50)]
    for anchors in drawn:
        assert len(anchors) == 8 and anchors.unique().tolist() == anchors.tolist()  # distinct and sorted
        assert int(anchors.min()) >= 10 and int(anchors.max()) <= 38
    assert {int(t) for anchors in drawn for t in anchors} == set(range(10, 39))  # every anchor can be drawn


def test_summary_values_of_the_training_batch_carry_the_summary_queries_gradient(tmp_path):
    """The summary queries `U` reach the loss twice: as attention keys and through the summary values
    `softmax(U K^T) V`. A `detach` on the second path still leaves `U` a gradient (from the first), so the check
    that every tensor gets one cannot see it; each summary view must be differentiable in `U` itself."""
    target = make_bigram_target("llama", vocab_size=64, temperature=0.05)
    drafter = Trainer(tiny_config(tmp_path), target=target).drafter
    sequence = Sequence(torch.tensor([1, 2, 3, 9, 4, 7, 7, 1, 30, 2, 5, 6, 8, 8, 3]), 3)
    batch = teacher_forced_batch(target, drafter, sequence, torch.arange(3, 14))
    assert batch.context.summary_values
    for values in batch.context.summary_values:
        assert values.requires_grad
        (gradient,) = torch.autograd.grad(values.square().sum(), drafter.summary_queries, retain_graph=True)
        assert gradient.abs().sum() > 0


def test_window_dropout_masks_whole_windows_of_some_anchors_only(tmp_path):
    """`window_dropout`: the dropped anchors see no window row (summary and boundary only); the others see exactly
    their windows; a fraction outside [0, 1) is refused."""
    target = make_target("llama")
    drafter = make_drafter(target, window_size=8)
    drafter.bind_target(target)
    sequence = Sequence(torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(0)), 4)
    anchors = torch.arange(10, 38)
    plain = teacher_forced_batch(target, drafter, sequence, anchors).context.window_mask
    generator = torch.Generator().manual_seed(1)
    dropped = teacher_forced_batch(target, drafter, sequence, anchors, 0.5, generator).context.window_mask
    empty = ~dropped.any(dim=1)
    assert 0 < int(empty.sum()) < len(anchors)
    assert torch.equal(dropped[~empty], plain[~empty]) and plain.all()
    with pytest.raises(ValueError, match="window_dropout"):
        tiny_config(tmp_path, window_dropout=1.0)
