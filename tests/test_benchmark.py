"""Benchmark reports: fields, tau arithmetic, context-state bytes, plot and table. No timing assertions."""

import json
import re
from itertools import pairwise

import pytest
import torch
from transformers import AttentionInterface

from helpers import make_bigram_target, make_drafter, make_oracle_drafter, make_target
from transformers_longspark.benchmarks import SpeedSettings, run_speed_benchmark
from transformers_longspark.benchmarks.common import count_forward_calls
from transformers_longspark.benchmarks.report import format_markdown
from transformers_longspark.benchmarks.settings import (
    DEFAULT_METHODS,
    DRAFTER_METHODS,
    METHODS,
    PLAIN_METHODS,
    WHOLE_BLOCKS,
)
from transformers_longspark.benchmarks.speed import drafter_settings
from transformers_longspark.benchmarks.speed_summary import (
    METHOD_LABELS,
    add_speedups,
    new_tokens_from_round_log,
    summarize_runs,
)
from transformers_longspark.inference.stats import DraftingStats, tau
from transformers_longspark.inference.verification import (
    ATTENTION_NAME,
    ReservedDynamicLayer,
    grouped_verification_attention,
)

SUMMARY_FIELDS = {
    "method", "tau", "tokens_per_s", "speedup", "ms_per_token", "new_tokens", "seconds", "rounds", "target_forwards",
    "tokens_per_forward",
}  # fmt: skip
DRAFTER_FIELDS = {
    "proposal_ms_per_round",
    "context_update_ms_per_round",
    "context_state_bytes",
    "drafted_tokens",
    "lookup_rounds",
    "acceptance_rates",
    "accepted_histogram",
}
# A/B variants of the speed report: the drafts of `longspark_whole_blocks` on the stock verification path, and the
# lookup source off and on.
VARIANTS = {
    "whole_blocks": WHOLE_BLOCKS,
    "stock_verify": {"fast_verification": False, **WHOLE_BLOCKS},
    "no_lookup": {"lookup_min_match": 0},
    "lookup": {"lookup_min_match": 2, "lookup_num_tokens": 6},
}


# --- tau ----------------------------------------------------------------------------------------------------------


def test_tau_from_a_known_round_log():
    log = [3, 0, 6, 2]  # draft tokens accepted in each verification round
    new_tokens = new_tokens_from_round_log(log)
    assert new_tokens == 1 + 4 + 1 + 7 + 3  # prefill token, then accepted + bonus per round
    assert tau(new_tokens, len(log)) == pytest.approx(3.75)  # mean accepted + 1
    assert tau(new_tokens_from_round_log([0] * 9), 9) == 1.0  # nothing accepted: plain decoding


@pytest.mark.parametrize("new_tokens, rounds", [(5, 0), (0, 1), (3, 4)])
def test_tau_refuses_impossible_logs(new_tokens, rounds):
    with pytest.raises(ValueError):
        tau(new_tokens, rounds)


def test_summary_tau_is_token_weighted_over_prompts():
    runs = [
        dict(new_tokens=new_tokens_from_round_log(log), seconds=1.0, rounds=len(log), target_forwards=len(log) + 1)
        for log in ([3, 0, 6, 2], [1, 1])
    ]
    summary = summarize_runs(runs, "prompt_lookup")
    assert summary["tau"] == pytest.approx((15 + 4) / 6)
    assert summary["tokens_per_forward"] == pytest.approx((16 + 5) / (5 + 3))
    assert summarize_runs(runs, "plain")["tau"] == 1.0


def test_forward_counter_counts_one_target_forward_per_plain_token():
    target = make_target("llama")
    with count_forward_calls(target) as calls:
        target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=7, do_sample=False)
    assert calls[0] == 7
    target(torch.tensor([[1]]))
    assert calls[0] == 7  # the hook is gone


# --- speed --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def speed_report():
    torch.manual_seed(0)
    target = make_bigram_target("llama", vocab_size=64, seed=2)
    drafter = make_oracle_drafter(target, agree_on=lambda ids: ids % 3 != 0, window_size=8, block_size=4)
    prompts = {
        "short": [[5, 9, 28], torch.tensor([7, 1, 3, 7, 1])],
        "long": [{"name": "long-0", "input_ids": torch.randint(0, 64, (40,)).tolist()}],
    }
    return run_speed_benchmark(target, None, drafter, prompts, SpeedSettings(max_new_tokens=10, variants=VARIANTS))


