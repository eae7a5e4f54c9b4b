"""pytest fixtures and settings; the helpers the test modules share are in `helpers.py`."""

from __future__ import annotations

import pytest
import torch

from helpers import TARGETS  # also installs the generate() hook

# The models here are tiny: one thread is faster than several, and leaves a core to other jobs.
torch.set_num_threads(1)


@pytest.fixture(params=sorted(TARGETS))
def target_kind(request) -> str:
    return request.param
