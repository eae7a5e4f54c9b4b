"""Costs measured on the machine at hand (`inference/calibration.py`), the validated drafting knobs
(`inference/knobs.py`), and exactness with the drafter's linear layers in bfloat16 and with calibrated costs."""

import copy
import functools
import json
import math

import pytest
import torch
from transformers.generation import utils as generation_utils

from helpers import (
    LAW_VOCAB,
    chi_square_pvalue,
    exact_law,
    greedy_pair,
    make_bigram_target,
    make_drafter,
    make_oracle_drafter,
    make_target,
    sampled_counts,
)
from transformers_longspark import LongSparkDrafterModel
from transformers_longspark.inference import calibration, verification
from transformers_longspark.inference.calibration import calibrate, calibrated, calibration_key, calibration_path
from transformers_longspark.inference.knobs import check_costs
from transformers_longspark.inference.round_costs import RoundCosts
from transformers_longspark.inference.session import DraftSession

COSTS = {"draft_round_cost": 0.3, "verify_round_cost": 0.05, "verify_token_cost": 0.2, "step_doubling_length": 500}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty LONGSPARK_CACHE, and no calibration remembered by this process."""
    monkeypatch.setenv("LONGSPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "_calibrated", {})
    return tmp_path


def write_calibration(target, drafter, costs: dict, blas_max_rows=1, max_packed_rows=64) -> None:
    key = calibration_key(target, drafter)
    path = calibration_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    times = {"step_ms": 30.0, "long_step_ms": 31.0, "draft_round_ms": 9.0, "forward_ms": {}, "long_forward_ms": {},
             "batch_draft_round_ms": {}}  # fmt: skip
    kernels = {"blas_max_rows": blas_max_rows, "max_packed_rows": max_packed_rows}
    record = {"version": key["version"], "costs": costs, **kernels, **times, "key": key}
    path.write_text(json.dumps(record))


def error_of(call, kind: type[Exception] = ValueError) -> str | None:
    """The message of the `kind` error `call()` raises, or `None` (so that a test fails by its own assertion)."""
    try:
        call()
    except kind as error:
        return str(error)
    return None


def spy_on_costs(monkeypatch) -> list[RoundCosts]:
    seen, original = [], DraftSession.__init__

    def spy(self, drafter, target, settings, capture=True):
        seen.append(settings.costs)
        original(self, drafter, target, settings, capture)

    monkeypatch.setattr(DraftSession, "__init__", spy)
    return seen


def test_calibration_measures_finite_costs_without_touching_the_global_rng():
    target = make_target("llama")
    drafter = make_drafter(target)
    state = torch.get_rng_state()
    result = calibrate(target, drafter, repeats=2)
    assert torch.equal(torch.get_rng_state(), state)
    for name in COSTS:
        value = getattr(result.costs, name)
        assert math.isfinite(value) and value >= 0, (name, value)
    assert result.step_ms > 0 and result.draft_round_ms > 0
    assert sorted(result.forward_ms) == [2, 3, 4, 5, 6, 8, 11, 16, 32, 64]
    assert [n for n, _ in result.costs.forward_costs] == sorted(result.forward_ms)
    assert [n for n, _ in result.costs.long_forward_costs] == sorted(result.long_forward_ms) == [2, 4, 8, 16]
    for curve in (result.costs.forward_costs, result.costs.long_forward_costs):  # more rows never cost less
        costs = [cost for _, cost in curve]
        assert costs == sorted(costs) and costs[0] >= 1.0, curve
    assert result.costs.long_prefix_length > 0
    assert [n for n, _ in result.costs.draft_batch_costs] == sorted(result.batch_draft_round_ms) == [8]
    assert check_costs(result.costs, "the test") is result.costs
    assert result.key == calibration_key(target, drafter)


def test_the_calibration_drafts_every_round_whatever_the_calls_own_sources():
    """A calibration started inside a call with the drafter priced out or lookup on still times drafter rounds."""
    target = make_target("llama")
    drafter = make_drafter(target)
    drafter.generation_config.use_drafter = False
    drafter.generation_config.lookup_min_match = 2
    forwards = []
    drafter.register_forward_hook(lambda *args: forwards.append(1))
    failure = error_of(lambda: calibrate(target, drafter, repeats=2), RuntimeError)
    assert failure is None, failure
    assert len(forwards) == 6  # a warm-up and two timed rounds, at batch 1 and at batch 8


def test_a_calibration_is_measured_once_then_read_from_the_cache(cache_dir, monkeypatch):
    target = make_target("llama")
    drafter = make_drafter(target)
    measured = calibrated(target, drafter)
    files = list((cache_dir / "calibration").glob("*.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text())["costs"]["draft_round_cost"] == measured.costs.draft_round_cost

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again although a calibration is cached")

    monkeypatch.setattr(calibration, "calibrate", no_measuring)
    monkeypatch.setattr(calibration, "_calibrated", {})  # a new process
    assert calibrated(target, drafter) == measured


def test_the_calibration_key_follows_threads_dtype_and_target():
    target = make_target("llama")
    drafter = make_drafter(target)
    key = calibration_key(target, drafter)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert calibration_key(target, drafter) != key
    finally:
        torch.set_num_threads(threads)
    assert calibration_key(make_target("llama", vocab_size=80), make_drafter(target)) != key
    assert calibration_key(target.to(torch.bfloat16), drafter) != key
    assert calibration_key(target, copy.deepcopy(drafter).to(torch.bfloat16)) != key


def test_checkpoints_of_one_architecture_share_a_calibration(tmp_path):
    """Other weights, another folder, another saved dtype: the same key (a round costs what the architecture and the
    dtypes it runs in cost), so that checkpoints compared side by side are priced alike."""
    target = make_target("llama")
    drafter = make_drafter(target)
    key = calibration_key(target, drafter)
    drafter.to(torch.bfloat16).save_pretrained(tmp_path / "checkpoint")
    other = LongSparkDrafterModel.from_pretrained(tmp_path / "checkpoint", dtype=torch.float32)
    torch.nn.init.normal_(other.fuse_boundary.weight)
    assert other.config._name_or_path == str(tmp_path / "checkpoint")
    assert calibration_key(target, other) == key
    other.config.block_size += 1
    assert calibration_key(target, other) != key


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), "cheap"])
def test_a_nonsense_cached_calibration_is_measured_again(cache_dir, bad, caplog):
    target = make_target("llama")
    drafter = make_drafter(target)
    write_calibration(target, drafter, {**COSTS, "verify_token_cost": bad})
    costs = calibrated(target, drafter).costs
    assert math.isfinite(costs.verify_token_cost) and costs.verify_token_cost >= 0
    assert "verify_token_cost" in caplog.text and "measuring again" in caplog.text


@pytest.mark.parametrize("bad", [-1, 2.5, "three", True])
def test_a_cached_kernel_choice_that_is_not_a_row_count_is_measured_again(cache_dir, bad, caplog):
    target = make_target("llama")
    drafter = make_drafter(target)
    write_calibration(target, drafter, COSTS, blas_max_rows=bad)
    measured = calibrated(target, drafter)
    assert isinstance(measured.blas_max_rows, int) and measured.blas_max_rows >= 0
    assert "blas_max_rows" in caplog.text and "measuring again" in caplog.text


def test_generate_runs_few_row_forwards_on_the_calibrated_kernel(cache_dir, monkeypatch):
    """The calibration's `blas_max_rows` and `max_packed_rows` reach the fast path of `generate` (and the output is
    unchanged)."""
    target = make_target("qwen3")
    drafter = make_drafter(target)
    drafter.generation_config.calibrate_costs = True
    write_calibration(target, drafter, COSTS, blas_max_rows=5, max_packed_rows=1 << 30)
    opened, original = [], verification.packed_linear_weights

    def spy(*models, **kwargs):
        opened.append((kwargs.get("blas_max_rows"), kwargs.get("max_rows")))
        return original(*models, **kwargs)

    monkeypatch.setattr(verification, "packed_linear_weights", spy)
    prompt = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    reference, assisted = greedy_pair(target, drafter, prompt, max_new_tokens=16)
    assert torch.equal(reference, assisted)
    assert opened == [(5, 1 << 30)]


def test_generate_plans_with_the_calibrated_costs_and_stays_exact(cache_dir, monkeypatch):
    target = make_target("qwen3")
    drafter = make_drafter(target)
    drafter.generation_config.calibrate_costs = True
    write_calibration(target, drafter, COSTS)
    seen = spy_on_costs(monkeypatch)
    prompt = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    reference, assisted = greedy_pair(target, drafter, prompt, max_new_tokens=24)
    assert torch.equal(reference, assisted)
    assert seen == [RoundCosts(**COSTS)]
    sampled = []
    for _ in range(2):  # a seeded run repeats given the same calibration
        torch.manual_seed(7)
        sampled.append(target.generate(prompt, do_sample=True, max_new_tokens=24, assistant_model=drafter))
    assert torch.equal(sampled[0], sampled[1])


def test_a_cost_field_set_beside_the_calibration_is_pinned_over_its_measurement(cache_dir, monkeypatch):
    """`draft_round_cost=0` with `calibrate_costs`: the drafter is never priced out, the verification keeps its
    measured price (the planner still cuts the block), and the output stays the target's."""
    target = make_target("qwen3")
    drafter = make_drafter(target)
    drafter.generation_config.calibrate_costs = True
    drafter.generation_config.draft_round_cost = 0.0
    measured = {**COSTS, "forward_costs": [[2, 1.2], [8, 1.9]], "draft_batch_costs": [[8, 0.9]]}
    write_calibration(target, drafter, measured)
    seen = spy_on_costs(monkeypatch)
    prompt = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    reference, assisted = greedy_pair(target, drafter, prompt, max_new_tokens=24)
    assert torch.equal(reference, assisted)
    pinned = {**COSTS, "draft_round_cost": 0.0, "forward_costs": ((2, 1.2), (8, 1.9))}
    assert seen == [RoundCosts(**pinned)]  # the measured batch points of the drafter's round go with its pin
    drafter.generation_config.verify_token_cost = 0.5  # a pinned verification cost replaces the measured curve
    seen.clear()
    target.generate(prompt, max_new_tokens=4, assistant_model=drafter)
    assert seen == [RoundCosts(**{**COSTS, "draft_round_cost": 0.0, "verify_token_cost": 0.5})]
    drafter.generation_config.draft_round_cost = -1.0
    message = error_of(lambda: target.generate(prompt, max_new_tokens=4, assistant_model=drafter))
    assert message is not None and "draft_round_cost" in message


