"""`longspark` on bad input: one line `longspark: error: ...` on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from helpers import make_drafter, make_target
from transformers_longspark import cli


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    """No LONGSPARK_DEBUG from the environment, and no progress bars of transformers on stderr."""
    from transformers.utils import logging as hf_logging

    monkeypatch.delenv("LONGSPARK_DEBUG", raising=False)
    hf_logging.disable_progress_bar()
    yield
    hf_logging.enable_progress_bar()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny target, another tiny target of a different vocabulary, and a drafter for the first one."""
    root = tmp_path_factory.mktemp("models")
    target = make_target("qwen3")
    target.save_pretrained(root / "target")
    make_target("qwen3", vocab_size=96).save_pretrained(root / "other_target")
    make_drafter(target).save_pretrained(root / "drafter")
    return {name: root / name for name in ("target", "other_target", "drafter")}


def cli_error(argv: list, capsys) -> str:
    """Runs `longspark ARGV`, checks the exit status and the one-line stderr, returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(arg) for arg in argv])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("longspark: error: "), stderr
    return lines[0]


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_missing_data_folder(tmp_path, capsys):
    config = write_config(tmp_path / "run.yaml", f"output_dir: {tmp_path}/out\ntrain_data: {tmp_path}/data/train\n")
    line = cli_error(["train", "--config", config], capsys)
    assert f"Training data {tmp_path}/data/train does not exist" in line
    assert f"longspark regenerate --prompts gsm8k mmath-en stdlib-code --output {tmp_path}/data --held-out 40" in line


def test_unknown_config_field(tmp_path, capsys):
    config = write_config(tmp_path / "run.yaml", "output_dir: out\ntrain_data: data\nlearning_rat: 0.001\n")
    line = cli_error(["train", "--config", config], capsys)
    assert f"Unknown field(s) in the training config {config}: 'learning_rat' (did you mean 'learning_rate'?)" in line


def test_a_wrong_typed_config_value_is_named_before_the_target_loads(tmp_path, capsys):
    config = write_config(tmp_path / "run.yaml", "output_dir: out\ntrain_data: data\nmax_steps: lots\n")
    line = cli_error(["train", "--config", config], capsys)
    assert "max_steps must be an integer or null, got 'lots'" in line


@pytest.mark.parametrize("argv", [["bench", "--frobnicate", "3"], ["bench", "speed", "--frobnicate=3"]])
def test_an_unknown_option_is_named(argv, capsys):
    assert "unknown option(s) --frobnicate" in cli_error(argv, capsys)


def test_missing_and_malformed_config_files(tmp_path, capsys):
    line = cli_error(["train", "--config", tmp_path / "missing.yaml"], capsys)
    assert f"Training config {tmp_path}/missing.yaml does not exist" in line
    config = write_config(tmp_path / "bad.yaml", "output_dir: out\ntrain_data: [data\n")
    assert "is not valid YAML at line" in cli_error(["train", "--config", config], capsys)
    config = write_config(tmp_path / "partial.yaml", "output_dir: out\n")
    assert "lacks the required field(s) train_data" in cli_error(["train", "--config", config], capsys)


def test_unreadable_training_corpus(tmp_path, capsys, folders):
    data = tmp_path / "data"
    data.mkdir()
    good = '{"id": 0, "prompt_ids": [1, 2], "response_ids": [3, 4, 5]}'
    (data / "part-00000.jsonl").write_text(good + '\n{"id": 1, "pro\n')
    config = write_config(tmp_path / "run.yaml", f"output_dir: {tmp_path}/out\ntrain_data: {data}\n"
                          f"target: {folders['target']}\nnum_threads: 1\n")  # fmt: skip
    line = cli_error(["train", "--config", config], capsys)
    assert f"{data}/part-00000.jsonl:2 is not valid JSON" in line and "fix or delete that line" in line


def test_unreadable_prompt_file(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hi"}\n{"prompt": \n')
    line = cli_error(["regenerate", "--prompts", prompts, "--output", tmp_path / "out"], capsys)
    assert f"{prompts}:2 is not valid JSON" in line
    line = cli_error(["regenerate", "--prompts", "gsm8kk", "--output", tmp_path / "out"], capsys)
    assert "Prompt source gsm8kk is not a builtin" in line


def test_drafter_that_does_not_match_the_target(capsys, folders):
    line = cli_error(["bench", "drafting-cost", "--target", folders["other_target"], "--drafter", folders["drafter"],
                      "--prefix-lengths", "16", "--rounds", "1", "--num-threads", "1"], capsys)  # fmt: skip
    drafter, target = folders["drafter"], folders["other_target"]
    assert f"The LongSpark drafter {drafter} does not match the target model {target}: " in line
    assert "vocab_size: drafter 64 != target 96" in line and "from_target_config" in line


def test_missing_drafter_and_target_folders(tmp_path, capsys, folders):
    line = cli_error(["bench", "drafting-cost", "--target", folders["target"], "--drafter", tmp_path / "nope"], capsys)
    assert f"Drafter folder {tmp_path}/nope does not exist" in line
    line = cli_error(["bench", "verify-cost", "--target", tmp_path / "nope"], capsys)
    assert f"Target folder {tmp_path}/nope does not exist" in line


def test_card_and_push_name_the_missing_input(tmp_path, capsys, folders):
    line = cli_error(["card", folders["drafter"], "--benchmark", tmp_path / "bench.json"], capsys)
    assert f"Benchmark report {tmp_path}/bench.json does not exist; write it with `longspark bench --json" in line
    (tmp_path / "bench.json").write_text("{not json")
    line = cli_error(["card", folders["drafter"], "--benchmark", tmp_path / "bench.json"], capsys)
    assert "is not valid JSON" in line
    line = cli_error(["card", tmp_path, "--benchmark", tmp_path / "bench.json"], capsys)
    assert "is not a LongSpark drafter folder (no config.json or model.safetensors)" in line
    assert "Drafter folder" in cli_error(["push", tmp_path / "nope", "org/name"], capsys)


def test_debug_shows_the_traceback_and_bugs_keep_theirs(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cli.main(["train", "--config", str(tmp_path / "missing.yaml"), "--debug"])
    monkeypatch.setenv("LONGSPARK_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        cli.main(["train", "--config", str(tmp_path / "missing.yaml")])
    monkeypatch.delenv("LONGSPARK_DEBUG")

    def bug(*args, **kwargs):
        raise TypeError("a bug")

    monkeypatch.setattr("transformers_longspark.model_card.write_model_card", bug)
    with pytest.raises(TypeError, match="a bug"):
        cli.main(["card", str(tmp_path), "--benchmark", str(tmp_path / "bench.json")])


# --- early rejection and import cost ------------------------------------------------------------------------------


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load (or a run that would load one) fails the test: errors must come before."""

    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was rejected")

    monkeypatch.setattr("transformers_longspark.loading.load_target", load)
    monkeypatch.setattr("transformers_longspark.loading.load_drafter", load)
    monkeypatch.setattr("transformers_longspark.training.regenerate.run_regenerate", load)
    monkeypatch.setattr("transformers_longspark.benchmarks.runners.run_memory_benchmark", load)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--drafter", "{missing}"], "Drafter folder {missing} does not exist; pass a folder saved by"),
        (["bench", "speed", "--target", "{missing}"], "Target folder {missing} does not exist; pass a model folder"),
        (["bench", "drafting-cost", "--drafter", "{missing}"], "Drafter folder {missing} does not exist"),
        (["bench", "verify-cost", "--target", "{missing}"], "Target folder {missing} does not exist"),
        (["bench", "memory", "--drafter", "{missing}"], "Drafter folder {missing} does not exist"),
        (["bench", "--held-out", "{missing}"], "Held-out folder {missing} does not exist"),
        (["bench", "--json", "{folder}"], "--json {folder} is a folder; pass a file name."),
        (["regenerate", "--prompts", "gsm8k", "--output", "{folder}/out", "--target", "{missing}"],
         "Target folder {missing} does not exist"),
        (["regenerate", "--prompts", "gsm8k", "--output", "{file}"], "--output {file} is a file; pass a folder."),
    ],
)  # fmt: skip
def test_bad_paths_are_rejected_before_any_model_loads(argv, message, tmp_path, capsys, no_model_loads):
    paths = {"missing": tmp_path / "missing", "folder": tmp_path, "file": tmp_path / "file.txt"}
    paths["file"].write_text("")
    line = cli_error([arg.format(**paths) for arg in argv], capsys)
    assert message.format(**paths) in line


