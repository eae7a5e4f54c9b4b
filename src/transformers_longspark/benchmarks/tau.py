"""Held-out greedy tau and per-position acceptance of several drafters on the same prompts (`longspark bench tau`),
and its tables and figure. Greedy decoding is lossless, so every drafter must produce the same tokens
(`greedy_identical`). Besides tau, the tokens per target step once each round is priced by this machine's calibrated
costs say what a user gets: a cheaper drafter that accepts less can win.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..inference.calibration import calibrated
from ..inference.round_costs import RoundCosts
from ..inference.stats import DraftingStats, tau
from .common import machine_info
from .report import finish, fmt, table, two_panels
from .settings import TauSettings
from .speed_summary import merge_histograms

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
    settings: TauSettings | None = None,
) -> dict[str, Any]:
    """`{"rows": [{workload, drafter, prompts, new_tokens, rounds, tau, acceptance_rates, accepted_histogram,
    greedy_identical}], ...}` for every workload of `prompts` (`{workload: [{"input_ids": [...], ...}]}`) and drafter
    of `drafters` (name -> model). `tokens_per_step` prices every round with the drafter's calibrated `costs`:
    `(new tokens - prompts) / sum of (1 + verify_cost(proposed) + drafter_cost(length))` over the rounds (a lookup
    round drafts nothing); with all costs 0 it is tau."""
    settings = settings or TauSettings()
    max_new_tokens = settings.max_new_tokens
    greedy = dict(max_new_tokens=max_new_tokens, do_sample=False)
    device = next(target.parameters()).device
    rows = []
    bar = tqdm(total=sum(len(items) for items in prompts.values()) * len(drafters), disable=not settings.progress)
    for workload, items in prompts.items():
        outputs: dict[str, list[list[int]]] = {}
        workload_rows = []
        for name, drafter in drafters.items():
            costs = calibrated(target, drafter).costs
            for field, value in settings.drafter_fields().items():
                setattr(drafter.generation_config, field, value)
            rounds, new_tokens, cost_steps, histograms, outputs[name] = 0, 0, 0.0, [], []
            for prompt in items:
                ids = torch.tensor([prompt["input_ids"]], device=device)
                out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, **greedy)
                outputs[name].append(out[0, ids.shape[1] :].tolist())
                new_tokens += out.shape[1] - ids.shape[1]
                stats = drafter.drafting_stats
                cost_steps += round_cost_steps(stats, costs, ids.shape[1])
                rounds += stats.rounds
                histograms.append(stats.accepted_histogram)
                bar.update(1)
            histogram = merge_histograms(histograms)
            workload_rows.append(
                {
                    "workload": workload,
                    "drafter": name,
                    "prompts": len(items),
                    "new_tokens": new_tokens,
                    "rounds": rounds,
                    "tau": tau(new_tokens, rounds, len(items)) if rounds else None,
                    "tokens_per_step": (new_tokens - len(items)) / cost_steps if cost_steps else None,
                    "costs": dataclasses.asdict(costs),
                    "acceptance_rates": DraftingStats(accepted_histogram=histogram).acceptance_rates(),
                    "accepted_histogram": histogram,
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
        "settings": {
            "max_new_tokens": max_new_tokens,
            "whole_blocks": settings.whole_blocks,
            "drafter_alone": settings.drafter_alone,
            "do_sample": False,
        },
        "machine": machine_info(device),
    }


def round_cost_steps(stats: DraftingStats, costs: RoundCosts, prompt_length: int) -> float:
    """What the rounds of one `generate` call cost, in plain target steps: each a target step plus its verification's
    extra, and each drafter round its drafter forward at this prefix (`RoundCosts`)."""
    verification = stats.rounds * (1.0 + costs.verify_round_cost) + costs.verify_token_cost * stats.drafted_tokens
    return verification + stats.drafter_rounds * costs.drafter_cost(prompt_length)


def format_tau(result: Mapping[str, Any]) -> str:
    """Markdown table of `run_tau_benchmark`'s result."""
    header = ["workload", "drafter", "prompts", "tau", "tokens per step", "drafter round (steps)", "rounds",
              "acceptance (draft 1, 1-2, ...)", "greedy identical"]  # fmt: skip
    rows = [
        [row["workload"], row["drafter"], str(row["prompts"]), fmt(row["tau"], ".3f"),
         fmt(row.get("tokens_per_step"), ".3f"), fmt(row.get("costs", {}).get("draft_round_cost"), ".3f"),
         str(row["rounds"]), " ".join(f"{rate:.2f}" for rate in row["acceptance_rates"][:8]),
         "yes" if row["greedy_identical"] else "NO"]
        for row in result["rows"]
    ]  # fmt: skip
    settings = result.get("settings", {})
    note = (
        f"Greedy, {settings.get('max_new_tokens')} new tokens per prompt"
        + (", whole blocks" if settings.get("whole_blocks") else ", each drafter's own generation config")
        + (", the drafter alone (lookup off, costs 0)" if settings.get("drafter_alone") else "")
        + "; tau = (new tokens - prompts) / verification rounds over the prompts; tokens per step divides the same "
        "tokens by the rounds' cost in target steps, from this machine's calibration (drafter round, verification)."
    )
    return "\n".join([*table(header, rows, "llrrrrrll"), "", note]) + "\n"