def test_without_calibrate_costs_the_drafters_own_cost_fields_apply(cache_dir, monkeypatch):
    target = make_target("qwen3")
    drafter = make_drafter(target)
    drafter.generation_config.verify_token_cost = 0.25
    seen = spy_on_costs(monkeypatch)
    target.generate(torch.randint(0, 64, (1, 8)), max_new_tokens=4, assistant_model=drafter)
    assert seen == [RoundCosts(verify_token_cost=0.25)]
    assert not (cache_dir / "calibration").exists()


# --- invalid knobs are refused before any forward ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("verify_token_cost", -0.09),
        ("draft_round_cost", float("nan")),
        ("verify_round_cost", float("inf")),
        ("assistant_confidence_threshold", 7),
        ("block_confidence_threshold", -0.1),
        ("lookup_min_match", -1),
        ("lookup_min_match", 2.5),
        ("lookup_num_tokens", 0),
        ("step_doubling_length", "lots"),
        ("calibrate_costs", "yes"),
        ("use_drafter", 1),
        ("lookup_first", "no"),
    ],
)
def test_invalid_knobs_are_refused_before_any_forward(field, value):
    target = make_target("qwen3")
    drafter = make_drafter(target)
    setattr(drafter.generation_config, field, value)
    forwards = []
    target.register_forward_hook(lambda *args: forwards.append(1))
    message = error_of(lambda: target.generate(torch.randint(0, 64, (1, 8)), max_new_tokens=4, assistant_model=drafter))
    assert message is not None and field in message, f"{field}={value!r} was not refused: {message}"
    assert forwards == []


