"""The global summary carries what lies beyond the recent window: needle recall on a tiny trained target.

`tests/fixtures/recall/` holds a small target trained on the needle-recall language (`experiments/needle_recall.py`)
and a full drafter trained for it with a 16-row window (`python scripts/long_range_ablation.py --fixture
tests/fixtures/recall`, ~3 min). The drafter drafts the answer with `target.generate(assistant_model=...)`, the
drafter alone: with the needle beyond its window, only the global summary holds it. The prompts are folded into the
summary in several chunks at prefill and the answer spans two rounds, so the summary's incremental update (its rows,
its normaliser, its chunks) is what these tests read; `scripts/mutation_check.py` breaks each and checks that they
fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from transformers_longspark import LongSparkDrafterModel
from transformers_longspark.experiments.needle_recall import RecallLanguage, recall_acceptance

FIXTURE = Path(__file__).parent / "fixtures" / "recall"
BEYOND_WINDOW = [48, 96, 160]  # filler rows between needle and query; the window holds 16 rows


@pytest.fixture(scope="module")
def task():
    target = AutoModelForCausalLM.from_pretrained(FIXTURE / "target").eval()
    drafter = LongSparkDrafterModel.from_pretrained(FIXTURE / "full").eval()
    drafter.config.summary_chunk_size = 5  # the prefill folds each prompt in 11-37 chunks
    language = RecallLanguage(**json.loads((FIXTURE / "language.json").read_text()))
    return target, drafter, language


def test_the_target_answers_and_the_task_needs_more_than_the_window(task):
    target, drafter, language = task
    assert drafter.config.window_size == 16 and drafter.config.block_size < language.needle_length
    rows = recall_acceptance(target, {"full": drafter}, language, BEYOND_WINDOW, num_prompts=8)
    assert all(row["target_accuracy"] == 1.0 and not row["needle_in_window"] for row in rows)


def test_the_summary_recalls_a_needle_beyond_the_window(task):
    """Tau on the answer with the needle 48-160 rows before the query, beyond the 16-row window: the drafter proposes
    the needle's tokens from the summary (measured 2.35-3.08 of at most 5; without the summary 1.29-1.38)."""
    target, drafter, language = task
    rows = recall_acceptance(target, {"full": drafter}, language, BEYOND_WINDOW, num_prompts=8)
    taus = [row["tau"] for row in rows]
    assert min(taus) >= 2.2, taus


def test_without_the_summary_the_needle_is_lost(task, monkeypatch):
    """The negative control: the same drafter reading no summary falls to chance beyond the window."""
    target, drafter, language = task
    monkeypatch.setattr(drafter.config, "use_global_summary", False)
    rows = recall_acceptance(target, {"no summary": drafter}, language, BEYOND_WINDOW, num_prompts=8)
    assert max(row["tau"] for row in rows) < 1.6
