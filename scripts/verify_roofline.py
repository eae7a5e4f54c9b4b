"""How far the fast path's verification forwards are from this machine's floor: a `longspark bench verify-cost` run's
fast-path times against the time the forward's arithmetic and memory traffic need at this CPU's measured peaks.

For a Llama-like target at a prefix of `t` cached rows, a forward of `k` tokens does
- linear layers: `2 k P` flops over `4 P` bytes of fp32 weights (`P`: every `nn.Linear` weight, the LM head
  included, since verification needs the logits of all `k` tokens);
- attention: `4 k H (t + k) d` flops per layer (`q k^T` and `p v`, `H` query heads of width `d`) over the layer's
  cached keys and values, `8 H_kv (t + k) d` bytes.
Each part's floor is `max(flops / peak flops, bytes / peak bandwidth)`; the peaks are measured here, with the same
threads: a large fp32 `mm` (flops) and a matrix-vector product over 512 MiB (bandwidth, as a one-row step streams
weights). Beside the floors, one profiled forward per `k` (`torch.profiler`, operators' own CPU time) says where the
time goes: linear layers (matrix products), attention (its products, softmax and masks, or the fused kernel) and the
rest (norms, RoPE, residuals, cache writes, dispatch), scaled to the report's median. Which part stands above its floor
says what a cheaper verification could still come from.

    longspark bench verify-cost --num-threads 2 --prefix-lengths 4096 --num-tokens 1 2 4 8 --repeats 7 --json VC.json
    python scripts/verify_roofline.py --verify-cost VC.json --num-threads 2 --json results/verify_roofline.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from transformers_longspark.benchmarks.common import machine_info, prefill
from transformers_longspark.benchmarks.verify_cost import reserved_copy
from transformers_longspark.inference.verification import fast_verification
from transformers_longspark.loading import load_smollm2

# Operators by part (their own CPU time); everything else is the rest.
LINEAR_OPS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "aten::linear")
ATTENTION_OPS = ("aten::bmm", "aten::_softmax", "aten::masked_fill_",
                 "aten::_scaled_dot_product_flash_attention_for_cpu")  # fmt: skip


def _best_seconds(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def machine_peaks(repeats: int = 5) -> dict[str, float]:
    """Measured fp32 GFLOP/s (a 2048-square `mm`) and GB/s (an fp32 matrix-vector product over 512 MiB)."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(2048, 2048, generator=generator), torch.randn(2048, 2048, generator=generator)
    gflops = 2 * 2048**3 / _best_seconds(lambda: torch.mm(a, b), repeats) / 1e9
    matrix, vector = torch.randn(16384, 8192, generator=generator), torch.randn(8192, generator=generator)
    gbytes = matrix.numel() * 4 / _best_seconds(lambda: torch.mv(matrix, vector), repeats) / 1e9
    return {"gflops": gflops, "gbytes_per_s": gbytes}


@torch.no_grad()
def profile_parts(target, prefix: int, counts: list[int], blas_max_rows: int, repeats: int = 3) -> dict[int, dict]:
    """`{k: {"linear", "attention", "rest": share of the forward's operator time}}`, from `repeats` profiled fast-path
    forwards of `k` tokens after `prefix` cached rows of seeded random ids (as `bench verify-cost` runs them)."""
    vocab = target.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, prefix + max(counts)), generator=torch.Generator().manual_seed(0))
    cache = reserved_copy(prefill(target, ids[:, :prefix]), target.config, prefix + max(counts))

    def forward(k: int) -> None:
        with fast_verification(target, blas_max_rows=blas_max_rows):
            mask = torch.ones(1, prefix + k, dtype=torch.long)
            target(ids[:, prefix : prefix + k], attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=k)
        cache.crop(-k)

    shares = {}
    for k in counts:
        forward(k)
        with torch.profiler.profile() as profile:
            for _ in range(repeats):
                forward(k)
        times = {event.key: event.self_cpu_time_total for event in profile.key_averages()}
        total = sum(times.values())
        linear = sum(times.get(op, 0) for op in LINEAR_OPS)
        attention = sum(times.get(op, 0) for op in ATTENTION_OPS)
        shares[k] = {"linear": linear / total, "attention": attention / total, "rest": 1 - (linear + attention) / total}
    return shares


def forward_floor(config, linear_params: int, prefix: int, k: int, peaks: dict[str, float]) -> dict[str, float]:
    """Milliseconds each part of a `k`-token forward after `prefix` cached rows needs at `peaks`, and its work."""
    layers, heads, kv_heads = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    keys = prefix + k
    work = {
        "linear": (2 * k * linear_params, 4 * linear_params),
        "attention": (layers * 4 * k * heads * keys * head_dim, layers * 8 * kv_heads * keys * head_dim),
    }
    floor = {}
    for part, (flops, bytes_) in work.items():
        compute_ms = 1e3 * flops / (peaks["gflops"] * 1e9)
        memory_ms = 1e3 * bytes_ / (peaks["gbytes_per_s"] * 1e9)
        floor[part] = {
            "gflop": flops / 1e9, "mbytes": bytes_ / 1e6, "compute_ms": compute_ms, "memory_ms": memory_ms,
            "floor_ms": max(compute_ms, memory_ms), "bound": "compute" if compute_ms > memory_ms else "memory",
        }  # fmt: skip
    return floor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verify-cost", required=True, help="a `longspark bench verify-cost --json` report")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--json", help="write the table's rows and the peaks here")
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    report = json.loads(Path(args.verify_cost).read_text())
    target = load_smollm2()[0]
    config = target.config.get_text_config()
    linear_params = sum(m.weight.numel() for m in target.modules() if isinstance(m, nn.Linear))
    peaks = machine_peaks()
    rows = []
    for i, prefix in enumerate(report["prefix_lengths"]):
        shares = profile_parts(target, prefix, report["num_tokens"], report.get("blas_max_rows", 1))
        for j, k in enumerate(report["num_tokens"]):
            floor = forward_floor(config, linear_params, prefix, k, peaks)
            measured = report["longspark_ms"][i][j]
            for part, share in shares[k].items():
                floor.setdefault(part, {})["measured_ms"] = share * measured
            floor_ms = floor["linear"]["floor_ms"] + floor["attention"]["floor_ms"]
            rows.append({"prefix": prefix, "k": k, "measured_ms": measured, "floor_ms": floor_ms, **floor})
    print(f"peaks: {peaks['gflops']:.0f} GFLOP/s fp32, {peaks['gbytes_per_s']:.1f} GB/s; {args.num_threads} threads")
    print("| prefix | k | measured ms | linear: ms / floor | attention: ms / floor | rest ms | measured / floor |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        parts = [f"{row[p]['measured_ms']:.1f} / {row[p]['floor_ms']:.1f}" for p in ("linear", "attention")]
        print(f"| {row['prefix']} | {row['k']} | {row['measured_ms']:.1f} | {parts[0]} | {parts[1]} | "
              f"{row['rest']['measured_ms']:.1f} | {row['measured_ms'] / row['floor_ms']:.2f} |")  # fmt: skip
    if args.json:
        out = {"benchmark": "verify_roofline", "verify_cost": args.verify_cost, "peaks": peaks, "rows": rows,
               "linear_params": linear_params, "machine": machine_info(torch.device("cpu"))}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
