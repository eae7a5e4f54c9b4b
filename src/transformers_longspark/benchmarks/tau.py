"""Held-out greedy tau and per-position acceptance of several drafters on the same prompts (`longspark bench tau`).

Every drafter decodes every prompt greedily with `target.generate(assistant_model=drafter)`; greedy decoding is
lossless, so all of them must produce the same tokens, which is checked and reported (`greedy_identical`). Per
workload and drafter: tau (`inference.stats.tau`, summed over the prompts) and the per-position acceptance
`[P(draft 1 accepted), P(drafts 1-2 accepted), ...]` from `drafter.drafting_stats`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from ..inference.stats import DraftingStats, tau
from .common import machine_info

FRESH_DRAFTERS = ("warm-start", "random")


def fresh_drafter(kind: str, target, seed: int = 0):
    """An untrained drafter of the shipped drafter's architecture (selected layers, Markov rank, generation config):
    `warm-start` initialised from the target's layers (`training.warm_start`), or `random`."""
    from ..configuration_longspark import LongSparkConfig
    from ..loading import SHIPPED_DRAFTER_DIR
    from ..modeling_longspark import LongSparkDrafterModel
    from ..training.warm_start import init_from_target, warm_start_config

    shipped = LongSparkConfig.from_pretrained(SHIPPED_DRAFTER_DIR)
    fields = dict(target_layer_ids=shipped.target_layer_ids, markov_rank=shipped.markov_rank)
    torch.manual_seed(seed)
    if kind == "warm-start":
        drafter = init_from_target(LongSparkDrafterModel(warm_start_config(target, **fields)), target)
    elif kind == "random":
        drafter = LongSparkDrafterModel(LongSparkConfig.from_target_config(target.config, **fields))
    else:
        raise ValueError(f"Unknown fresh drafter {kind!r}; expected one of {', '.join(FRESH_DRAFTERS)}.")
    drafter.generation_config = LongSparkDrafterModel.from_pretrained(SHIPPED_DRAFTER_DIR).generation_config
    parameter = next(target.parameters())
    return drafter.to(device=parameter.device, dtype=parameter.dtype).eval().requires_grad_(False)


@torch.no_grad()
def run_tau_benchmark(
    target,
    drafters: Mapping[str, Any],
    prompts: Mapping[str, Sequence[Mapping[str, Any]]],
    max_new_tokens: int,
    whole_blocks: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """`{"rows": [{workload, drafter, prompts, new_tokens, rounds, tau, acceptance_rates, accepted_histogram,
    greedy_identical}], ...}` for every workload of `prompts` and every drafter of `drafters` (name -> model).
    `whole_blocks` drafts whole blocks (confidence thresholds 0), as the drafter was trained."""
    device = next(target.parameters()).device
    rows = []
    bar = tqdm(total=sum(len(items) for items in prompts.values()) * len(drafters), disable=not progress)
    for workload, items in prompts.items():
        outputs: dict[str, list[list[int]]] = {}
        workload_rows = []
        for name, drafter in drafters.items():
            if whole_blocks:
                drafter.generation_config.assistant_confidence_threshold = 0.0
                drafter.generation_config.block_confidence_threshold = 0.0
            total, new_tokens, outputs[name] = DraftingStats(), 0, []
            for prompt in items:
                ids = torch.tensor([prompt["input_ids"]], device=device)
                out = target.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    assistant_model=drafter,
                )
                outputs[name].append(out[0, ids.shape[1] :].tolist())
                new_tokens += out.shape[1] - ids.shape[1]
                stats = drafter.drafting_stats
                total.rounds += stats.rounds
                total.record_accepted([k for k, count in enumerate(stats.accepted_histogram) for _ in range(count)])
                bar.update(1)
            workload_rows.append(
                {
                    "workload": workload,
                    "drafter": name,
                    "prompts": len(items),
                    "new_tokens": new_tokens,
                    "rounds": total.rounds,
                    "tau": tau(new_tokens, total.rounds, len(items)) if total.rounds else None,
                    "acceptance_rates": total.acceptance_rates(),
                    "accepted_histogram": total.accepted_histogram,
                }
            )
        reference = next(iter(outputs.values()))
        for row in workload_rows:
            row["greedy_identical"] = outputs[row["drafter"]] == reference
        rows += workload_rows
    bar.close()
    return {
        "benchmark": "tau",
        "rows": rows,
        "prompts": {workload: [p.get("name") for p in items] for workload, items in prompts.items()},
        "settings": {"max_new_tokens": max_new_tokens, "whole_blocks": whole_blocks, "do_sample": False},
        "machine": machine_info(device),
    }


def format_tau(result: Mapping[str, Any]) -> str:
    """Markdown table of `run_tau_benchmark`'s result."""
    lines = [
        "| workload | drafter | prompts | tau | rounds | acceptance (draft 1, 1-2, ...) | greedy identical |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for row in result["rows"]:
        value = "-" if row["tau"] is None else f"{row['tau']:.3f}"
        acceptance = " ".join(f"{rate:.2f}" for rate in row["acceptance_rates"][:8])
        identical = "yes" if row["greedy_identical"] else "NO"
        lines.append(
            f"| {row['workload']} | {row['drafter']} | {row['prompts']} | {value} | {row['rounds']} | {acceptance} | "
            f"{identical} |"
        )
    settings = result.get("settings", {})
    lines += [
        "",
        f"Greedy, {settings.get('max_new_tokens')} new tokens per prompt"
        + (", whole blocks" if settings.get("whole_blocks") else ", each drafter's own generation config")
        + "; tau = (new tokens - prompts) / verification rounds over the prompts.",
    ]
    return "\n".join(lines) + "\n"


__all__ = ["FRESH_DRAFTERS", "format_tau", "fresh_drafter", "run_tau_benchmark"]
