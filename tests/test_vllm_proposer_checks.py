"""`LongSparkProposer` against a fake vLLM model runner (`vllm_fakes.py`), without vLLM: what it checks.

Steps whose rows it cannot place (a boundary row outside its request's slice of the step, several KV-cache groups),
targets it cannot serve (split over workers, sliding-window layers, compiled), proposals longer than vLLM verifies
and a caller that is no model runner are refused by name; each proposer binds to the runner that owns it; the EOS ids
come from the generation config and the model config.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers import make_drafter, make_target
from transformers_longspark.vllm import DRAFTER_ENV, LongSparkProposer
from transformers_longspark.vllm.proposer import eos_token_ids, step_row
from vllm_fakes import FakeRunner, Scheduled, fake_vllm_config, make_served, write_step


@pytest.fixture
def served(tmp_path, monkeypatch):
    return make_served(tmp_path, monkeypatch)


def test_boundary_row_outside_the_request_slice_is_refused(served):
    a, b = served.requests["a"], served.requests["b"]
    scheduled = [Scheduled(b, 16, 21, 37), Scheduled(a, 20, 5, 23)]
    arguments, _ = write_step(served.proposer, served.runner, served.target, served.drafter, scheduled)
    served.runner.input_batch.num_computed_tokens_cpu[1] = 25  # a's boundary 22 would be row 21 + 22 - 25 = 18: b's
    with pytest.raises(RuntimeError, match=r"position 22 of request 'req-a' is row 18 .* rows \[21, 26\)"):
        served.proposer.propose(*arguments)


def test_step_row():
    assert step_row("r", 22, 20, 21, 26) == 23
    for position in (19, 25):  # before the step, and past the rows it ran
        with pytest.raises(RuntimeError, match="request 'r'"):
            step_row("r", position, 20, 21, 26)


def test_several_kv_cache_groups_are_refused(served):
    a = served.requests["a"]
    arguments, _ = write_step(served.proposer, served.runner, served.target, served.drafter, [Scheduled(a, 20, 5, 23)])
    groups = served.runner.input_batch.block_table.block_tables
    groups.append(groups[0])  # e.g. a hybrid model's sliding-window layers
    with pytest.raises(RuntimeError, match=r"reads one KV-cache group .* has 2 KV-cache groups"):
        served.proposer.propose(*arguments)


class WrappingRunner(FakeRunner):
    """A runner whose `load_model` reaches the proposer's through a helper function (a frame without `self`)."""

    def load_model(self) -> None:
        load_drafter(self.drafter, self.model)


def load_drafter(proposer: LongSparkProposer, model: torch.nn.Module) -> None:
    proposer.load_model(model)


def test_runner_is_the_caller_that_owns_the_proposer(served):
    """Two engines in one process: each proposer binds to its own runner (also through a helper frame); a caller
    that is no runner is refused."""
    other = LongSparkProposer(fake_vllm_config(served.target.config))
    other_runner = WrappingRunner(other, served.target)
    other_runner.load_model()
    assert other.runner is other_runner and served.proposer.runner is served.runner
    stray = LongSparkProposer(fake_vllm_config(served.target.config))
    with pytest.raises(RuntimeError, match="could not find vLLM's model runner"):
        stray.load_model(served.target)  # not called by a runner (the served runner's drafter is another proposer)
    with pytest.raises(RuntimeError, match="before load_model"):
        stray.propose([], None, None)


@pytest.fixture
def saved_drafter(tmp_path, monkeypatch):
    target = make_target("qwen3")
    make_drafter(target).save_pretrained(tmp_path)
    monkeypatch.setenv(DRAFTER_ENV, str(tmp_path))
    return target


@pytest.mark.parametrize(("options", "setting"), [
    (dict(tensor_parallel=2), "tensor_parallel_size=2"),
    (dict(pipeline_parallel=4), "pipeline_parallel_size=4"),
    (dict(tensor_parallel=2, pipeline_parallel=2), "tensor_parallel_size=2, pipeline_parallel_size=2"),
])  # fmt: skip
def test_parallel_targets_are_refused(saved_drafter, options, setting):
    with pytest.raises(ValueError, match=rf"splits it \({setting}\).*data_parallel_size"):
        LongSparkProposer(fake_vllm_config(saved_drafter.config, **options))


@pytest.mark.parametrize(("layer_types", "message"), [
    (["full_attention", "full_attention", "sliding_attention", "sliding_attention"], r"\[2, 3\] of them"),
    (["full_attention", "sliding_attention", "full_attention", "full_attention"], "none of them"),
])  # fmt: skip
def test_sliding_window_targets_are_refused(saved_drafter, layer_types, message):
    """The drafter reads layers [0, 2, 3]; a sliding layer anywhere is refused (its own KV-cache group)."""
    sliding = make_target("qwen3", sliding_window=16, use_sliding_window=True, layer_types=layer_types).config
    pattern = rf"sliding-window targets: layers .* last 16 tokens only \(the drafter reads {message}\)"
    with pytest.raises(ValueError, match=pattern):
        LongSparkProposer(fake_vllm_config(sliding))


def test_compiled_targets_are_refused(saved_drafter):
    with pytest.raises(ValueError, match="enforce_eager=True"):
        LongSparkProposer(fake_vllm_config(saved_drafter.config, mode=3))  # CompilationMode.VLLM_COMPILE


def test_eos_ids_come_from_the_generation_config_and_the_model_config(saved_drafter):
    def model_config(generation_eos, config_eos):
        hf_config = SimpleNamespace(eos_token_id=config_eos)
        return SimpleNamespace(hf_config=hf_config, try_get_generation_config=lambda: {"eos_token_id": generation_eos})

    assert eos_token_ids(model_config([7, 5], 2)).tolist() == [2, 5, 7]
    assert eos_token_ids(model_config(9, None)).tolist() == [9]
    assert eos_token_ids(model_config(None, [3, 4])).tolist() == [3, 4]
    assert eos_token_ids(model_config(None, None)) is None
    proposer = LongSparkProposer(fake_vllm_config(saved_drafter.config, generation_config={"eos_token_id": [11, 12]}))
    assert proposer.settings.eos_token_ids.tolist() == [11, 12]  # the target's config names none (make_target)


def test_lookup_continuations_may_be_longer_than_drafted_blocks(tmp_path, monkeypatch):
    """vLLM verifies up to `num_speculative_tokens` per step: with lookup on, up to the longer of the block size (4)
    and `lookup_num_tokens` (6); more is refused, naming the limit."""
    target = make_target("qwen3")
    drafter = make_drafter(target)
    drafter.generation_config.lookup_min_match, drafter.generation_config.lookup_num_tokens = 2, 6
    drafter.save_pretrained(tmp_path)
    monkeypatch.setenv(DRAFTER_ENV, str(tmp_path))
    assert LongSparkProposer(fake_vllm_config(target.config, num_speculative=6)).num_tokens == 6
    with pytest.raises(ValueError, match=r"num_speculative_tokens=7, .* proposes at most 6 tokens \(blocks of 4"):
        LongSparkProposer(fake_vllm_config(target.config, num_speculative=7))