def test_speed_report_fields(speed_report):
    assert {"machine", "settings", "drafter", "workloads", "rows"} <= set(speed_report)
    assert {"cpu", "cpu_cores", "torch_threads", "torch"} <= set(speed_report["machine"])
    assert set(speed_report["workloads"]) == {"short", "long"}
    modes = {(row["workload"], row["mode"], row["method"]) for row in speed_report["rows"]}
    for workload in ("short", "long"):
        assert {(workload, "greedy", method) for method in [*METHODS, *VARIANTS]} <= modes
        assert {(workload, "sampled", method) for method in DEFAULT_METHODS["sampled"]} <= modes
        assert (workload, "sampled", "full_prefix") not in modes  # the baseline runs greedily only
    for row in speed_report["rows"]:
        assert set(row) >= SUMMARY_FIELDS
        assert row["new_tokens"] > 0 and row["tau"] >= 1.0 and row["verify_ms_per_round"] > 0
        if row["method"] in DRAFTER_METHODS or row["method"] in VARIANTS:
            assert set(row) >= DRAFTER_FIELDS
        if row["method"] == "plain":
            assert row["tau"] == 1.0 and row["speedup"] == 1.0
        if row["mode"] == "greedy":
            assert row["greedy_identical_prompts"] <= row["prompts"]


def test_speed_report_runs_per_prompt(speed_report):
    greedy = speed_report["workloads"]["short"]["greedy"]
    assert [p["prompt_tokens"] for p in speed_report["workloads"]["short"]["prompts"]] == [3, 5]
    for method, runs in greedy["runs"].items():
        assert [run["prompt"] for run in runs] == ["prompt-0", "prompt-1"]
        for run in runs:
            assert run["new_tokens"] == 10
            if method in PLAIN_METHODS:
                assert run["target_forwards"] == 10
            if method in DRAFTER_METHODS or method in VARIANTS:
                assert run["target_forwards"] == run["rounds"] + 1  # prefill, then one forward per round
    # LongSpark on this bigram target drafts the target's own greedy tokens (for 2/3 of the previous tokens).
    longspark = greedy["methods"]["longspark"]
    assert longspark["greedy_identical"] and longspark["tau"] > 1.0


def test_verification_paths_change_nothing_but_the_time(speed_report):
    """Fast and stock verification of the same drafts (whole blocks): identical outputs and the same rounds."""
    for workload in ("short", "long"):
        greedy = speed_report["workloads"][workload]["greedy"]
        pairs = (("whole_blocks", "stock_verify"), ("prompt_lookup_fast", "prompt_lookup"))
        for fast, stock in pairs:
            assert greedy["methods"][fast]["greedy_identical"] and greedy["methods"][stock]["greedy_identical"]
            rounds = [[run["rounds"] for run in greedy["runs"][method]] for method in (fast, stock)]
            assert rounds[0] == rounds[1], (workload, fast)


def test_new_plain_paths_and_lookup_methods_are_lossless(speed_report):
    """plain_fast, plain_static and LongSpark with the lookup source off and on: greedy outputs identical to plain."""
    for workload in ("short", "long"):
        greedy = speed_report["workloads"][workload]["greedy"]["methods"]
        for method in ("plain_fast", "plain_static", "no_lookup", "lookup"):
            assert greedy[method]["greedy_identical"], (workload, method)
            assert greedy[method]["greedy_identical_prompts"] == greedy[method]["prompts"]
        for method in PLAIN_METHODS:
            summary = greedy[method]
            assert summary["tau"] == 1.0 and summary["rounds"] == summary["target_forwards"] - summary["prompts"]


