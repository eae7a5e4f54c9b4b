"""Verification cost, drafting cost on synthetic caches, synthetic targets and their commands. No timing assertions."""

import argparse
import json

import pytest
import torch
from transformers import Qwen3ForCausalLM

from helpers import make_target
from transformers_longspark import cli
from transformers_longspark.benchmarks import (
    DraftingCostSettings,
    VerifyCostSettings,
    add_bench_arguments,
    run_drafting_cost,
    run_verify_cost,
)
from transformers_longspark.benchmarks.common import Timings, measure, prefill
from transformers_longspark.benchmarks.drafting_cost import (
    _generators,
    format_drafting_cost,
    full_prefix_state_bytes,
    plot_drafting_cost,
    synthetic_cache,
)
from transformers_longspark.benchmarks.models import build_random_drafter, build_synthetic_target
from transformers_longspark.benchmarks.settings import SYNTHETIC_TARGETS
from transformers_longspark.benchmarks.verify_cost import format_verify_cost, plot_verify_cost, reserved_copy
from transformers_longspark.inference.generation import requests_after
from transformers_longspark.inference.verification import ReservedDynamicLayer

PNG = b"\x89PNG\r\n\x1a\n"


# --- shared timing helper -----------------------------------------------------------------------------------------


def test_measure_interleaves_warms_up_and_chains_phases():
    order = []
    calls = {
        "a": lambda: order.append("a"),
        "b": (lambda: order.append("b") or 5, lambda value: order.append(f"b{value}")),
    }
    timings = measure(calls, repeats=3, warmup=1, prepare=lambda name: order.append(f"prepare {name}"))
    assert order[:6] == ["prepare a", "a", "prepare b", "b", "b5", "prepare b"]  # repeat 2 starts with b
    assert order.count("a") == 4 and order.count("b5") == 4  # warm-up + 3 timed repeats
    assert len(timings["a"].seconds) == 3 and all(len(laps) == 2 for laps in timings["b"].seconds)
    assert Timings([(0.001, 0.002), (0.003, 0.001), (0.002, 0.002)]).median_ms() == pytest.approx(4.0)
    assert Timings([(0.001, 0.002), (0.003, 0.001), (0.002, 0.002)]).median_ms(0) == pytest.approx(2.0)


# --- verification cost --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verify_result():
    target = make_target("qwen3", num_attention_heads=4, num_key_value_heads=2)
    settings = VerifyCostSettings(prefix_lengths=(48, 16), num_tokens=(4, 1, 2), repeats=2, warmup=1, prefill_chunk=32)
    return run_verify_cost(target, settings)


def test_verify_cost_fields_and_shapes(verify_result):
    result = verify_result
    assert result["benchmark"] == "verify-cost"
    assert result["prefix_lengths"] == [16, 48] and result["num_tokens"] == [1, 2, 4]
    for field in ("stock_ms", "longspark_ms", "ratio_to_stock_one_token", "stock_ratio_to_stock_one_token"):
        assert [len(row) for row in result[field]] == [3, 3], field
    assert all(ms > 0 for row in result["stock_ms"] + result["longspark_ms"] for ms in row)
    assert [row[0] for row in result["stock_ratio_to_stock_one_token"]] == [1.0, 1.0]
    for ratios, fast, stock in zip(result["ratio_to_stock_one_token"], result["longspark_ms"], result["stock_ms"],
                                   strict=True):  # fmt: skip
        assert ratios == pytest.approx([ms / stock[0] for ms in fast])
    assert len(result["prefill_ms"]) == 2 and result["attn_implementation"] == "sdpa"
    assert {"cpu", "torch", "device"} <= set(result["machine"])
    json.dumps(result)


def test_verify_cost_table_and_plot(verify_result, tmp_path):
    table = format_verify_cost(verify_result)
    assert "| k=4 stock ms | k=4 fast ms | k=4 fast/stock-1 |" in table
    assert table.count("\n| 16 |") == 1 and table.count("\n| 48 |") == 1
    path = plot_verify_cost(verify_result, tmp_path / "verify.png")
    assert path.read_bytes()[:8] == PNG


def test_verify_cost_without_a_one_token_forward_has_no_ratios():
    target = make_target("llama")
    result = run_verify_cost(target, VerifyCostSettings(prefix_lengths=(16,), num_tokens=(2,), repeats=1, warmup=0))
    assert result["ratio_to_stock_one_token"] == [[None]]
    assert "| - |" in format_verify_cost(result)


def test_reserved_copy_holds_the_same_rows_in_reserved_layers():
    target = make_target("qwen3")
    stock = prefill(target, torch.randint(0, 64, (1, 40)), chunk=16)
    fast = reserved_copy(stock, target.config, 48)
    assert fast.get_seq_length() == 40
    for source, layer in zip(stock.layers, fast.layers, strict=True):
        assert isinstance(layer, ReservedDynamicLayer) and layer.capacity >= 48
        assert torch.equal(layer.keys, source.keys) and torch.equal(layer.values, source.values)
        assert layer.keys.data_ptr() == layer._key_buffer.data_ptr()  # a view of the reserve, not a copy


