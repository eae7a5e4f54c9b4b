"""Batched decoding speed: plain batched `generate` vs LongSpark batched `generate`, per batch size
(`longspark bench --batch-sizes 1 2 4 8`, `run_batched_benchmark`). Batch 1 is transformers' own assisted loop; larger
batches run `inference/batched.py`. tokens/s counts each row's new tokens up to its EOS (padding excluded) over the
median time of one batched call.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..inference.stats import tau
from ..modeling_longspark import LongSparkDrafterModel
from .common import eos_token_ids, generate_kwargs, machine_info, measure, pad_token_id
from .report import RANDOM_DRAFTER, fmt, table
from .settings import BatchedSettings

METHODS = ("plain", "longspark")


def left_pad_batch(
    prompts: Sequence[Sequence[int]], batch_size: int, pad_id: int, device: str | torch.device = "cpu"
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`(input_ids, attention_mask)`, both `(batch_size, longest)`: the first `batch_size` prompts (cycled), padded
    on the left."""
    rows = [list(prompts[i % len(prompts)]) for i in range(batch_size)]
    width = max(len(row) for row in rows)
    input_ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, width - len(row) :] = torch.tensor(row)
        attention_mask[index, width - len(row) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def new_token_counts(new_ids: torch.LongTensor, eos_ids: Sequence[int]) -> list[int]:
    """Tokens each row generated: up to and including its first EOS, else all of them (`(batch, new)` ids)."""
    counts = []
    for row in new_ids.tolist():
        ends = [i for i, token in enumerate(row) if token in eos_ids]
        counts.append(ends[0] + 1 if ends else len(row))
    return counts


def _measure_batch(target, drafter, input_ids, attention_mask, kwargs, settings: BatchedSettings, device):
    """Median seconds and outputs of plain and LongSpark batched `generate` on one batch, each call from the seed."""
    outputs: dict[str, torch.LongTensor] = {}

    def run(method: str) -> None:
        extra = {"assistant_model": drafter} if method == "longspark" else {}
        outputs[method] = target.generate(input_ids, attention_mask=attention_mask, **kwargs, **extra)

    calls = {method: functools.partial(run, method) for method in METHODS}
    timings = measure(
        calls, settings.repeats, settings.warmup, device=device, prepare=lambda _: torch.manual_seed(settings.seed)
    )
    return {method: timings[method].median_ms() / 1000.0 for method in METHODS}, outputs


def run_batched_benchmark(
    target: PreTrainedModel,
    drafter: LongSparkDrafterModel,
    prompts: Mapping[str, Sequence[Sequence[int]]],
    settings: BatchedSettings | None = None,
    *,
    drafter_info: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Tokens/s of plain vs LongSpark batched `generate` for each workload of `prompts` (`{workload: [ids, ...]}`),
    mode and batch size of `settings`: a batch of `b` takes the first `b` prompts, cycled, left-padded to
    `(b, longest)`. `drafter_info`: what the report says of the drafter.

    Returns:
        `{"benchmark": "batched", "machine", "settings", "drafter", "rows": [{workload, mode, batch_size,
        prompt_tokens, plain_tokens_per_s, longspark_tokens_per_s, speedup, tau, greedy_identical, ...}]}`.
    """
    settings = settings or BatchedSettings()
    modes, batch_sizes, max_new_tokens = settings.modes, settings.batch_sizes, settings.max_new_tokens
    device, eos = next(target.parameters()).device, eos_token_ids(target)
    pad = pad_token_id(target, 0) if settings.pad_token_id is None else settings.pad_token_id
    rows = []
    total = len(prompts) * len(modes) * len(batch_sizes)
    bar = tqdm(total=total, desc="batched", unit="batch", disable=not settings.progress)
    for workload, items in prompts.items():
        if not items:
            raise ValueError(f"Workload {workload!r} has no prompts.")
        for mode in modes:
            kwargs = generate_kwargs(mode, max_new_tokens, settings, pad)
            for batch_size in batch_sizes:
                bar.set_postfix_str(f"{workload} {mode} batch {batch_size}")
                input_ids, attention_mask = left_pad_batch(items, batch_size, pad, device)
                seconds, outputs = _measure_batch(target, drafter, input_ids, attention_mask, kwargs, settings, device)
                tokens = {m: sum(new_token_counts(outputs[m][:, input_ids.shape[1] :], eos)) for m in METHODS}
                rate = {m: tokens[m] / seconds[m] for m in METHODS}
                stats = drafter.drafting_stats
                identical = torch.equal(outputs["plain"], outputs["longspark"]) if mode == "greedy" else None
                prompt_tokens, width = int(attention_mask.sum(dim=1).max()), input_ids.shape[1]
                row = dict(workload=workload, mode=mode, batch_size=batch_size, prompt_tokens=prompt_tokens,
                           padded_width=width)  # fmt: skip
                for field, values in (("seconds", seconds), ("new_tokens", tokens), ("tokens_per_s", rate)):
                    row.update({f"{m}_{field}": values[m] for m in METHODS})
                row["speedup"] = rate["longspark"] / rate["plain"]
                row["tau"] = tau(tokens["longspark"], stats.rounds, batch_size) if stats.rounds else None
                row.update(batch_rounds=stats.batch_rounds, greedy_identical=identical)
                rows.append(row)
                bar.update(1)
    bar.close()
    names = ("batch_sizes", "max_new_tokens", "modes", "temperature", "ignore_eos", "repeats", "warmup", "seed")
    report_settings = {name: getattr(settings, name) for name in names}
    report_settings.update(batch_sizes=list(batch_sizes), modes=list(modes), pad_token_id=pad)
    report_settings["dtype"] = str(next(target.parameters()).dtype)
    report_settings["confidence_threshold"] = drafter.generation_config.assistant_confidence_threshold
    return {
        "benchmark": "batched",
        "machine": machine_info(device),
        "settings": report_settings,
        "drafter": dict(drafter_info or {"block_size": drafter.config.block_size}),
        "rows": rows,
    }


def format_batched(report: Mapping[str, Any]) -> str:
    """The batched report as a Markdown table, one row per workload, mode and batch size."""
    header = ["workload", "mode", "batch", "prompt tokens", "plain tok/s", "LongSpark tok/s", "speedup", "tau",
              "greedy identical"]  # fmt: skip
    rows = [[row["workload"], row["mode"], str(row["batch_size"]), str(row["prompt_tokens"]),
             f"{row['plain_tokens_per_s']:.1f}", f"{row['longspark_tokens_per_s']:.1f}", f"{row['speedup']:.2f}x",
             fmt(row["tau"], ".2f"), {None: "-", True: "yes", False: "NO"}[row["greedy_identical"]]]
            for row in report["rows"]]  # fmt: skip
    machine, settings = report.get("machine", {}), report.get("settings", {})
    note = (
        f"Machine: {machine.get('cpu')} ({machine.get('torch_threads')} torch threads), {machine.get('device')}. "
        f"max_new_tokens={settings.get('max_new_tokens')}, median of {settings.get('repeats')} call(s) per method. "
        "tok/s: new tokens of all rows (to each row's EOS) per second of one batched `generate`; tau = (new tokens - "
        "batch) / per-row verification rounds."
    )
    random = [RANDOM_DRAFTER] if report.get("drafter", {}).get("trained") is False else []
    return "\n".join([*table(header, rows, "llrrrrrrl"), "", note, *random]) + "\n"
