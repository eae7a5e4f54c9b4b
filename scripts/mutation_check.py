#!/usr/bin/env python
"""Mutation check: do the tests catch plausible one-line bugs that cost exactness or tau silently?

Copies `src/`, `tests/` and `pyproject.toml` to a temporary directory, runs every mutation's tests on the unmutated
copy (they must pass), then applies each mutation below as an exact one-line textual substitution (failing loudly if
its pattern no longer occurs exactly once) and requires its concept's tests to FAIL with an assertion, not a crash.
Every pattern is checked to apply exactly once before anything runs (with `--only` too), and all broken ones are
named at once; patterns are short and anchored on what the mutation changes, so that refactors around them keep them.
The copy's `src` is put first on PYTHONPATH (and checked to be the package imported).

    python scripts/mutation_check.py [--only NAME ...] [--with-sampling] [--keep]

Last line: `N/M mutations caught`. Exit status 1 if the baseline fails or any mutation survives.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path("src/transformers_longspark")
# The tests each mutation must fail (its concept's tests); the baseline runs all of them, unmutated, once.
ALIGNMENT = ("tests/test_alignment.py", "tests/test_training.py", "tests/test_context_state.py")
GENERATION = ("tests/test_generation.py",)
EXACTNESS = ("tests/test_exactness.py",)
BATCHES = ("tests/test_batched.py", "tests/test_batched_sampling.py", "tests/test_exactness.py")
LOOKUP = ("tests/test_lookup.py", "tests/test_exactness.py")
PLANNING = ("tests/test_planning.py", "tests/test_exactness.py")
RELIABILITY = ("tests/test_reliability.py",)
VERIFICATION = ("tests/test_verification.py",)
PACKED = ("tests/test_packed_linear.py", "tests/test_packed_linear_rows.py")
LEAN = ("tests/test_lean_layers.py",)
NETWORK = ("tests/test_golden.py",)
TRAINING = ("tests/test_training.py",)
WARM_START = ("tests/test_warm_start.py",)
CALIBRATION = ("tests/test_calibration.py",)
# The wiring between units (issue 31): small end-to-end files, one concept each.
PROCESSORS_ON_LOOKUP = ("tests/test_processors_with_lookup.py",)
PLANNER_RECORDS = ("tests/test_planner_records.py",)
LOOKUP_WIRING = ("tests/test_lookup_wiring.py",)
TWO_THREADS = ("tests/test_two_speculative_threads.py",)
CACHE_RESERVE = ("tests/test_cache_reserve.py",)
EOS_CUT = ("tests/test_draft_eos_cut.py",)
VLLM_FAKE_RUNNER = ("tests/test_vllm_proposer.py",)
LONG_RANGE = ("tests/test_long_range_recall.py",)
DISTRIBUTED = ("tests/test_distributed_training.py",)
REGENERATION = ("tests/test_data.py",)
TAU_BENCH = ("tests/test_benchmark_cli.py::test_tokens_per_step_prices_each_round_by_its_source",)
# The chi-square tests of test_generation check the verifier's law (independent of what the drafter sees); ~50 s.
SLOW_TESTS = ["tests/test_generation.py::test_sampling_matches_the_exact_target_law",
              "tests/test_generation.py::test_chi_square_detects_a_broken_verifier"]  # fmt: skip


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...] = ALIGNMENT + GENERATION


MUTATIONS = [
    # What the drafter sees (each keeps generation lossless and only lowers tau).
    Mutation("boundary at the last verified position, not the last accepted one", "inference/generation.py",
             "position = -1 if self.boundary_is_last_position else n_last_matches", "position = -1"),
    Mutation("training anchor token a = ids[t - 1]", "training/distillation.py",
             "block_ids[:, 0] = ids[anchors]", "block_ids[:, 0] = ids[anchors - 1]"),
    Mutation("training Markov predecessors ids[t + 1 + i]", "training/distillation.py",
             "previous_ids = ids[label_positions - 1]", "previous_ids = ids[label_positions]"),
    Mutation("training labels ids[t + i]", "training/distillation.py",
             "labels = drafter.draft_indices(ids[label_positions])",
             "labels = drafter.draft_indices(ids[label_positions - 1])"),
    Mutation("inference RoPE position t + 1", "context_state.py",
             "positions, new_mask = torch.tensor([num_columns], device=",
             "positions, new_mask = torch.tensor([num_columns + 1], device="),
    Mutation("inference Markov predecessor of the first draft", "inference/drafting.py",
             "previous = sequences[rows, lengths - 1]", "previous = sequences[rows, lengths - 2]"),
    Mutation("training window rows [t - W + 1, t]", "training/distillation.py",
             "columns = prefix_columns(anchors, num_rows)", "columns = prefix_columns(anchors + 1, num_rows)"),
    Mutation("window one real row too old (shared by training and batches)", "context_state.py",
             "slot = rank - (rank[:, -1:] - width) - 1", "slot = rank - (rank[:, -1:] - width)"),
    Mutation("incremental summary scaled by 1/d instead of 1/sqrt(d)", "context_state.py",
             "scale = queries.shape[-1] ** -0.5", "scale = queries.shape[-1] ** -1.0"),
    Mutation("logits processors see a stale prefix while a block is drafted", "inference/drafting.py",
             "process_logits(logits_processor, sequences, rows, lengths + i,",
             "process_logits(logits_processor, sequences, rows, lengths,", GENERATION),
    # Exactness of sampling.
    Mutation("drafts sampled from another law than the one handed to the verifier", "inference/drafting.py",
             "choice = sample_from(probs)", "choice = sample_from(probs.sqrt())", EXACTNESS),
    Mutation("batched sampling accepts drafts past a row's cut", "inference/batched.py",
             "accepted = (torch.rand_like(p_drafted) <= p_drafted / q_drafted) & (steps < num_drafted[:, None])",
             "accepted = torch.rand_like(p_drafted) <= p_drafted / q_drafted", BATCHES),
    Mutation("batched greedy accepts drafts past a row's cut", "inference/batched.py",
             "matches = (drafted == target_tokens[:, :-1]) & (steps < num_drafted[:, None])",
             "matches = drafted == target_tokens[:, :-1]", BATCHES),
    Mutation("batched residual resampled from p instead of max(p - q, 0)", "inference/batched.py",
             "residual = (p_next - q[rows, num_accepted.clamp(max=k - 1)]).clamp(min=0.0)",
             "residual = p_next.clamp(min=0.0)", BATCHES),
    Mutation("batched positions skip the bonus token", "inference/batched.py",
             "self.positions = self.positions + num_accepted + 1", "self.positions = self.positions + num_accepted",
             BATCHES),
    # The lookup source.
    Mutation("lookup tokens handed to the verifier with a uniform law", "inference/drafting.py",
             "proposal.logits[r, : len(ids)] = point_mass_logits(ids, vocab_size)",
             "proposal.logits[r, : len(ids)] = torch.zeros(len(ids), vocab_size)", LOOKUP),
    Mutation("lookup index one token behind (the anchor missing)", "inference/drafting.py",
             "index.extend(requests.sequences[int(requests.rows[r]), index.offset + len(index) : length].tolist())",
             "index.extend(requests.sequences[int(requests.rows[r]), index.offset + len(index) : length - 1].tolist())",
             LOOKUP),
    Mutation("lookup continuation off by one", "inference/lookup.py",
             "index[tuple(tokens_list[end - n : end])] = end", "index[tuple(tokens_list[end - n : end])] = end - 1",
             LOOKUP),
    # The source choice.
    Mutation("every lookup match is taken, whatever its past rounds", "inference/planning.py",
             "best = max(values, key=values.get)", "best = options[0] if options else Source.NONE", PLANNING),
    Mutation("a source's running mean ignores the round it is told", "inference/planning.py",
             "self.accepted += weight * (accepted - self.accepted)", "self.accepted += 0.0", PLANNING),
    Mutation("a source's first round replaces its prior", "inference/planning.py",
             "weight = 1.0 / (1 + PRIOR_ROUNDS)", "weight = 1.0", PLANNING),
    Mutation("a passed-over source is never probed again", "inference/planning.py",
             "if probe is None and record.passed_over >= record.probe_interval:", "if False:", PLANNING),
    Mutation("the drafter's cost left out of its value", "inference/round_costs.py",
             "return self.proposal_value(rate, block, self.drafter_cost(length), length=length)",
             "return self.proposal_value(rate, block, 0.0, length=length)", PLANNING),
    Mutation("a lookup round proposes its whole continuation, whatever the planner chose", "inference/drafting.py",
             "continuations[r] = continuation[: planner.lookup_length(len(continuation), matched, length)]",
             "continuations[r] = continuation", PLANNING),
    Mutation("every matched length takes the pooled continuation rate", "inference/planning.py",
             "own = self.match_records.get(matched)", "own = None", PLANNING),
    Mutation("the continuation rate counts a round that kept all it proposed as a rejection", "inference/planning.py",
             "rejected, self.rounds = float(accepted < proposed), self.rounds + 1",
             "rejected, self.rounds = 1.0, self.rounds + 1", PLANNING),
    Mutation("the drafter's cost does not shrink as the target's step grows", "inference/round_costs.py",
             "return self.draft_round_cost / self.step_growth(length)", "return self.draft_round_cost", PLANNING),
    Mutation("a verification at a long prefix priced as at a short one", "inference/round_costs.py",
             "if not self.long_forward_costs or self.long_prefix_length <= 0:", "if True:", PLANNING),
    # The verification path and concurrency.
    Mutation("verification mask lets a block token see the next one", "inference/verification.py",
             "dtype=torch.bool, device=query.device).triu_(1)", "dtype=torch.bool, device=query.device).triu_(2)",
             VERIFICATION),
    Mutation("the block-corner mask is trusted for a left-padded prefix", "inference/verification.py",
             'query.device.type == "cpu" and prefix > 0 and bool(attention_mask[..., :prefix].all())',
             'query.device.type == "cpu" and prefix > 0', VERIFICATION),
    Mutation("the block-corner fill is skipped", "inference/verification.py",
             'by_group[..., prefix:].masked_fill_(~attention_mask[:, :, None, :, prefix:], float("-inf"))',
             "pass", VERIFICATION),
    Mutation("plain forwards of other threads take the fast path", "inference/verification.py",
             "attention = grouped_verification_attention if _thread.depth else sdpa_attention_forward",
             "attention = grouped_verification_attention", RELIABILITY),
    Mutation("packed weights kept after the weight changes (a training step)", "packed_linear.py",
             "if entry is not None and entry[1] == state:", "if entry is not None:", PACKED),
    Mutation("packed layers keep their routed forward after the block", "packed_linear.py",
             "del layer.forward  # back to `nn.Linear.forward`", "pass", PACKED),
    Mutation("the drafter's layers keep F.linear inside generate", "inference/generation.py",
             "(assistant_model) if fast and packed else nullcontext()", "(assistant_model) if False else nullcontext()",
             PACKED),
    Mutation("other threads' linear layers take the packed weights", "packed_linear.py",
             "if _thread.depth and not _one_row_in_its_dtype(input, compute, blas_max_rows):",
             "if not _one_row_in_its_dtype(input, compute, blas_max_rows):", PACKED),
    Mutation("capture hooks record other threads' forwards", "targets.py",
             "if not any_thread and threading.get_ident() != owner:", "if threading.get_ident() == -1:", RELIABILITY),
    # The wiring between units (issue 31). Logits processors that read the recent sequence, on lookup rounds.
    Mutation("lookup tokens not written where the logits processors read them", "inference/drafting.py",
             "sequences[rows[r], lengths[r] : lengths[r] + len(ids)] = ids", "pass", PROCESSORS_ON_LOOKUP),
    Mutation("batched verification processes every position with the anchor's prefix", "inference/batched.py",
             "self.row_ids, self.lengths + i, logits[:, i])", "self.row_ids, self.lengths, logits[:, i])",
             PROCESSORS_ON_LOOKUP),
    Mutation("rows of different lengths processed in one call, at the shortest length", "inference/processors.py",
             "if len(distinct) == 1 and len(rows) == len(sequences):", "if len(rows) == len(sequences):",
             PROCESSORS_ON_LOOKUP),
    # What the session tells each request's planner.
    Mutation("the planner told that every proposed token was kept", "inference/session.py",
             "planner.record(source, k, a)", "planner.record(source, k, k)", PLANNER_RECORDS),
    Mutation("batch 1 tells the planner its proposal, not the drafts transformers kept", "inference/generation.py",
             "[int(num_matches)]", "[int(self.proposal.num_drafted[0])]", PLANNER_RECORDS),
    Mutation("a probed lookup round recorded under matched length 0", "inference/planning.py",
             "matched if chosen is Source.LOOKUP else 0", "matched if best is Source.LOOKUP else 0", PLANNING),
    Mutation("the batched loop counts the bonus token as a kept draft", "inference/batched.py",
             "num_accepted.tolist(), self.planners", "(num_accepted + 1).tolist(), self.planners", PLANNER_RECORDS),
    Mutation("the source choice is not told the matched length", "inference/drafting.py",
             "length=length, matched=matched, room=room)", "length=length, room=room)", PLANNER_RECORDS),
    Mutation("rows ending early leave the remaining rows the first planners", "inference/batched.py",
             "[self.planners[row] for row in keep.tolist()]", "self.planners[: len(keep)]", PLANNER_RECORDS),
    # Lookup lengths and matches end to end.
    Mutation("lookup matches only its shortest suffix (the most recent short match wins)", "inference/drafting.py",
             "max(self.lookup_min_match, LOOKUP_MAX_NGRAM)", "self.lookup_min_match", LOOKUP_WIRING),
    Mutation("a lookup round's length chosen at the pooled rate, not its matched length's", "inference/drafting.py",
             "planner.lookup_length(len(continuation), matched, length)",
             "planner.lookup_length(len(continuation), length=length)",
             LOOKUP_WIRING),
    Mutation("batched lookup continuations cut to the drafter's block", "inference/batched.py",
             "self.block_size = self.settings.max_proposal_tokens", "self.block_size = self.settings.block_size",
             PROCESSORS_ON_LOOKUP),
    Mutation("batch-1 lookup continuations cut to the drafter's block", "inference/generation.py",
             "min(self.session.settings.max_proposal_tokens,", "min(self.session.settings.block_size,",
             PROCESSORS_ON_LOOKUP),
    # Two speculative threads at once.
    Mutation("one thread's call ending closes the other thread's hooks", "inference/generation.py",
             "class _OpenGenerators(threading.local):", "class _OpenGenerators:", TWO_THREADS),
    Mutation("one thread's call ending restores the attention under the other", "inference/verification.py",
             "_switched[key] = (previous, count + 1, lean)", "_switched[key] = (previous, 1, lean)", TWO_THREADS),
    Mutation("one thread's call ending unroutes the other's linear layers", "packed_linear.py",
             "_routed[id(layer)] = (count + 1,", "_routed[id(layer)] = (1,", TWO_THREADS),
    # The cache reserve.
    Mutation("sliding-window and other layer types replaced by reserved layers", "inference/verification.py",
             "type(layer) is DynamicLayer", "isinstance(layer, DynamicLayer)", CACHE_RESERVE),
    Mutation("no rows reserved: every verification forward concatenates the cache", "inference/generation.py",
             "fast_verification(self, cache, max_length, packed, lean_layers",
             "fast_verification(self, cache, None, packed, lean_layers",
             CACHE_RESERVE),
    Mutation("the batched reserve without its verification block", "inference/batched_checks.py",
             "+ block_size + 1", "", CACHE_RESERVE),
    Mutation("the batched reserve sized for the drafter's block, not the longest proposal", "inference/generation.py",
             "max_cache_columns(max_length, settings.max_proposal_tokens)",
             "max_cache_columns(max_length, settings.block_size)",
             CACHE_RESERVE),
    # Comparison switches and stale packed copies.
    Mutation("packed_weights = False still packs the target's layers", "inference/generation.py",
             "fast_verification(self, cache, max_length, packed, lean_layers",
             "fast_verification(self, cache, max_length, True, lean_layers", PACKED),
    Mutation("packed_weights = False still packs the drafter's layers", "inference/generation.py",
             "(assistant_model) if fast and packed else", "(assistant_model) if fast else", PACKED),
    Mutation("fast_verification ignores packed_weights=False", "inference/verification.py",
             "if packed_weights else contextlib.nullcontext()", "if True else contextlib.nullcontext()",
             PACKED),
    Mutation("a drafter block ignores the length its planner chose", "inference/drafting.py",
             "room[r] = min(int(room[r]), k)", "room[r] = int(room[r])", PLANNER_RECORDS),
    Mutation("few-row forwards past blas_max_rows keep F.linear", "packed_linear.py",
             "input.numel() <= blas_max_rows * input.shape[-1]", "input.numel() <= 64 * input.shape[-1]", PACKED),
    Mutation("the calibration's kernel choice never reaches generate's fast path", "inference/calibration.py",
             'return {"blas_max_rows": self.blas_max_rows,', 'return {"blas_max_rows": 1,', CALIBRATION),
    Mutation("the calibration's prefill kernel never reaches generate's fast path", "inference/calibration.py",
             '"max_packed_rows": self.max_packed_rows}', '"max_packed_rows": 64}', CALIBRATION),
    Mutation("a packed copy outlives its weight's storage (w.data = t)", "packed_linear.py",
             "state = tuple([(w.data_ptr(), w._version) for w in weights])",
             "state = tuple([(id(w), w._version) for w in weights])", PACKED),
    # The drafting EOS cut.
    Mutation("the drafting EOS cut reads draft-vocabulary columns, not target ids", "inference/drafting.py",
             "~torch.isin(token, eos_token_ids", "~torch.isin(choice, eos_token_ids", EOS_CUT),
    # vLLM's hidden states, through the fake runner.
    Mutation("vLLM hidden state without its residual", "vllm/proposer.py",
             "output[0] + output[1]", "output[0]", VLLM_FAKE_RUNNER),
    Mutation("vLLM layers' outputs read as transformers'", "vllm/proposer.py",
             "hidden_of=_vllm_hidden, ", "", VLLM_FAKE_RUNNER),
    Mutation("vLLM plain layer output kept as a view the next layer overwrites", "vllm/proposer.py",
             "else output.clone()", "else output", VLLM_FAKE_RUNNER),
    # The network (training and inference alike: only golden logits see it).
    Mutation("boundary fusion without its norm", "modeling_longspark.py",
             "boundary = self.boundary_norm(self.fuse_boundary(boundary))",
             "boundary = self.fuse_boundary(boundary)", NETWORK),
    Mutation("RoPE rotates the wrong way (the sign of sin on the wrong half)", "modeling_longspark.py",
             "torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)",
             "torch.cat([sin[..., :half], -sin[..., half:]], dim=-1)", NETWORK),
    Mutation("RMS norm without its weight", "modeling_longspark.py",
             "F.rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon)",
             "F.rms_norm(hidden_states, weight.shape, None, self.variance_epsilon)", NETWORK),
    Mutation("block-position embeddings dropped", "modeling_longspark.py",
             "hidden = target.embed_tokens(block_ids).to(self.dtype) + self.block_positions.weight[:b]",
             "hidden = target.embed_tokens(block_ids).to(self.dtype)", NETWORK),
    # The distillation step.
    Mutation("summary queries get no gradient", "training/distillation.py",
             "prefix_summaries(drafter.summary_queries[j], keys, values, anchors)",
             "prefix_summaries(drafter.summary_queries[j].detach(), keys, values, anchors)", TRAINING),
    Mutation("loss weights swapped on their way to draft_loss", "training/run.py",
             "ce_weight=c.ce_weight, position_decay=c.position_decay",
             "ce_weight=c.position_decay, position_decay=c.ce_weight", TRAINING),
    Mutation("feature regression on the target's features one row late", "training/distillation.py",
             "target_features = final_hidden[label_positions - 1]", "target_features = final_hidden[label_positions]",
             TRAINING),
    Mutation("feature_weight never reaches the loss", "training/run.py",
             "feature_weight=c.feature_weight,", "feature_weight=0.0,", TRAINING),
    Mutation("anchors never reach the last labelled position", "training/distillation.py",
             "low, high = sequence.anchor_start, len(sequence.ids) - 1",
             "low, high = sequence.anchor_start, len(sequence.ids) - 2", TRAINING),
    Mutation("warm start: the input projection reads the boundary, not the token", "training/warm_start.py",
             "drafter.project_inputs.weight[:, :hidden].copy_(torch.eye(hidden))",
             "drafter.project_inputs.weight[:, hidden:].copy_(torch.eye(hidden))", WARM_START),
    # Costs measured on the machine, the knobs' validation, batches planned as a whole.
    Mutation("generate ignores the calibration: the drafter's own cost fields plan", "inference/calibration.py",
             "return calibrated(target, drafter)", "return None", CALIBRATION),
    Mutation("the calibration times the rounds of a call whose drafter is off", "inference/calibration.py",
             "lookup_min_match=0, use_drafter=True, costs=RoundCosts()", "lookup_min_match=0, costs=RoundCosts()",
             CALIBRATION),
    Mutation("a nonsensical cached calibration is trusted", "inference/calibration.py",
             'costs = check_costs(RoundCosts(**data.pop("costs")), f"The calibration in {path}")',
             'costs = RoundCosts(**data.pop("costs"))', CALIBRATION),
    Mutation("out-of-range costs and thresholds pass the knobs' check", "inference/knobs.py",
             "not math.isfinite(value) or not low <= value <= high:", "not math.isfinite(value):", CALIBRATION),
    Mutation("a batched round proposes whatever its widest proposal costs", "inference/drafting.py",
             "    if len(planners) > 1:  # a batch verifies", "    if False:  # a batch verifies", PLANNING),
    # The global summary's incremental update, read by needle recall beyond the window (issue 33).
    Mutation("the summary switched off at inference", "context_state.py",
             "summary_values=list(state.summaries) if config.reads_summary else [],", "summary_values=[],",
             LONG_RANGE),
    Mutation("only the newest cache row folded into the summary", "context_state.py",
             "new_keys = [keys[:, :, -new_rows:] for keys, _ in layer_rows]",
             "new_keys = [keys[:, :, -1:] for keys, _ in layer_rows]; new_rows, new_mask = 1, None",
             LONG_RANGE),
    Mutation("summaries merged without their normalisers", "context_state.py",
             "return log_norm, weight_a * out_a + weight_b * out_b", "return log_norm, 0.5 * (out_a + out_b)",
             LONG_RANGE),
    Mutation("only the first chunk of new rows folded", "context_state.py",
             "for start in range(0, keys[0].shape[2], self.chunk_size):",
             "for start in range(0, min(keys[0].shape[2], self.chunk_size), self.chunk_size):", LONG_RANGE),
    Mutation("each chunk replaces the summary instead of merging into it", "context_state.py",
             "self.log_norm, self.summary = log_norm, out", "self.summary = out", LONG_RANGE),
    # Training on several processes (issue 30).
    Mutation("anchors drawn per process, not per place in the global batch", "training/run.py",
             "slot = self.accelerator.process_index + self.accelerator.num_processes * position", "slot = position",
             DISTRIBUTED),
    Mutation("the schedule counts each process's advance as a step", "training/run.py",
             "step = advances // num_processes", "step = advances", DISTRIBUTED),
    # This session: int8 weights, greedy rounds without logits, the regeneration engines, tokens per step.
    Mutation("int8 weights used without their row scales", "int8_weights.py",
             "return quantized, scale.to(torch.bfloat16)", "return quantized, torch.ones_like(scale).bfloat16()",
             PACKED),
    Mutation("sampled rounds drop the logits their verifier divides by", "inference/drafting.py",
             "return_logits=do_sample or ensemble,", "return_logits=ensemble,", GENERATION),
    Mutation("every record of a batch sampled with the batch's first seed", "training/regenerate.py",
             "engine.generate(prompt_ids, [seed + i for i in ids], sampling)",
             "engine.generate(prompt_ids, [seed + ids[0]] * len(ids), sampling)", REGENERATION),
    Mutation("tokens per step leaves the drafter's forward unpriced", "benchmarks/tau.py",
             "return verification + stats.drafter_rounds * costs.drafter_cost(prompt_length)", "return verification",
             TAU_BENCH),
    # Dynamic int8 drafter layers, fused projections, response archives, benchmark variants.
    Mutation("dynamic int8 rows scaled 10x too fine (they saturate)", "int8_weights.py",
             "scale = row_scales(weight).double()", "scale = row_scales(weight).double() / 10",
             PACKED),
    Mutation("one row runs the packed kernel (oneDNN's setup on every one-token step)", "packed_linear.py",
             "return compute in (None, input.dtype) and input.numel() <= blas_max_rows * input.shape[-1]",
             "return False", PACKED),
    Mutation("a batched round priced as one row's verification", "inference/planning.py",
             "row_cost = 1.0 + costs.batch_verify_cost(len(planners), width, length) + drafter",
             "row_cost = 1.0 + costs.verify_cost(width, length) + drafter", PLANNING),
    Mutation("the target's query/key/value projections run as three products", "inference/lean_layers.py",
             "query, key, value = fused_linears(hidden, (q_proj, k_proj, v_proj))",
             "query, key, value = (m.forward(hidden) for m in (q_proj, k_proj, v_proj))", LEAN),
    Mutation("fused projections split at the wrong widths", "packed_linear.py",
             "return out.split([layer.out_features for layer in layers], dim=-1)",
             "return out.split([layer.out_features for layer in reversed(layers)], dim=-1)",
             PACKED),
    Mutation("archived responses of other settings reused", "training/response_archive.py",
             'if record["run"] == key:', "if True:", REGENERATION),
    Mutation("archived records ignored", "training/regenerate.py",
             "    restored = [i for i in pending if i in archived]", "    restored, archived = [], {}", REGENERATION),
    Mutation("unknown variant settings accepted", "benchmarks/settings.py",
             "unknown = sorted(set(settings) - knobs - set(DRAFTER_SWITCHES))", "unknown = []",
             ("tests/test_benchmark.py",)),
]  # fmt: skip


def pattern_problem(mutation: Mutation, text: str) -> str | None:
    """Why `mutation` cannot be applied to `text` (its pattern must occur exactly once, within one line), or None."""
    if "\n" in mutation.old or "\n" in mutation.new:
        return f"{mutation.name!r}: a mutation must change one line"
    count = text.count(mutation.old)
    if count != 1:
        return (f"{mutation.name!r}: {mutation.old!r} occurs {count} times in {PACKAGE / mutation.file} "
                "(expected exactly once)")  # fmt: skip
    return None


def check_patterns(mutations: Sequence[Mutation], root: Path) -> None:
    """Exits, naming every broken pattern at once, unless each mutation applies exactly once to the copy."""
    problems = [p for m in mutations if (p := pattern_problem(m, (root / PACKAGE / m.file).read_text()))]
    names = [m.name for m in mutations]
    problems += [f"{name!r}: two mutations share this name" for name in sorted(set(names)) if names.count(name) > 1]
    if problems:
        raise SystemExit("MUTATION PATTERNS BROKEN (update scripts/mutation_check.py):\n  " + "\n  ".join(problems))


def apply(mutation: Mutation, text: str) -> str:
    """`text` with the one line containing `mutation.old` changed; raises if the pattern is not there exactly once."""
    problem = pattern_problem(mutation, text)
    if problem is not None:
        raise SystemExit(f"MUTATION PATTERN BROKEN: {problem}; update scripts/mutation_check.py.")
    return text.replace(mutation.old, mutation.new)


def copy_repo(destination: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    shutil.copytree(REPO / PACKAGE, destination / PACKAGE, ignore=ignore)
    shutil.copytree(REPO / "tests", destination / "tests", ignore=ignore)
    shutil.copy2(REPO / "pyproject.toml", destination / "pyproject.toml")


def environment(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_import_location(root: Path) -> None:
    out = subprocess.run([sys.executable, "-c", "import transformers_longspark as m; print(m.__file__)"], cwd=root,
                         env=environment(root), capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    if not Path(out).resolve().is_relative_to(root.resolve()):
        raise SystemExit(f"The copy's package is not the one imported ({out}); PYTHONPATH does not take precedence.")


def run_tests(root: Path, files: Sequence[str], with_sampling: bool, timeout: int) -> tuple[int, str, float]:
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *files]
    if not with_sampling and "tests/test_generation.py" in files:
        command += [f"--deselect={test}" for test in SLOW_TESTS]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, check=False, cwd=root, env=environment(root), capture_output=True, text=True, timeout=timeout
        )
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as error:
        code, output = -1, f"timed out after {timeout} s\n{error.stdout or ''}"
    return code, output, time.perf_counter() - start


def first_failure(output: str) -> tuple[str, bool]:
    """(`test at file:line: message` of the first failure, whether it is an assertion failure, not a crash)."""
    test = next((line for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))), None)
    # With pytest's default long tracebacks, each failure ends with `path:line: ExceptionType`.
    site = re.search(r"^(\S+\.py:\d+): (\w+)$", output, flags=re.MULTILINE)
    message = re.search(r"^E +(\w*Error\b.*)$", output, flags=re.MULTILINE)
    if test is None or site is None:
        return "no failing test found in the output", False
    detail = f"{test}\n          at {site[1]}: {message[1][:120] if message else site[2]}"
    return detail, site[2] == "AssertionError" and test.startswith("FAILED ")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="run only the mutations whose name contains one of these words")
    parser.add_argument("--with-sampling", action="store_true", help="also run the slow chi-square sampling tests")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per test run")
    args = parser.parse_args()
    mutations = [m for m in MUTATIONS if not args.only or any(word in m.name for word in args.only)]

    root = Path(tempfile.mkdtemp(prefix="longspark-mutants-"))
    try:
        copy_repo(root)
        check_patterns(MUTATIONS, root)  # every pattern (not only the selected ones) must match before anything runs
        originals = {m.file: (root / PACKAGE / m.file).read_text() for m in mutations}
        check_import_location(root)

        every_file = sorted({file for m in mutations for file in m.tests})
        code, output, seconds = run_tests(root, every_file, args.with_sampling, args.timeout)
        summary = output.strip().splitlines()[-1] if output.strip() else ""
        print(f"baseline (unmutated): {'PASS' if code == 0 else 'FAIL'} in {seconds:.0f} s  [{summary}]", flush=True)
        if code != 0:
            print(output[-4000:])
            print(f"0/{len(mutations)} mutations caught")
            return 1

        caught = 0
        for m in mutations:
            path = root / PACKAGE / m.file
            path.write_text(apply(m, originals[m.file]))
            try:
                code, output, seconds = run_tests(root, m.tests, args.with_sampling, args.timeout)
            finally:
                path.write_text(originals[m.file])
            failure, is_assertion = first_failure(output)
            if code == 1 and is_assertion:
                caught += 1
                print(f"caught    {m.name} ({m.file}) in {seconds:.0f} s\n          {failure}", flush=True)
            elif code == 0:
                print(f"SURVIVED  {m.name} ({m.file}): the tests pass", flush=True)
            else:
                print(f"NOT CAUGHT BY AN ASSERTION  {m.name} ({m.file}), exit {code}: {failure}", flush=True)
                print(output[-2000:])
    finally:
        if args.keep:
            print(f"copy kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{caught}/{len(mutations)} mutations caught")
    return 0 if caught == len(mutations) else 1


if __name__ == "__main__":
    sys.exit(main())
