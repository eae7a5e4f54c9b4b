"""All of SmolLM2's linear layers at a few row counts: `F.linear` (the CPU's BLAS) against the packed oneDNN copies
of `packed_linear.py`, the fastest of `--repeats` passes of each, interleaved. Which kernel wins is the CPU's
(`measure_blas_max_rows` measures it from one row up for the fast path; prefills past `MAX_PACKED_ROWS` rows keep
`F.linear`).

    python scripts/linear_kernels.py --num-threads 2 --rows 1 2 4 8 64 512 1024
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from transformers_longspark import packed_linear
from transformers_longspark.benchmarks.common import machine_info
from transformers_longspark.loading import load_smollm2


def _blas(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _packed(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """oneDNN's product over the layer's packed copy, at any row count (the fast path stops at `MAX_PACKED_ROWS`
    unless the calibration's `max_packed_rows` says more)."""
    return packed_linear._packed_product(x, (layer.weight,), layer.bias, layer.weight.dtype, max_rows=x.shape[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 64, 512, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    layers = packed_linear._packable_layers((load_smollm2()[0],))
    generator = torch.Generator().manual_seed(0)
    print(f"{len(layers)} linear layers; {machine_info(torch.device('cpu')).get('cpu')}, {args.num_threads} threads")
    with torch.no_grad():
        for rows in args.rows:
            inputs = {w: torch.randn(rows, w, generator=generator) for w in {layer.in_features for layer in layers}}
            kernels = {"F.linear": _blas, "packed": _packed}
            times = {name: [] for name in kernels}
            for _ in range(args.repeats + 1):  # the first pass packs and warms up
                for name, kernel in kernels.items():
                    start = time.perf_counter()
                    for layer in layers:
                        kernel(inputs[layer.in_features], layer)
                    times[name].append(time.perf_counter() - start)
            best = {name: min(t[1:]) * 1e3 for name, t in times.items()}
            print(f"{rows} rows: F.linear {best['F.linear']:.1f} ms, packed {best['packed']:.1f} ms")


if __name__ == "__main__":
    main()