# --- synthetic targets and caches ---------------------------------------------------------------------------------


def test_synthetic_target_has_the_requested_shapes():
    spec = SYNTHETIC_TARGETS["tiny"]
    target = build_synthetic_target("tiny", dtype=torch.bfloat16)
    assert isinstance(target, Qwen3ForCausalLM) and target.config._attn_implementation == "sdpa"
    assert {p.dtype for p in target.parameters()} == {torch.bfloat16} and torch.get_default_dtype() == torch.float32
    attention = target.model.layers[0].self_attn
    assert len(target.model.layers) == spec["num_hidden_layers"]
    assert attention.q_proj.weight.shape == (spec["num_attention_heads"] * spec["head_dim"], spec["hidden_size"])
    assert attention.k_proj.weight.shape == (spec["num_key_value_heads"] * spec["head_dim"], spec["hidden_size"])
    assert target.lm_head.weight.shape == (spec["vocab_size"], spec["hidden_size"])
    assert target.model.layers[0].mlp.up_proj.weight.shape == (spec["intermediate_size"], spec["hidden_size"])
    drafter = build_random_drafter(target)
    assert next(drafter.parameters()).dtype == torch.bfloat16 and drafter.config.num_key_value_heads == 2
    with pytest.raises(ValueError, match="qwen3-8b"):
        build_synthetic_target("qwen3-9b")


@pytest.mark.parametrize("name, billions", [("qwen3-4b", 4.02), ("qwen3-8b", 8.19), ("qwen3-14b", 14.77)])
def test_published_shapes_on_the_meta_device(name, billions):
    """The configs give the published parameter counts (built on `meta`: no memory, no time)."""
    target = build_synthetic_target(name, device="meta", dtype=torch.bfloat16)
    assert sum(p.numel() for p in target.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)
    assert target.config.rope_parameters["rope_theta"] == 1e6 and target.config.max_position_embeddings == 40960
    assert next(target.parameters()).dtype == torch.bfloat16


def test_synthetic_cache_fills_only_the_selected_layers():
    target = build_synthetic_target("tiny")
    cache = synthetic_cache(target, [0, 2], 100)
    assert cache.get_seq_length() == 100
    assert [layer.is_initialized for layer in cache.layers] == [True, False, True, False]
    assert cache.layers[2].keys.shape == (1, 2, 100, 16)


@pytest.fixture(scope="module")
def synthetic_cost():
    target = build_synthetic_target("tiny")
    drafter = build_random_drafter(target, window_size=8, num_summary_queries=4, block_size=4, num_selected_layers=3)
    settings = DraftingCostSettings(prefix_lengths=(16, 32), rounds=2, warmup=1, synthetic_prefix_lengths=(64, 8192))
    result = run_drafting_cost(target, drafter, settings)
    return drafter, result


def test_drafting_cost_synthetic_rows(synthetic_cost):
    drafter, result = synthetic_cost
    assert result["prefix_lengths"] == [16, 32, 64, 8192]  # 8192 is past max_position_embeddings: fine, synthetic
    assert result["synthetic"] == [False, False, True, True] and result["synthetic_prefix_lengths"] == [64, 8192]
    assert [row["synthetic"] for row in result["rows"]] == result["synthetic"]
    assert [row["prefix_length"] for row in result["rows"]] == result["prefix_lengths"]
    assert len(set(result["longspark_state_bytes"])) == 1  # fixed, real or synthetic
    expected = [full_prefix_state_bytes(drafter.config, t) for t in result["prefix_lengths"]]
    assert result["full_prefix_state_bytes"] == expected == result["full_prefix_state_bytes_formula"]
    assert all(ms > 0 for ms in result["longspark_ms"] + result["full_prefix_ms"])
    ratio = result["round_cost_ratio"]
    assert ratio["lengths"] == [16, 8192] and set(ratio) == {"lengths", "longspark", "full_prefix"}
    for name in ("longspark", "full_prefix"):
        assert ratio[name] == result[f"{name}_ms_vs_shortest"][-1] == result[f"{name}_ms"][-1] / result[f"{name}_ms"][0]
    table = format_drafting_cost(result)
    assert "(synthetic)" in table and "Round cost 8K / 16" in table and table.count("\n| ") == 4  # a row per length
    json.dumps(result)


def test_drafting_cost_plot_with_synthetic_lengths(synthetic_cost, tmp_path):
    _, result = synthetic_cost
    assert plot_drafting_cost(result, tmp_path / "cost.png").read_bytes()[:8] == PNG


