"""The target's cached verification forward of `k` tokens vs prefix length, stock path vs the fast one, and its table
and figure. Stock: transformers' `sdpa` attention and a plain `DynamicCache` (each forward concatenates every layer's
cache). Fast (`longspark`): `fast_verification`'s grouped-head attention and `ReservedDynamicLayer` rows, as `generate`
with a LongSpark drafter verifies. A round verifies `k <= B + 1` tokens; its cost relative to one stock decoding step
(`ratio_to_stock_one_token`) is what speculation has to beat.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from ..inference.verification import fast_verification, reserve_cache_rows
from ..packed_linear import measure_blas_max_rows
from ..transformers_private import attention_implementation
from .common import machine_info, measure, prefill, timed_call
from .report import finish, fmt, format_length, table, two_panels
from .settings import VerifyCostSettings

PATHS = ("stock", "longspark")


def reserved_copy(cache: DynamicCache, config, num_rows: int) -> DynamicCache:
    """A cache of `ReservedDynamicLayer`s with room for `num_rows` rows, holding `cache`'s rows: the layout of a
    prefill through reserved layers (`keys` and `values` views of each layer's buffer), without a second prefill."""
    reserved = DynamicCache(config=config)
    reserve_cache_rows(reserved, num_rows)
    for source, layer in zip(cache.layers, reserved.layers, strict=True):
        layer.update(source.keys, source.values)
    return reserved


def _time_forwards(
    target, caches, ids, length: int, counts, repeats: int, warmup: int, device, progress=None, blas_max_rows: int = 1
):
    """`{path: [median ms per k]}` of the forwards of `ids[:, length : length + k]` on each path's cache (the fast
    path with `F.linear` up to `blas_max_rows` rows, as `generate` runs it after this machine's calibration)."""

    def prepare(path: str) -> None:
        extra = caches[path].get_seq_length() - length
        if extra > 0:
            caches[path].crop(-extra)

    medians: dict[str, list[float]] = {path: [] for path in PATHS}
    for k in counts:
        block = ids[:, length : length + k]
        mask = torch.ones(1, length + k, dtype=torch.long, device=ids.device)

        def forward(path: str, block=block, mask=mask, k=k) -> None:
            target(block, attention_mask=mask, cache=caches[path], use_cache=True, logits_to_keep=k)

        def fast_forward(forward=forward) -> None:
            with fast_verification(target, blas_max_rows=blas_max_rows):
                forward("longspark")

        calls = {"stock": lambda forward=forward: forward("stock"), "longspark": fast_forward}
        label = None if progress is None else f"{progress}, k={k}"
        timings = measure(calls, repeats, warmup, device=device, prepare=prepare, progress=label)
        for path in PATHS:
            medians[path].append(timings[path].median_ms())
    return medians


def run_verify_cost(target: PreTrainedModel, settings: VerifyCostSettings | None = None) -> dict[str, Any]:
    """Milliseconds of one cached target forward of `k` tokens after `t` cached rows, stock vs fast path.

    For each prefix length `t` of `settings`, seeded random ids are prefilled once (stock, `prefill_chunk` tokens per
    forward) and the rows copied into a reserved-rows cache for the fast path. For each `k` of `num_tokens`, the
    forward of `k` tokens (logits of all `k`, as verification computes them) is timed on each path, interleaved per
    repeat, after an untimed `cache.crop(-k)` of the previous one's rows (as assisted decoding does after a rejection):
    medians of `repeats` forwards after `warmup`. Positions past `max_position_embeddings` are used as they come.

    Returns:
        `prefix_lengths`, `num_tokens`, `stock_ms` and `longspark_ms` (`[prefix][k]` median ms),
        `ratio_to_stock_one_token` (`longspark_ms[i][j] / stock_ms[i][k=1]`, `None` without `k = 1` among
        `num_tokens`), `stock_ratio_to_stock_one_token`, `prefill_ms` (stock prefill per prefix) and metadata.
    """
    settings = settings or VerifyCostSettings()
    repeats, warmup, progress = settings.repeats, settings.warmup, settings.progress
    lengths, counts = sorted(set(settings.prefix_lengths)), sorted(set(settings.num_tokens))
    config = target.config.get_text_config()
    attention = attention_implementation(target.config)
    if attention != "sdpa":
        warnings.warn(
            f"The target uses {attention!r} attention, which fast_verification keeps: only the reserved "
            "cache rows differ between the two paths.",
            stacklevel=2,
        )
    device = next(target.parameters()).device
    generator = torch.Generator().manual_seed(settings.seed)
    blas_max_rows = measure_blas_max_rows(target) if device.type == "cpu" else 1
    result: dict[str, Any] = dict(prefix_lengths=lengths, num_tokens=counts, stock_ms=[], longspark_ms=[],
                                  prefill_ms=[], blas_max_rows=blas_max_rows)  # fmt: skip
    with torch.no_grad():
        for length in tqdm(lengths, desc="verify-cost", unit="prefix", disable=not progress):
            ids = torch.randint(0, config.vocab_size, (1, length + max(counts)), generator=generator).to(device)
            seconds, stock = timed_call(prefill, target, ids[:, :length], settings.prefill_chunk, device=device)
            result["prefill_ms"].append(1000.0 * seconds)
            caches = {"stock": stock, "longspark": reserved_copy(stock, target.config, length + max(counts))}
            del stock
            label = f"{length} tokens" if progress else None
            medians = _time_forwards(target, caches, ids, length, counts, repeats, warmup, device, label, blas_max_rows)
            for path in PATHS:
                result[f"{path}_ms"].append(medians[path])
            del caches
    one = counts.index(1) if 1 in counts else None
    for path, field in (("longspark", "ratio_to_stock_one_token"), ("stock", "stock_ratio_to_stock_one_token")):
        result[field] = [
            [None if one is None else ms / base[one] for ms in row]
            for row, base in zip(result[f"{path}_ms"], result["stock_ms"], strict=True)
        ]
    result.update(
        benchmark="verify-cost",
        repeats=repeats,
        warmup=warmup,
        prefill_chunk=settings.prefill_chunk,
        attn_implementation=attention,
        max_position_embeddings=config.max_position_embeddings,
        dtype=str(next(target.parameters()).dtype),
        target=getattr(target.config, "_name_or_path", "") or type(target).__name__,
        notes=(
            "*_ms[i][j]: median ms of one cached target forward of num_tokens[j] tokens after prefix_lengths[i] rows. "
            "longspark: the fast path, its linear layers packed above blas_max_rows rows (measure_blas_max_rows)."
        ),
        machine=machine_info(device),
    )
    return result


def format_verify_cost(result: Mapping[str, Any]) -> str:
    """The verify-cost report as a Markdown table: one row per prefix, and per token count `k` the stock ms, the
    fast ms and the fast forward's ratio to one stock decoding step."""
    counts = result["num_tokens"]
    header = ["prefix", *(f"k={k} {column}" for k in counts for column in ("stock ms", "fast ms", "fast/stock-1"))]
    rows = []
    for i, length in enumerate(result["prefix_lengths"]):
        rows.append([format_length(length)])
        for j in range(len(counts)):
            ratio = result["ratio_to_stock_one_token"][i][j]
            rows[-1] += [f"{result['stock_ms'][i][j]:.2f}", f"{result['longspark_ms'][i][j]:.2f}", fmt(ratio, ".2f")]
    note = (
        f"\nMedian of {result['repeats']} forwards after {result['warmup']} untimed ones, stock and fast "
        "interleaved; the crop back to the prefix is not timed. fast/stock-1: fast k-token forward over the "
        "stock 1-token forward (one plain decoding step)."
    )
    return "\n".join([*table(header, rows, "r" * len(header)), note]) + "\n"


def plot_verify_cost(result: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Two panels vs prefix length (log scale), one colour per token count `k`, stock dashed and fast solid:
    (a) ms per cached forward of `k` tokens, (b) the same over the stock 1-token forward. Writes `path`."""
    lengths, counts = result["prefix_lengths"], result["num_tokens"]
    plt, fig, (ms_ax, ratio_ax) = two_panels()
    one = counts.index(1) if 1 in counts else None
    styles = {
        "stock": dict(linestyle="--", marker="s", markerfacecolor="none"),
        "longspark": dict(linestyle="-", marker="o"),
    }
    for j, k in enumerate(counts):
        color = plt.get_cmap("tab10")(j % 10)
        for name, style in styles.items():
            label = f"k={k} {'stock' if name == 'stock' else 'fast'}"
            ms = [row[j] for row in result[f"{name}_ms"]]
            ms_ax.plot(lengths, ms, color=color, label=label, **style)
            if one is not None:
                ratios = [m / row[one] for m, row in zip(ms, result["stock_ms"], strict=True)]
                ratio_ax.plot(lengths, ratios, color=color, label=label, **style)
    for ax in (ms_ax, ratio_ax):
        ax.set_ylim(bottom=0)
    ratio_ax.axhline(1.0, color="0.5", linewidth=0.8)
    ms_ax.legend(fontsize=7, ncol=2)
    labels = [
        ("(a) verification forward of k tokens", "cached target forward (ms)"),
        ("(b) relative to one stock decoding step", "x stock 1-token forward"),
    ]
    return finish(plt, fig, (ms_ax, ratio_ax), lengths, labels, path)
