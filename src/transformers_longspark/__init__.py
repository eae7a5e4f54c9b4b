"""LongSpark: a fixed-cost block-diffusion speculative drafter for Hugging Face Transformers.

Importing the package registers `LongSparkConfig`/`LongSparkDrafterModel` with `AutoConfig`/`AutoModel` and routes
`target.generate(..., assistant_model=drafter)` to the LongSpark candidate generator (one sequence, see
`generation.py`) or to the batched loop (left-padded batches, see `batched.py`).
"""

from transformers import AutoConfig, AutoModel

from .configuration_longspark import LongSparkConfig, select_target_layers
from .context_state import DraftContext, LongSparkContextState
from .generation import DraftingStats, LongSparkCandidateGenerator, install_generation_hook
from .modeling_longspark import LongSparkDrafterModel

AutoConfig.register(LongSparkConfig.model_type, LongSparkConfig, exist_ok=True)
AutoModel.register(LongSparkConfig, LongSparkDrafterModel, exist_ok=True)
install_generation_hook()

__version__ = "0.1.0"
__all__ = [
    "DraftContext",
    "DraftingStats",
    "LongSparkCandidateGenerator",
    "LongSparkConfig",
    "LongSparkContextState",
    "LongSparkDrafterModel",
    "select_target_layers",
]