def test_drafting_cost_generators_draft_whole_blocks_whatever_the_drafter_thresholds():
    target = build_synthetic_target("tiny")
    drafter = build_random_drafter(target, window_size=8, num_summary_queries=4, block_size=4)
    drafter.generation_config.assistant_confidence_threshold = 0.99  # a random drafter is never that confident
    input_ids = torch.randint(0, 512, (1, 33))
    full_prefix = build_random_drafter(target, window_size=8, num_summary_queries=4, block_size=4)
    gens = _generators(target, {"longspark": drafter, "full_prefix": full_prefix}, input_ids)
    cache = prefill(target, input_ids[:, :32])
    gen = gens["longspark"]
    requests = requests_after(input_ids, 4)
    proposal = gen.session.draft_round(requests, [gen.planner], lambda: gen.update_context(cache, 32, 0))
    assert proposal.tokens.shape[1] == 4 and int(proposal.num_drafted[0]) == 4  # whole blocks
    assert gen.planner.lookup is None and gens["full_prefix"].planner.lookup is None
    for gen in gens.values():
        gen.close()


def test_drafting_cost_on_a_bfloat16_synthetic_target():
    target = build_synthetic_target("tiny", dtype=torch.bfloat16)
    drafter = build_random_drafter(target, window_size=8, num_summary_queries=4, block_size=4)
    settings = DraftingCostSettings(prefix_lengths=(), rounds=1, warmup=0, synthetic_prefix_lengths=(32,))
    result = run_drafting_cost(target, drafter, settings)
    assert result["synthetic"] == [True] and result["dtype"] == "torch.bfloat16"
    assert result["full_prefix_state_bytes"] == [full_prefix_state_bytes(drafter.config, 32, torch.bfloat16)]


# --- command line -------------------------------------------------------------------------------------------------


def test_cost_subcommands_parse():
    parser = argparse.ArgumentParser(prog="longspark")
    add_bench_arguments(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "verify-cost", "--json", "v.json", "--plot", "v.png"])
    assert args.bench_command == "verify-cost" and str(args.plot) == "v.png" and args.repeats == 7
    assert args.prefix_lengths == [512, 1024, 2048, 4096, 8192] and args.num_tokens == [1, 2, 4, 8, 16]
    argv = ["bench", "verify-cost", "--device", "cuda", "--dtype", "bfloat16", "--synthetic-target", "qwen3-8b",
            "--prefix-lengths", "4096", "32768", "--num-tokens", "1", "8"]  # fmt: skip
    args = parser.parse_args(argv)
    assert (args.device, args.dtype, args.synthetic_target) == ("cuda", "bfloat16", "qwen3-8b")
    assert args.prefix_lengths == [4096, 32768] and args.num_tokens == [1, 8]
    args = parser.parse_args(["bench", "drafting-cost"])
    assert args.synthetic_prefix_lengths == [32768, 65536, 131072] and args.prefix is None
    args = parser.parse_args(["bench", "drafting-cost", "--synthetic-prefix-lengths", "--synthetic-target", "tiny"])
    assert args.synthetic_prefix_lengths == [] and args.synthetic_target == "tiny"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "verify-cost", "--synthetic-target", "gpt-5"])


def test_cost_commands_end_to_end_on_the_tiny_synthetic_target(tmp_path, capsys):
    common = ["--synthetic-target", "tiny", "--num-threads", "1"]
    cli.main(["bench", "verify-cost", *common, "--prefix-lengths", "32", "--num-tokens", "1", "2", "--repeats", "1",
              "--warmup", "0", "--json", str(tmp_path / "v.json"), "--plot", str(tmp_path / "v.png"),
              "--markdown", str(tmp_path / "v.md")])  # fmt: skip
    verify = json.loads((tmp_path / "v.json").read_text())
    assert verify["target"] == "synthetic:tiny" and verify["command"].startswith("longspark bench verify-cost")
    assert (tmp_path / "v.png").read_bytes()[:8] == PNG and "| 32 |" in (tmp_path / "v.md").read_text()
    cli.main(["bench", "drafting-cost", *common, "--prefix-lengths", "16", "--synthetic-prefix-lengths", "64",
              "--rounds", "1", "--warmup", "0", "--json", str(tmp_path / "d.json"),
              "--plot", str(tmp_path / "d.png")])  # fmt: skip
    cost = json.loads((tmp_path / "d.json").read_text())
    assert cost["synthetic"] == [False, True] and cost["prefix_source"] == "random"  # no tokenizer: random ids
    assert cost["drafter"]["trained"] is False and (tmp_path / "d.png").is_file()
    assert "(synthetic)" in capsys.readouterr().out


def test_target_and_synthetic_target_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "verify-cost", "--target", "some/folder", "--synthetic-target", "tiny"])
    assert exit_info.value.code == 2 and "either --target or --synthetic-target" in capsys.readouterr().err
