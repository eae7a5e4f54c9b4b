#!/usr/bin/env python
"""Before and after, interleaved in one process: the verification attention filling its mask over all `T` columns
(the kernel of commit 4994381) against filling only the block's `k x k` corner (now), on SmolLM2 at 512, 4K and 8K
cached rows. Each k-token forward is reported over the one-token step of the same kernel (medians of `--repeats`).

    python scripts/verify_mask_ab.py [--repeats 21] [--prefix-lengths 512 4096 8192]
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

import torch

BEFORE = "4994381"
KERNEL = "src/transformers_longspark/inference/verification.py"


def kernel_before():
    """`grouped_verification_attention` as of `BEFORE`, read from git (the function alone, not its registrations)."""
    source = subprocess.run(["git", "show", f"{BEFORE}:{KERNEL}"], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout  # fmt: skip
    namespace: dict = {}
    function_only = source.split("class _ThreadState")[0]  # the imports and the function
    exec(function_only.replace("from ..packed_linear import packed_linear_weights", ""), namespace)
    return namespace["grouped_verification_attention"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--prefix-lengths", type=int, nargs="+", default=[512, 4096, 8192])
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 2, 4, 8, 11])
    args = parser.parse_args()
    torch.set_num_threads(2)
    from transformers_longspark.benchmarks.common import prefill
    from transformers_longspark.benchmarks.verify_cost import reserved_copy
    from transformers_longspark.inference import verification
    from transformers_longspark.loading import load_smollm2

    kernels = {"before": kernel_before(), "after": verification.grouped_verification_attention}
    target, _ = load_smollm2()
    counts = args.num_tokens
    for length in args.prefix_lengths:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, target.config.vocab_size, (1, length + max(counts)), generator=generator)
        with torch.no_grad():
            cache = reserved_copy(prefill(target, ids[:, :length], 2048), target.config, length + max(counts))
            times = {(k, name): [] for k in counts for name in kernels}
            for repeat in range(args.repeats + 2):  # the first two are warm-up
                for k in counts:
                    for name, kernel in kernels.items():
                        extra = cache.get_seq_length() - length
                        if extra > 0:
                            cache.crop(-extra)
                        verification.grouped_verification_attention = kernel
                        start = time.perf_counter()
                        mask = torch.ones(1, length + k, dtype=torch.long)
                        with verification.fast_verification(target):
                            target(ids[:, length : length + k], attention_mask=mask, cache=cache, use_cache=True,
                                   logits_to_keep=k)  # fmt: skip
                        if repeat >= 2:
                            times[(k, name)].append(time.perf_counter() - start)
        verification.grouped_verification_attention = kernels["after"]
        median = {key: 1000 * sorted(values)[len(values) // 2] for key, values in times.items()}
        rows = ", ".join(f"k={k} {median[(k, 'before')] / median[(1, 'before')]:.2f} -> "
                         f"{median[(k, 'after')] / median[(1, 'after')]:.2f}" for k in counts[1:])  # fmt: skip
        print(
            f"prefix {length}: one-token step {median[(1, 'before')]:.1f} / {median[(1, 'after')]:.1f} ms; "
            f"k tokens over it, before -> after: {rows}",
            flush=True,
        )


if __name__ == "__main__":
    main()