def _curves(result: Mapping[str, Any]) -> tuple[dict[str, dict[int, dict[str, Any]]], list[int]]:
    """drafter -> prefix length -> row, from the `long@<length>` rows of a `--by-length` run, and the lengths."""
    curves: dict[str, dict[int, dict[str, Any]]] = {}
    for row in result["rows"]:
        workload, _, length = row["workload"].partition("@")
        if workload == "long" and length and row["tau"] is not None:
            curves.setdefault(row["drafter"], {})[int(length)] = row
    if not curves:
        raise ValueError("No per-length rows: run `longspark bench tau --by-length`.")
    return curves, sorted({length for rows in curves.values() for length in rows})


def _first_acceptance(row: Mapping[str, Any]) -> float:
    return (row["acceptance_rates"] or [0.0])[0]


def format_tau_curve(result: Mapping[str, Any]) -> str:
    """Markdown table of a `--by-length` run: per drafter, tau and P(draft 1 accepted) at each prefix length."""
    curves, lengths = _curves(result)
    header = ["drafter", *(f"{length:,} tokens" for length in lengths)]
    rows = [[name, *("-" if n not in rows else f"{rows[n]['tau']:.2f} ({_first_acceptance(rows[n]):.2f})"
                     for n in lengths)] for name, rows in curves.items()]  # fmt: skip
    settings, prompts = result.get("settings", {}), next(iter(curves.values()))[lengths[0]]["prompts"]
    alone = ", the drafter alone (lookup off, costs 0)" if settings.get("drafter_alone") else ""
    blocks = ", whole blocks" if settings.get("whole_blocks") else ""
    note = (
        f"Greedy tau (P(draft 1 accepted)) of {prompts} held-out files cut at each prefix length, "
        f"{settings.get('max_new_tokens')} new tokens each{alone}{blocks}."
    )
    return "\n".join([*table(header, rows, "l" + "r" * len(lengths)), "", note]) + "\n"


def plot_tau_curve(result: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Tau (left) and the acceptance of the first draft (right) vs prefix length, one line per drafter, of a
    `--by-length` run. Writes `path` (PNG, PDF, ...)."""
    curves, lengths = _curves(result)
    plt, fig, (tau_axis, first_axis) = two_panels(figsize=(10, 4))
    for name, rows in curves.items():
        xs = sorted(rows)
        tau_axis.plot(xs, [rows[x]["tau"] for x in xs], marker="o", label=name)
        first_axis.plot(xs, [_first_acceptance(rows[x]) for x in xs], marker="o", label=name)
    tau_axis.set_ylim(bottom=1.0)  # plain decoding's tau: the floor
    first_axis.set_ylim(0.0, 1.0)
    tau_axis.legend()
    settings = result.get("settings", {})
    fig.suptitle(f"Greedy acceptance vs prefix length, {settings.get('max_new_tokens')} new tokens per prompt")
    labels = [(None, "tau (tokens per verification round)"), (None, "P(draft 1 accepted)")]
    return finish(plt, fig, (tau_axis, first_axis), lengths, labels, path)
