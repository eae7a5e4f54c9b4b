"""`longspark regenerate --engine vllm`: the same records as the transformers engine (greedy, float32, SmolLM2), and
sampled responses that depend on each record's seed, never on the batch. vLLM runs in its own environment
(`scripts/install_vllm.sh`); without it these tests are skipped with the reason."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helpers import VLLM_PYTHON, requires_vllm
from transformers_longspark.loading import load_target
from transformers_longspark.training.regenerate import regenerate
from transformers_longspark.training.response_engines import TransformersEngine

QUESTIONS = [
    "What is 17 times 23?",
    "Write a haiku about the sea.",
    "Explain recursion in one paragraph.",
    "Write a Python function that reverses a list.",
    "What is the capital of France?",
    "How do I sort a dict by value in Python?",
]
MAX_NEW_TOKENS = 40

pytestmark = requires_vllm


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "questions.jsonl"
    path.write_text("".join(json.dumps({"prompt": q, "source": "toy"}) + "\n" for q in QUESTIONS))
    return path


def vllm_regenerate(prompt_file: Path, output: Path, *options: str) -> dict[int, dict]:
    command = [str(VLLM_PYTHON), "-m", "transformers_longspark.cli", "regenerate", "--engine", "vllm",
               "--prompts", str(prompt_file), "--output", str(output), "--max-new-tokens", str(MAX_NEW_TOKENS),
               *options]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((output / "regenerate_config.json").read_text())["engine"] == "vllm"
    return records(output)


def records(output: Path) -> dict[int, dict]:
    shards = sorted(output.glob("part-*.jsonl"))
    return {record["id"]: record for shard in shards for record in map(json.loads, shard.read_text().splitlines())}


def test_greedy_records_equal_the_transformers_engine(prompt_file, tmp_path):
    from_vllm = vllm_regenerate(prompt_file, tmp_path / "vllm", "--temperature", "0", "--batch-size", "4")
    model, tokenizer = load_target()
    engine = TransformersEngine(model, tokenizer)
    settings = dict(temperature=0, max_new_tokens=MAX_NEW_TOKENS, batch_size=6, progress=False)
    from_transformers = records(regenerate(prompt_file, tmp_path / "transformers", engine, tokenizer, **settings))
    assert sorted(from_vllm) == list(range(len(QUESTIONS)))
    ended = sum(record["response_ids"][-1] in engine.eos_ids for record in from_vllm.values())
    assert 0 < ended < len(QUESTIONS)  # responses that end with EOS (kept) and responses cut at the length limit
    for record_id, record in from_vllm.items():
        assert record == from_transformers[record_id]


def test_sampled_responses_follow_the_record_seeds_not_the_batches(prompt_file, tmp_path):
    options = ("--samples-per-prompt", "2", "--seed", "5")
    in_batches_of_5 = vllm_regenerate(prompt_file, tmp_path / "b5", "--batch-size", "5", *options)
    in_batches_of_12 = vllm_regenerate(prompt_file, tmp_path / "b12", "--batch-size", "12", *options)
    assert sorted(in_batches_of_12) == list(range(2 * len(QUESTIONS)))
    assert in_batches_of_5 == in_batches_of_12
    # The second sample of each prompt is a record of its own, with its own seed.
    first, second = (
        [in_batches_of_12[i + offset]["response_ids"] for i in range(len(QUESTIONS))] for offset in (0, len(QUESTIONS))
    )
    assert [in_batches_of_12[i + len(QUESTIONS)]["messages"][0] for i in range(len(QUESTIONS))] == [
        in_batches_of_12[i]["messages"][0] for i in range(len(QUESTIONS))
    ]
    assert sum(a != b for a, b in zip(first, second)) >= len(QUESTIONS) - 1
