"""Distilling a LongSpark drafter from its target: the data (`data.py`: regenerated chats, `corpora.py`: packed
text, `prompt_sources.py`: prompt sets, `regenerate.py`: the target's own responses), one training example and its loss
(`distillation.py`), the warm start (`warm_start.py`) and the run (`run.py`: config, optimiser, checkpoints).

    from transformers_longspark.training import TrainingConfig, train

    final_dir = train(TrainingConfig.from_file("configs/smollm2-135m-cpu-corpora.yaml"))

The names load on first use, so that importing this package does not import torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .run import Trainer, TrainingConfig, train

# Public name -> the submodule that defines it.
_LAZY_NAMES = {"Trainer": "run", "TrainingConfig": "run", "train": "run"}


def __getattr__(name: str) -> Any:
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_NAMES})


__all__ = ["Trainer", "TrainingConfig", "train"]