def test_every_option_has_help_text_and_old_flags_still_parse():
    parser = cli.build_parser()

    def options_without_help(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, subparser in action.choices.items():
                    yield from options_without_help(subparser, f"{path} {name}")
            elif not action.help:
                yield f"{path} {'/'.join(action.option_strings) or action.dest}"

    assert list(options_without_help(parser, "longspark")) == []
    args = parser.parse_args(["bench", "--progress"])  # progress bars are the default now; scripts may pass it
    assert args.progress and not args.quiet
    assert parser.parse_args(["bench", "verify-cost", "--quiet"]).quiet


def test_bench_options_before_the_command_are_kept_or_refused(capsys):
    """argparse lets a subcommand's defaults overwrite the options given before it: `bench --num-threads 1 tau` must
    run tau on one thread, and an option the command does not take is an error, not silently dropped."""
    from transformers_longspark import cli

    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--num-threads", "1", "--json", "r.json", "speed", "--modes", "greedy"])
    assert (args.num_threads, str(args.json), args.modes) == (1, "r.json", ["greedy"])
    args = parser.parse_args(["bench", "--num-threads", "1", "tau"])
    assert args.num_threads == 1 and args.max_new_tokens == 64  # tau's own default stays
    assert parser.parse_args(["bench", "--num-threads", "1", "tau", "--num-threads", "2"]).num_threads == 2
    assert parser.parse_args(["bench", "memory"]).num_threads == 1  # memory's own default
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--methods", "plain", "--seed", "3", "tau"])
    assert "--methods is an option of the speed comparison, not of `bench tau`" in capsys.readouterr().err


HELP_IMPORTS = """
import sys
from transformers_longspark import cli
for argv in {argvs!r}:
    try:
        cli.build_parser().parse_args(argv)
    except SystemExit:
        pass
    heavy = sorted(name for name in ("torch", "transformers", "datasets", "accelerate") if name in sys.modules)
    assert not heavy, f"longspark {{' '.join(argv)}} imported {{heavy}}"
"""


def test_help_imports_neither_torch_nor_transformers():
    """`longspark --help` and every subcommand's `--help` parse without importing torch or transformers (they take
    seconds to import), checked in a fresh interpreter."""
    import subprocess
    import sys

    argvs = [["--help"], *([*command, "--help"] for command in (
        ["regenerate"], ["train"], ["card"], ["push"], ["bench"], ["bench", "speed"], ["bench", "drafting-cost"],
        ["bench", "verify-cost"], ["bench", "memory"]))]  # fmt: skip
    result = subprocess.run([sys.executable, "-c", HELP_IMPORTS.format(argvs=argvs)], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "usage: longspark bench memory" in result.stdout


def test_cache_folder_is_set_by_longspark_cache(monkeypatch, tmp_path):
    from transformers_longspark import loading

    monkeypatch.setenv("LONGSPARK_CACHE", str(tmp_path))
    assert loading._cache_dir().parent == tmp_path
    monkeypatch.setenv("LONGSPARK_CACHE", "")
    assert loading._cache_dir().parent == Path.home() / ".cache" / "transformers-longspark"
