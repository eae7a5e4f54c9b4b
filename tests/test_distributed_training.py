"""`longspark train` under `accelerate launch --num_processes 2` (DDP over gloo, on CPU) is the same training as one
process with the same global batch: each rank reads its own shard, the anchors depend on a sequence's place in the
global batch, not on the process that holds it, and a 2-process run resumes from its checkpoint exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers import make_target, tiny_config
from transformers_longspark.training.corpora import DataMixture, data_sources

STEPS = 4


def write_config(tmp_path: Path, name: str, target: Path, sequences_per_step: int) -> Path:
    config = tiny_config(
        tmp_path, output_dir=str(tmp_path / name), target=str(target), max_steps=STEPS, sequences_per_step=
        sequences_per_step, gradient_accumulation_steps=2, num_threads=1, train_data=str(tmp_path / "data"),
    )  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(asdict(config)))
    return path


def train(config: Path, processes: int, resume: bool = False) -> None:
    launcher = [sys.executable, "-m", "transformers_longspark.cli"]
    if processes > 1:
        # accelerate's CPU processes on one machine: torchrun's launcher (`--multi_gpu`) with ACCELERATE_USE_CPU.
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                    str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m",
                    "transformers_longspark.cli"]  # fmt: skip
    command = [*launcher, "train", "--config", str(config), *(["--resume"] if resume else [])]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def logged(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process with 2 sequences per micro-batch, and two processes with 1 each (the same global batch)."""
    tmp = tmp_path_factory.mktemp("distributed")
    tiny_config(tmp)  # writes the training records into tmp / "data"
    make_target("llama").save_pretrained(tmp / "target")
    train(write_config(tmp, "one", tmp / "target", sequences_per_step=2), processes=1)
    two = write_config(tmp, "two", tmp / "target", sequences_per_step=1)
    train(two, processes=2)
    return tmp, two


def test_each_rank_reads_its_own_shard_of_the_global_batch(tmp_path):
    tiny_config(tmp_path)
    mixture = DataMixture(data_sources(str(tmp_path / "data")), None, 64)
    one = mixture.micro_batches(2, seed=3)
    ranks = [mixture.micro_batches(1, seed=3, process=p, num_processes=2) for p in (0, 1)]
    for _ in range(3):
        together = [s.ids.tolist() for s in next(one)]
        apart = [next(rank)[0].ids.tolist() for rank in ranks]
        assert apart == together  # rank p holds the global batch's p-th sequence, and no rank another's


def test_two_processes_train_as_one_with_the_same_global_batch(runs):
    tmp, _ = runs
    one, two = logged(tmp / "one"), logged(tmp / "two")
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one]
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
    reference, distributed = weights(tmp / "one"), weights(tmp / "two")
    assert reference.keys() == distributed.keys()
    for name in reference:
        torch.testing.assert_close(distributed[name], reference[name], rtol=1e-4, atol=1e-5, msg=name)


def test_a_two_process_run_resumes_from_its_checkpoint(runs):
    """Both ranks restart from step 2's checkpoint (weights, optimizer, scheduler, data position, anchors) and end
    where the uninterrupted run ended."""
    tmp, config = runs
    uninterrupted = weights(tmp / "two")
    run = tmp / "two"
    shutil.copytree(run, tmp / "two-uninterrupted")
    shutil.rmtree(run / "final")
    for checkpoint in run.glob("checkpoint-*"):
        if checkpoint.name != "checkpoint-000002":
            shutil.rmtree(checkpoint)
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged(tmp / "two-uninterrupted")[:2]))
    train(config, processes=2, resume=True)
    assert [r["step"] for r in logged(run)] == list(range(1, STEPS + 1))
    resumed = weights(run)
    for name in uninterrupted:
        torch.testing.assert_close(resumed[name], uninterrupted[name], rtol=0, atol=0, msg=name)
