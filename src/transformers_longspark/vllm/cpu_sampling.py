"""A fix for vLLM 0.32's CPU sampler under speculative decoding with temperature > 0 (vllm-project/vllm#55005).

Before verifying drafts, vLLM's rejection sampler expands each request's temperature, top-k and top-p to its draft
positions (`rejection_sampler.expand_batch_to_tokens`). Without Triton (the CPU wheel), that expansion runs a C++
fallback (`cpu_triton_utils._expand_kernel_impl`) that takes int64 tensors: it writes into an int64 copy of the
output and never copies it back, so the float temperatures (and int32 top-k, float top-p) it returns are
uninitialized memory. The target's logits are divided by them, and the verified distribution is garbage: under
sampling, a request's tokens after the first of each step follow neither the target nor the drafts' proposal law,
and almost no draft is accepted, whatever proposes them (LongSpark, vLLM's `ngram`). Greedy requests never read
these values, so greedy outputs are unaffected.

`fix_cpu_expand` replaces that expansion with the same one in torch ops, in the process that runs vLLM's sampler
(the proposer calls it from the engine's worker, `run.py` from the driving process). It changes nothing where vLLM
runs its Triton kernel.
"""

from __future__ import annotations

import torch


def expand_batch_to_tokens(
    x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: float = 0, replace_to: float = 0
) -> torch.Tensor:
    """`(num_tokens,)`: each request's value of `x` `(batch,)` repeated over its positions (request `i` owns positions
    `[cu_num_tokens[i - 1], cu_num_tokens[i])`), `replace_from` replaced by `replace_to`: vLLM's `expand_kernel`."""
    ends = cu_num_tokens.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(x, counts.to(x.device), output_size=num_tokens)


def fix_cpu_expand() -> bool:
    """Installs `expand_batch_to_tokens` in vLLM's rejection sampler where vLLM runs without Triton on the CPU
    platform (the broken fallback); returns whether it did."""
    try:
        import vllm.v1.sample.rejection_sampler as rejection_sampler
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return False
    if HAS_TRITON or not current_platform.is_cpu():
        return False
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    return True


__all__ = ["expand_batch_to_tokens", "fix_cpu_expand"]
