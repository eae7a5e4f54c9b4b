"""The benchmark commands: parsing, the memory, batched and tau reports, and their command lines."""

import argparse
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from helpers import context_target, make_drafter, make_oracle_drafter, make_target
from transformers_longspark import benchmarks
from transformers_longspark.benchmarks import BatchedSettings, MemorySettings, memory, run_batched_benchmark, runners
from transformers_longspark.benchmarks.batched import format_batched
from transformers_longspark.benchmarks.cli import parse_variants
from transformers_longspark.benchmarks.memory import format_memory
from transformers_longspark.inference.round_costs import RoundCosts
from transformers_longspark.inference.stats import tau

# --- command line -------------------------------------------------------------------------------------------------


def test_cli_subcommands_parse():
    parser = argparse.ArgumentParser(prog="longspark")
    benchmarks.add_bench_arguments(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--json", "a.json", "--markdown", "a.md", "--max-new-tokens", "16"])
    assert args.command == "bench" and args.bench_command is None and args.max_new_tokens == 16
    argv = ["bench", "drafting-cost", "--json", "c.json", "--plot", "c.png", "--prefix-lengths", "64"]
    args = parser.parse_args(argv)
    assert args.bench_command == "drafting-cost" and str(args.plot) == "c.png" and args.prefix_lengths == [64]
    args = parser.parse_args(["bench", "memory", "--prompt-lengths", "1024", "8192"])
    assert args.bench_command == "memory" and args.max_new_tokens == 16 and args.num_threads == 1
    args = parser.parse_args(["bench", "speed", "--modes", "greedy", "--methods", "plain", "longspark"])
    assert args.bench_command == "speed" and args.methods == ["plain", "longspark"]
    args = parser.parse_args(["bench", "--methods", "longspark", "prompt_lookup_fast", "whole", "--variant", "whole",
                              "assistant_confidence_threshold=0", "block_confidence_threshold=0", "--variant", "fp32",
                              "linear_dtype=float32"])  # fmt: skip
    assert args.methods == ["longspark", "prompt_lookup_fast", "whole"]
    assert parse_variants(args.variant) == {
        "whole": {"assistant_confidence_threshold": 0, "block_confidence_threshold": 0},
        "fp32": {"linear_dtype": "float32"},
    }
    for bad in (["whole"], ["whole", "0.3"], ["a=1", "b=2"]):
        with pytest.raises(ValueError, match="give a new name, then one or more KEY=VALUE"):
            parse_variants([bad])
    with pytest.raises(ValueError, match="give a new name"):
        parse_variants([["twice", "use_drafter=false"], ["twice", "lookup_min_match=0"]])


def test_memory_benchmark_report(tmp_path, monkeypatch):
    """The per-configuration workers run in-process here (the real command spawns fresh interpreters)."""
    target = make_target("llama")
    drafter = make_drafter(target)
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    commands = []

    def fake_run(command, **kwargs):
        commands.append(command)
        assert command[0] == sys.executable and "_memory_worker_main" in command[2]
        output = "MEMORY-RESULT " + json.dumps(memory._memory_worker(json.loads(command[-1])))
        return subprocess.CompletedProcess(command, 0, stdout=f"noise\n{output}\n", stderr="")

    # Not `subprocess.run` itself: `machine_info` (platform.processor) may call it too.
    monkeypatch.setattr(memory, "subprocess", SimpleNamespace(run=fake_run))
    settings = MemorySettings(prompt_lengths=(16, 48), max_new_tokens=4)
    result = benchmarks.run_memory_benchmark(str(tmp_path / "target"), str(tmp_path / "drafter"), settings)
    assert [json.loads(c[-1])["mode"] for c in commands] == ["plain", "assisted"] * 2
    assert [row["prompt_length"] for row in result["lengths"]] == [16, 48]
    assert len(result["runs"]) == 4 and all(run["new_tokens"] == 4 for run in result["runs"])
    for row in result["lengths"]:
        assert {"plain_peak_mib", "assisted_peak_mib", "extra_peak_mib", "extra_runtime_mib"} <= set(row)
        assert row["plain_peak_mib"] > 0 and row["drafter_context_state_bytes"] > 0
    assert "extra_peak_growth_mib" in result
    assert "| 48 |" in format_memory(result)


# --- batched benchmark -----------------------------------------------------------------------------------------------


def test_batched_benchmark_report():
    target = context_target("llama")
    drafter = make_oracle_drafter(target, window_size=8, block_size=4)
    prompts = {"short": [[5, 9, 28], [7, 1, 3, 7, 1]], "long": [list(range(1, 41))]}
    settings = BatchedSettings(batch_sizes=(1, 2, 3), max_new_tokens=8, modes=("greedy", "sampled"), pad_token_id=0)
    report = run_batched_benchmark(target, drafter, prompts, settings)
    keys = {(row["workload"], row["mode"], row["batch_size"]) for row in report["rows"]}
    assert keys == {(w, m, b) for w in prompts for m in ("greedy", "sampled") for b in (1, 2, 3)}
    for row in report["rows"]:
        assert row["plain_new_tokens"] == row["longspark_new_tokens"] == 8 * row["batch_size"]  # no EOS
        assert row["plain_tokens_per_s"] > 0 and row["longspark_tokens_per_s"] > 0 and row["tau"] >= 1.0
        assert row["greedy_identical"] is (True if row["mode"] == "greedy" else None)
    assert [r["padded_width"] for r in report["rows"] if r["workload"] == "short"][:3] == [3, 5, 5]
    table = format_batched(report)
    assert table.count("\n| short | greedy |") == 3 and "| long | sampled | 3 | 40 |" in table


def test_batched_benchmark_command_line(tmp_path, monkeypatch):
    """`longspark bench --batch-sizes ...` end to end, on a tiny target (its loading and prompts stubbed)."""
    target = context_target("qwen3")
    drafter = make_oracle_drafter(target, window_size=8, block_size=4)
    monkeypatch.setattr(runners, "_load_target", lambda args: (target, SimpleNamespace(pad_token_id=0, eos_token_id=1)))
    monkeypatch.setattr(runners, "_load_drafter", lambda args, target, path: (drafter, {"trained": False}))
    monkeypatch.setattr(runners, "short_prompts", lambda tokenizer, n, *where: [{"input_ids": [5, 9, 28]}] * n)
    monkeypatch.setattr(runners, "long_context_prompts", lambda *a, **k: [{"input_ids": list(range(2, 30))}])
    path = tmp_path / "batched.json"
    benchmarks.main(["--batch-sizes", "1", "4", "--max-new-tokens", "6", "--modes", "greedy", "--json", str(path)])
    report = json.loads(path.read_text())
    assert report["benchmark"] == "batched" and report["command"].startswith("longspark bench --batch-sizes 1 4")
    assert [(row["workload"], row["batch_size"]) for row in report["rows"]] == [("short", 1), ("short", 4),
                                                                                ("long", 1), ("long", 4)]  # fmt: skip
    assert all(row["greedy_identical"] for row in report["rows"])


def test_speed_comparison_command_line_without_batch_sizes(monkeypatch):
    """`longspark bench` without `--batch-sizes` asks for `--num-short-prompts` prompts and runs the comparison."""
    target = context_target("qwen3")
    monkeypatch.setattr(runners, "_load_target", lambda args: (target, SimpleNamespace(pad_token_id=0, eos_token_id=1)))
    monkeypatch.setattr(runners, "_load_drafter", lambda args, target, path: (make_drafter(target), {"trained": False}))
    asked = []
    monkeypatch.setattr(runners, "short_prompts", lambda tokenizer, n, *where: asked.append(n) or [])
    compared = []
    monkeypatch.setattr(runners, "run_speed_benchmark", lambda *args, **kwargs: compared.append(args) or {"rows": []})
    monkeypatch.setattr(runners, "format_markdown", lambda result: "")
    benchmarks.main(["--workloads", "short", "--num-short-prompts", "3"])
    assert asked == [3] and len(compared) == 1


# --- tau of several drafters ---------------------------------------------------------------------------------------


def test_tau_command_compares_drafters_on_the_same_prompts(tmp_path, monkeypatch):
    """`longspark bench tau --drafter NAME=FOLDER ...`: every drafter decodes every prompt; greedy outputs agree, and
    tau and the per-position acceptance come from `inference.stats`."""
    from transformers_longspark.benchmarks import tau as tau_module

    target = context_target("qwen3")
    costs = RoundCosts(draft_round_cost=0.5, verify_token_cost=0.1)  # this "machine's" calibration
    monkeypatch.setattr(tau_module, "calibrated", lambda target, drafter: SimpleNamespace(costs=costs))
    drafters = {
        str(tmp_path / "oracle"): make_oracle_drafter(target, window_size=8, block_size=4),
        str(tmp_path / "random"): make_drafter(target),
    }
    for folder in drafters:
        (tmp_path / folder).mkdir()
    monkeypatch.setattr(runners, "_load_target", lambda args: (target, SimpleNamespace(pad_token_id=0, eos_token_id=1)))
    monkeypatch.setattr(runners, "_load_drafter", lambda args, target, path: (drafters[path], {"path": path}))
    monkeypatch.setattr(runners, "short_prompts", lambda tokenizer, n, *where: [{"input_ids": [5, 9, 28]}] * n)
    monkeypatch.setattr(runners, "long_context_prompts", lambda *a, **k: [{"input_ids": list(range(2, 30))}])
    path = tmp_path / "tau.json"
    oracle, random = (f"--drafter={name}={folder}" for name, folder in zip(("oracle", "random"), drafters))
    benchmarks.main(["tau", oracle, random, "--num-short-prompts", "2", "--max-new-tokens", "8", "--json", str(path)])
    report = json.loads(path.read_text())
    rows = {(row["workload"], row["drafter"]): row for row in report["rows"]}
    assert set(rows) == {(w, d) for w in ("short", "long") for d in ("oracle", "random")}
    for row in rows.values():
        assert row["greedy_identical"] and row["tau"] == tau(row["new_tokens"], row["rounds"], row["prompts"])
    assert rows["short", "oracle"]["tau"] > rows["short", "random"]["tau"]
    assert rows["long", "oracle"]["acceptance_rates"][0] > 0 and rows["short", "random"]["acceptance_rates"] == []
    for row in rows.values():  # every round priced: a target step, its verification's extra, the drafter forward
        assert row["costs"]["draft_round_cost"] == 0.5 and 0 < row["tokens_per_step"] < row["tau"]


def test_tau_curve_by_length_runs_the_drafter_alone_and_draws_it(tmp_path, monkeypatch):
    """`bench tau --by-length --drafter-alone --plot`: one row per prefix length (the same text cut at each), every
    round drafted by the drafter (lookup off, costs 0), and the curve written as a PNG."""
    from transformers_longspark.benchmarks import tau as tau_module

    target = context_target("qwen3")
    drafter = make_oracle_drafter(target, window_size=8, block_size=4)
    drafter.generation_config.lookup_min_match = 2
    drafter.generation_config.draft_round_cost = 50.0  # priced out, unless --drafter-alone turns the costs off
    text = list(range(2, 40))

    def curve_prompts(tokenizer, lengths, num, max_positions, reserve, every_length):
        assert every_length
        return [{"name": f"f[:{n}]", "length": n, "input_ids": text[:n]} for n in lengths]

    monkeypatch.setattr(runners, "_load_target", lambda args: (target, SimpleNamespace(pad_token_id=0, eos_token_id=1)))
    monkeypatch.setattr(runners, "_load_drafter", lambda args, target, path: (drafter, {"path": path}))
    monkeypatch.setattr(runners, "long_context_prompts", curve_prompts)
    monkeypatch.setattr(tau_module, "calibrated", lambda target, drafter: SimpleNamespace(costs=RoundCosts()))
    path, plot = tmp_path / "curve.json", tmp_path / "curve.png"
    arguments = ["tau", "--drafter=oracle=x", "--workloads", "long", "--long-lengths", "12", "30", "--by-length"]
    benchmarks.main([*arguments, "--drafter-alone", "--max-new-tokens", "6", "--json", str(path), "--plot", str(plot)])
    rows = json.loads(path.read_text())["rows"]
    assert [row["workload"] for row in rows] == ["long@12", "long@30"]
    assert all(row["tau"] > 1.0 and row["acceptance_rates"][0] > 0 for row in rows)
    assert drafter.drafting_stats.lookup_rounds == 0 and drafter.drafting_stats.plain_rounds == 0
    assert plot.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="--by-length"):
        benchmarks.main(["tau", "--drafter=oracle=x", "--workloads", "long", "--plot", str(plot)])


def test_tokens_per_step_prices_each_round_by_its_source():
    from transformers_longspark.benchmarks.tau import round_cost_steps
    from transformers_longspark.inference.stats import DraftingStats

    stats = DraftingStats(rounds=10, drafter_rounds=6, drafted_tokens=20)  # 6 drafter rounds, 4 plain or lookup
    assert round_cost_steps(stats, RoundCosts(), prompt_length=100) == 10
    costs = RoundCosts(draft_round_cost=0.3, verify_round_cost=0.05, verify_token_cost=0.02, step_doubling_length=100)
    expected = 10 * 1.05 + 0.02 * 20 + 6 * 0.3 / 2  # at a 100-token prefix a target step costs twice its short cost
    assert round_cost_steps(stats, costs, prompt_length=100) == pytest.approx(expected)


def test_tau_command_rejects_an_unnamed_drafter(tmp_path):
    with pytest.raises(ValueError, match="NAME=FOLDER"):
        benchmarks.main(["tau", f"--drafter={tmp_path}"])
