"""pytest fixtures and settings; the helpers the test modules share are in `helpers.py`."""

from __future__ import annotations

import pytest
import torch

from helpers import TARGETS  # also installs the generate() hook

# The models here are tiny: one thread is faster than several, and leaves a core to other jobs.
torch.set_num_threads(1)

# The slowest modules first (vLLM's engines, the chi-square tests), so that with `-n 2 --dist loadfile` (the README's
# test command) the other worker takes the many short modules meanwhile instead of waiting for them at the end.
SLOWEST_MODULES = (
    "test_vllm.py",
    "test_regenerate_vllm.py",
    "test_generation.py",
    "test_draft_vocab.py",
    "test_exactness.py",
    "test_calibration.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOWEST_MODULES.index(name) if name in SLOWEST_MODULES else len(SLOWEST_MODULES)

    items.sort(key=rank)  # stable: each module's own order is kept


@pytest.fixture(params=sorted(TARGETS))
def target_kind(request) -> str:
    return request.param
