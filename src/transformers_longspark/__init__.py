"""LongSpark: a fixed-cost block-diffusion speculative drafter for Hugging Face Transformers.

The package imports lazily, so that `longspark --help` starts without torch: its names load on first use. That first
use (`from transformers_longspark import LongSparkDrafterModel`), like `loading.load_drafter` and the trainer, calls
`register()`, which registers `LongSparkConfig`/`LongSparkDrafterModel` with `AutoConfig`/`AutoModel` and routes
`target.generate(..., assistant_model=drafter)` to the LongSpark candidate generator (one sequence, see
`inference/generation.py`) or to the batched loop (left-padded batches, see `inference/batched.py`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .configuration_longspark import LongSparkConfig, select_target_layers
    from .context_state import DraftContext, LongSparkContextState
    from .inference.generation import LongSparkCandidateGenerator
    from .inference.stats import DraftingStats
    from .modeling_longspark import LongSparkDrafterModel

__version__ = "0.1.0"

# Public name -> the submodule that defines it.
_LAZY_NAMES = {
    "DraftContext": "context_state",
    "DraftingStats": "inference.stats",
    "LongSparkCandidateGenerator": "inference.generation",
    "LongSparkConfig": "configuration_longspark",
    "LongSparkContextState": "context_state",
    "LongSparkDrafterModel": "modeling_longspark",
    "select_target_layers": "configuration_longspark",
}
_registered = False


def register() -> None:
    """Registers LongSpark with transformers (idempotent): `AutoConfig`/`AutoModel` learn the `longspark` model type,
    and `generate(assistant_model=<LongSparkDrafterModel>)` is routed to LongSpark.

    It runs on the first use of any name of this package, in `loading.load_drafter` and in the trainer, so a call is
    only needed in a program that imports LongSpark's modules directly (`transformers_longspark.modeling_longspark`) or
    calls `AutoConfig`/`AutoModel.from_pretrained(drafter_dir)` without using any LongSpark name.
    """
    global _registered
    if _registered:
        return
    from transformers import AutoConfig, AutoModel

    from .configuration_longspark import LongSparkConfig
    from .inference.generation import install_generation_hook
    from .modeling_longspark import LongSparkDrafterModel

    AutoConfig.register(LongSparkConfig.model_type, LongSparkConfig, exist_ok=True)
    AutoModel.register(LongSparkConfig, LongSparkDrafterModel, exist_ok=True)
    install_generation_hook()
    _registered = True


def __getattr__(name: str) -> Any:
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    register()
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_NAMES})


__all__ = [
    "DraftContext",
    "DraftingStats",
    "LongSparkCandidateGenerator",
    "LongSparkConfig",
    "LongSparkContextState",
    "LongSparkDrafterModel",
    "register",
    "select_target_layers",
]