def test_speedup_vs_best_plain_is_over_the_fastest_plain_path_of_the_run():
    def summary(tokens_per_s, decode_tokens_per_s):
        return {"tokens_per_s": tokens_per_s, "decode_tokens_per_s": decode_tokens_per_s}

    summaries = {
        "plain": summary(10.0, 8.0),
        "plain_fast": summary(12.0, 16.0),  # fastest plain path end to end
        "plain_static": summary(11.0, 20.0),  # fastest plain path for decoding
        "prompt_lookup": summary(30.0, 40.0),  # faster, but not a plain path
        "longspark": summary(18.0, 24.0),
    }
    add_speedups(summaries)
    longspark = summaries["longspark"]
    assert longspark["speedup"] == pytest.approx(1.8) and longspark["decode_speedup"] == pytest.approx(3.0)
    assert longspark["speedup_vs_best_plain"] == pytest.approx(18 / 12) and longspark["best_plain"] == "plain_fast"
    assert longspark["decode_speedup_vs_best_plain"] == pytest.approx(24 / 20)
    assert longspark["best_plain_decode"] == "plain_static"
    assert summaries["plain_fast"]["speedup_vs_best_plain"] == 1.0
    assert summaries["plain"]["speedup_vs_best_plain"] == pytest.approx(10 / 12)
    # Only stock plain measured (or the others without a rate): the best plain path is plain itself.
    only_plain = {"plain": summary(10.0, 8.0), "plain_fast": summary(None, None), "longspark": summary(18.0, 24.0)}
    add_speedups(only_plain)
    assert only_plain["longspark"]["speedup_vs_best_plain"] == only_plain["longspark"]["speedup"] == 1.8
    assert only_plain["longspark"]["best_plain"] == "plain" and only_plain["plain_fast"]["speedup"] is None


def test_lookup_variants_turn_the_lookup_source_on_and_off_and_restore_the_drafter():
    """On a bigram target greedy decoding cycles, so the lookup source finds its suffix again: the `lookup` variant
    proposes continuations (point-mass, lossless), `no_lookup` never; the drafter is left as it was."""
    target = make_bigram_target("llama", vocab_size=64, seed=2)
    drafter = make_oracle_drafter(target, agree_on=lambda ids: ids % 3 != 0, window_size=8, block_size=4)
    variants = {name: VARIANTS[name] for name in ("no_lookup", "lookup")}
    settings = SpeedSettings(max_new_tokens=40, modes=["greedy"], methods=list(variants), variants=variants,
                             warmup=False)  # fmt: skip
    report = run_speed_benchmark(target, None, drafter, [[5, 9, 28, 5, 9, 28]], settings)
    greedy = report["workloads"]["prompts"]["greedy"]
    lookup, no_lookup = greedy["methods"]["lookup"], greedy["methods"]["no_lookup"]
    assert lookup["greedy_identical"] and no_lookup["greedy_identical"]
    assert lookup["lookup_rounds"] > 0 and no_lookup["lookup_rounds"] == 0
    assert lookup["lookup_round_share"] == lookup["lookup_rounds"] / lookup["rounds"]
    assert len(lookup["acceptance_rates"]) > drafter.config.block_size  # lookup continuations are 6 > 4 tokens long
    for summary in (lookup, no_lookup):
        rates = summary["acceptance_rates"]
        assert all(1.0 >= a >= b >= 0.0 for a, b in pairwise([1.0, *rates]))
        assert sum(summary["accepted_histogram"]) == summary["rounds"]
        assert rates == DraftingStats(accepted_histogram=summary["accepted_histogram"]).acceptance_rates()
    run = greedy["runs"]["lookup"][0]
    assert run["lookup_rounds"] == lookup["lookup_rounds"] and run["acceptance_rates"] == lookup["acceptance_rates"]
    assert report["settings"]["variants"]["lookup"] == {"lookup_min_match": 2, "lookup_num_tokens": 6}
    assert "lookup_min_match" not in vars(drafter.generation_config)
    assert "lookup_num_tokens" not in vars(drafter.generation_config)


@pytest.mark.parametrize(
    "variants, message",
    [
        ({"bad": {"lookup_min_match": -1}}, "lookup_min_match"),
        ({"bad": {"assistant_confidence_threshold": 7}}, "assistant_confidence_threshold"),
        ({"bad": {"lookup_min_mtach": 2}}, "unknown settings \\['lookup_min_mtach'\\]"),
        ({"longspark": {"lookup_min_match": 0}}, "is a method already"),
    ],
)
def test_bad_variants_are_refused_before_any_forward(variants, message):
    target = make_target("llama")
    drafter = make_drafter(target)
    error = None
    with count_forward_calls(target) as calls:
        try:
            run_speed_benchmark(target, None, drafter, [[5, 9]], SpeedSettings(max_new_tokens=2, variants=variants))
        except ValueError as caught:
            error = caught
    assert error is not None and re.search(message, str(error)), error
    assert calls[0] == 0


