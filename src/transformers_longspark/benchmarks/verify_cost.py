"""The target's cached verification forward of `k` tokens vs prefix length: stock path vs the fast one.

Stock: transformers' `sdpa` attention and a plain `DynamicCache` (each forward concatenates every layer's cache).
Fast (`longspark`): `verification.fast_verification`'s grouped-head attention and a cache whose layers are
`ReservedDynamicLayer`s (`reserve_cache_rows`), as `generate` with a LongSpark drafter verifies. A LongSpark round
verifies `k <= B + 1` tokens; its cost relative to one stock decoding step (`ratio_to_stock_one_token`) is what
speculation has to beat.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from ..inference.verification import fast_verification, reserve_cache_rows
from ..packed_linear import measure_blas_max_rows
from ..transformers_private import attention_implementation
from .common import machine_info, measure, prefill, timed_call
from .settings import VerifyCostSettings

PATHS = ("stock", "longspark")


def reserved_copy(cache: DynamicCache, config, num_rows: int) -> DynamicCache:
    """A cache whose layers are `ReservedDynamicLayer`s with room for `num_rows` rows, holding `cache`'s rows.

    The same rows and layout as a prefill through reserved layers (each layer's buffer starts with the rows; `keys`
    and `values` are views of it), without running the prefill twice.
    """
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

    For each prefix length `t` of `settings`: seeded random ids are prefilled once (stock, `prefill_chunk` tokens
    per forward) into a `DynamicCache`, whose rows are copied into a reserved-rows cache for the fast path. Then for
    each `k` in `num_tokens`, `forward(k tokens)` (logits of all `k`, as verification computes them) is timed on
    each path, interleaved per repeat; before each forward, untimed, `cache.crop(-k)` drops the previous forward's
    rows, as assisted decoding does after a rejection. Times are medians of `repeats` forwards after `warmup`
    untimed ones. Positions past `max_position_embeddings` are used as they come.

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
            "*_ms[i][j]: median ms of one cached target forward of num_tokens[j] tokens (logits of all of them) "
            "after prefix_lengths[i] rows. stock: the target's attention + DynamicCache (concatenating); longspark: "
            "fast_verification's grouped-head attention + ReservedDynamicLayer rows, its linear layers packed above "
            "blas_max_rows rows (this machine's measure_blas_max_rows). The cache.crop(-k) that "
            "restores the prefix runs untimed before each forward; the two paths alternate within each repeat."
        ),
        machine=machine_info(device),
    )
    return result


__all__ = ["reserved_copy", "run_verify_cost"]
