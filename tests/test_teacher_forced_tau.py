"""`scripts/teacher_forced_tau.py` counts, from one teacher-forced forward over a greedy answer, the rounds that greedy
speculative decoding with the drafter alone and whole blocks accepts: checked here against `generate` itself."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import torch

from helpers import make_drafter, make_target
from transformers_longspark.benchmarks.settings import DRAFTER_ALONE, WHOLE_BLOCKS
from transformers_longspark.benchmarks.speed import drafter_settings
from transformers_longspark.training.data import Sequence

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "teacher_forced_tau.py"


def _script():
    spec = importlib.util.spec_from_file_location("teacher_forced_tau", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chained_rounds_start_at_the_first_response_token_and_skip_what_each_round_accepts():
    tf = _script()
    sequence = Sequence(torch.arange(10), prompt_length=2)
    accepted = torch.tensor([9, 9, 3, 9, 9, 9, 1, 9, 0, 9])  # only anchors 2, 6 and 8 are reached
    assert tf.chained_rounds(sequence, accepted) == [3, 1, 0]
    accepted[6] = 2  # the last token is the verification's own: a round at anchor 6 keeps at most 10 - 2 - 6 drafts
    assert tf.chained_rounds(sequence, accepted) == [3, 2]


def test_teacher_forced_rounds_are_the_rounds_greedy_decoding_accepts():
    tf = _script()
    target = make_target("llama", vocab_size=6)  # few tokens: a random drafter's argmax often is the target's
    drafter = make_drafter(target, seed=3, window_size=8, block_size=4)
    with torch.no_grad():  # a Markov correction that is not zero, so that the predecessors it reads matter
        drafter.markov_proj.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
    drafter.linear_dtype = torch.float32  # the script scores in the training forward's fp32
    prompt = torch.randint(0, 6, (1, 12), generator=torch.Generator().manual_seed(1))
    with drafter_settings(drafter, {**DRAFTER_ALONE, **WHOLE_BLOCKS}):
        out = target.generate(prompt, assistant_model=drafter, max_new_tokens=80, do_sample=False)
    stats = drafter.drafting_stats
    sequence = Sequence(out[0], prompt_length=prompt.shape[1])
    rounds = tf.chained_rounds(sequence, tf.accepted_lengths(target, drafter, sequence))
    assert sum(rounds) >= 5, "the check needs rounds that accept drafts"
    # The histogram counts the rounds that proposed; the last round, with room for its verification's token only,
    # proposes nothing (a plain step), and both count it as a round.
    assert len(rounds) == stats.rounds
    accepting = Counter({count: rounds for count, rounds in enumerate(stats.accepted_histogram) if rounds and count})
    assert Counter(r for r in rounds if r) == accepting
