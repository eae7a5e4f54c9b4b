#!/usr/bin/env python
"""The target's fast-path forwards with the projections that read one input run as one packed product each (query,
key and value; gate and up: `packed_linear.fused_linears`) against one product per projection, interleaved in one
process, at a few row counts and prefixes; also checks that both give the same logits, bit for bit.

    python scripts/fused_projections_ab.py --num-threads 2 --json results/fused_projections_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from transformers_longspark.benchmarks.common import machine_info
from transformers_longspark.inference import lean_layers
from transformers_longspark.inference.verification import fast_verification
from transformers_longspark.loading import load_target


def separate_products(input: torch.Tensor, layers: tuple[torch.nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    """The lean layers' projections before fusion: each layer's own (routed) forward."""
    return tuple(layer.forward(input) for layer in layers)


VARIANTS = {"separate": separate_products, "fused": lean_layers.fused_linears}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-lengths", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--num-threads", type=int)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    target, _ = load_target()
    generator = torch.Generator().manual_seed(0)
    report = {"benchmark": "fused_projections_ab", "machine": machine_info(), "repeats": args.repeats, "rows": []}
    for prefix in args.prefix_lengths:
        ids = torch.randint(1000, 20000, (1, prefix + max(args.rows)), generator=generator)
        cache = DynamicCache(config=target.config)
        times = {(name, k): [] for name in VARIANTS for k in args.rows}
        identical = True
        with torch.no_grad(), fast_verification(target, cache, prefix + max(args.rows)):
            target(ids[:, :prefix], cache=cache, use_cache=True, logits_to_keep=1)
            for repeat in range(args.repeats + 1):  # the first pass is a warm-up
                for k in args.rows:
                    mask = torch.ones(1, prefix + k, dtype=torch.long)
                    logits = {}
                    for name, products in VARIANTS.items():
                        lean_layers.fused_linears = products
                        start = time.perf_counter()
                        logits[name] = target(ids[:, prefix : prefix + k], attention_mask=mask, cache=cache).logits
                        if repeat:
                            times[(name, k)].append(1e3 * (time.perf_counter() - start))
                        cache.crop(-k)
                    identical &= torch.equal(logits["separate"], logits["fused"])
        lean_layers.fused_linears = VARIANTS["fused"]
        for k in args.rows:
            separate, fused = (statistics.median(times[(name, k)]) for name in VARIANTS)
            row = {"prefix": prefix, "k": k, "separate_ms": separate, "fused_ms": fused, "identical": identical}
            report["rows"].append(row)
            print(f"prefix {prefix:>5}, {k} rows: separate {separate:6.1f} ms, fused {fused:6.1f} ms "
                  f"({fused / separate:.2f}x), logits identical: {identical}")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