# --- the drafter's linear layers in bfloat16 -------------------------------------------------------------------


def test_greedy_output_is_the_same_whatever_the_drafters_linear_dtype():
    target = make_target("qwen3")
    prompt = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(3))
    for dtype in (torch.bfloat16, torch.float32, torch.int8, torch.qint8, "auto"):
        drafter = make_drafter(target)
        drafter.linear_dtype = dtype
        reference, assisted = greedy_pair(target, drafter, prompt, max_new_tokens=20)
        assert torch.equal(reference, assisted), dtype


def test_an_invalid_linear_dtype_is_refused():
    target = make_target("qwen3")
    drafter = make_drafter(target)
    drafter.linear_dtype = torch.float16
    with pytest.raises(ValueError, match="linear_dtype"):
        target.generate(torch.randint(0, 64, (1, 8)), max_new_tokens=4, assistant_model=drafter)


@functools.cache
def low_precision_sampling_setup(linear_dtype: torch.dtype):
    """The bigram target of the sampling tests, with a drafter whose linear layers run in `linear_dtype`: bfloat16
    (where the CPU packs bf16; elsewhere they fall back to fp32), int8 weights or dynamic int8."""
    target = make_bigram_target("llama", vocab_size=LAW_VOCAB, seed=3, temperature=0.05)
    drafter = make_oracle_drafter(target, strength=2.0, block_size=3, seed=5)
    drafter.linear_dtype = linear_dtype
    prompt = torch.tensor([[1, 4, 2, 5]])
    return target, drafter, prompt, exact_law(target, prompt)


@pytest.mark.parametrize("linear_dtype", [torch.bfloat16, torch.int8, torch.qint8], ids=["bf16", "int8", "qint8"])
def test_sampling_with_a_low_precision_drafter_and_calibrated_costs_matches_the_target_law(linear_dtype, cache_dir):
    target, drafter, prompt, law = low_precision_sampling_setup(linear_dtype)
    drafter.generation_config.calibrate_costs = True
    write_calibration(target, drafter, {**COSTS, "draft_round_cost": 0.05, "verify_token_cost": 0.01})
    counts = sampled_counts(target, drafter, prompt)
    assert drafter.drafting_stats.drafted_tokens > 0
    assert chi_square_pvalue(counts, law) > 1e-3


def test_the_low_precision_sampling_test_detects_a_broken_verifier(monkeypatch):
    """The negative control, once: the test's power comes from the target's law and the drafter's proposals, not from
    the precision its layers run in (dynamic int8 here, what `"auto"` picks on x86)."""
    from test_generation import broken_speculative_sampling

    target, drafter, prompt, law = low_precision_sampling_setup(torch.qint8)
    drafter.generation_config.calibrate_costs = False
    monkeypatch.setattr(generation_utils, "_speculative_sampling", broken_speculative_sampling)
    counts = sampled_counts(target, drafter, prompt)
    assert chi_square_pvalue(counts, law) < 1e-6