def test_drafter_settings_are_applied_inside_and_restored_after():
    target = make_target("llama")
    drafter = make_drafter(target)
    config = drafter.generation_config
    config.assistant_confidence_threshold = 0.3
    settings = {"fast_verification": False, "assistant_confidence_threshold": 0.0, "lookup_min_match": 3}
    with pytest.raises(RuntimeError), drafter_settings(drafter, settings):
        assert not drafter.fast_verification and config.assistant_confidence_threshold == 0.0
        assert config.lookup_min_match == 3
        raise RuntimeError("restored even when the run fails")
    assert drafter.fast_verification and config.assistant_confidence_threshold == 0.3
    assert "lookup_min_match" not in vars(config)


def test_plain_static_sizes_its_cache_for_each_call():
    """transformers keeps a static cache as long as the longest call so far; the benchmark sizes it per call, so a
    short prompt after a long one does not attend over the long one's rows."""
    target = make_bigram_target("llama", vocab_size=64, seed=2)
    drafter = make_oracle_drafter(target, window_size=8, block_size=4)
    prompts = [list(range(1, 41)), [5, 9, 28, 5, 9]]  # the short prompt's static run comes last (rotated order)
    settings = SpeedSettings(max_new_tokens=6, modes=["greedy"], methods=["plain_static"])
    report = run_speed_benchmark(target, None, drafter, prompts, settings)
    assert report["workloads"]["prompts"]["greedy"]["methods"]["plain_static"]["greedy_identical"]
    assert target._previous_max_cache_length == 5 + 6 - 1  # the last call's own length
    assert report["settings"]["static_cache_len"] == "per call"  # on CPU; one size for the run where it compiles


@pytest.mark.parametrize(
    "method", ["longspark", "stock_verify", "prompt_lookup", "prompt_lookup_fast", "plain_fast", "plain_static"]
)
def test_each_method_verifies_on_its_own_path(method, monkeypatch):
    """The fast methods reach the grouped-head attention and reserved cache rows; the stock ones (and plain) never."""
    calls = {"attention": 0, "reserved": 0}

    def attention(*args, **kwargs):
        calls["attention"] += 1
        return grouped_verification_attention(*args, **kwargs)

    def update(self, *args, **kwargs):
        calls["reserved"] += 1
        return reserved_update(self, *args, **kwargs)

    reserved_update = ReservedDynamicLayer.update
    monkeypatch.setitem(AttentionInterface._global_mapping, ATTENTION_NAME, attention)
    monkeypatch.setattr(ReservedDynamicLayer, "update", update)
    target = make_bigram_target("llama", vocab_size=64, seed=2)
    drafter = make_oracle_drafter(target, window_size=8, block_size=4)
    settings = SpeedSettings(max_new_tokens=6, modes=["greedy"], methods=[method], variants=VARIANTS, warmup=False)
    report = run_speed_benchmark(target, None, drafter, [[5, 9, 28, 5, 9]], settings)
    fast = method in ("longspark", "prompt_lookup_fast", "plain_fast")
    assert (calls["attention"] > 0, calls["reserved"] > 0) == (fast, fast)
    assert drafter.fast_verification  # restored after the stock-verification runs
    assert all(row["greedy_identical"] for row in report["rows"])


def test_speed_report_is_json_and_markdown_lists_every_method(speed_report, tmp_path):
    path = tmp_path / "speed.json"
    path.write_text(json.dumps(speed_report))
    assert json.loads(path.read_text())["rows"]
    table = format_markdown(speed_report)
    for label in [*METHOD_LABELS.values(), *(f"LongSpark variant {name}" for name in VARIANTS)]:
        assert f"| {label} |" in table
    assert f"Variant lookup: LongSpark with {json.dumps(VARIANTS['lookup'])}." in table
    main_table = table.split("\n\n")[0]
    rows_per_workload = len(DEFAULT_METHODS["greedy"]) + len(DEFAULT_METHODS["sampled"]) + 2 * len(VARIANTS)
    assert main_table.count("\n| short |") == rows_per_workload == main_table.count("\n| long |")
    assert "| vs best plain |" in main_table and "| decode vs best plain |" in main_table
    # The per-position acceptance table: one row per drafter method, workload and mode.
    acceptance = table.split("Per-position acceptance")[1]
    drafter_rows = sum(len([m for m in DEFAULT_METHODS[mode] if m in DRAFTER_METHODS]) for mode in DEFAULT_METHODS)
    drafter_rows += 2 * len(VARIANTS)
    assert acceptance.count("\n| short |") == drafter_rows == acceptance.count("\n| long |")
