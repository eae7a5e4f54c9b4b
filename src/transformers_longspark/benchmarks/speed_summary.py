"""The speed benchmark's report: per-method summaries of the runs, speedups over plain `generate` and over the
fastest plain path of the same run, and its Markdown tables."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..inference.stats import DraftingStats, tau
from .report import RANDOM_DRAFTER, fmt, table
from .settings import METHOD_LABELS, PLAIN_METHODS


def merge_histograms(histograms: Sequence[Sequence[int]]) -> list[int]:
    """Element-wise sum of accepted-draft histograms of different lengths (`DraftingStats.accepted_histogram`)."""
    merged = [0] * max((len(h) for h in histograms), default=0)
    for histogram in histograms:
        for count, rounds in enumerate(histogram):
            merged[count] += rounds
    return merged


def _timing_fields(runs: Sequence[Mapping[str, Any]], tokens: int, seconds: float) -> dict[str, Any]:
    """Verification ms per round, prefill ms and decoding tokens/s: the tokens after the prefill's first one over the
    time after the prefill (which every method spends alike, and which dominates long prompts)."""
    verify_rounds = sum(run["target_forwards"] - 1 for run in runs)  # every target forward after the prefill
    verify = sum(run["verify_seconds"] for run in runs)
    prefill = sum(run["prefill_seconds"] for run in runs)
    decode_seconds = seconds - prefill
    decode_tokens = tokens - sum(1 for run in runs if run["new_tokens"] > 0)
    return {
        "verify_ms_per_round": 1000.0 * verify / verify_rounds if verify_rounds > 0 else None,
        "prefill_ms": 1000.0 * prefill / len(runs) if runs else None,
        "decode_tokens_per_s": decode_tokens / decode_seconds if decode_seconds > 0 else None,
    }


# The `DraftingStats` fields summed over runs for the per-drafter-round split (`DraftingStats.drafter_round_parts`).
ROUND_PART_FIELDS = ("drafter_rounds", "proposal_seconds", "planning_seconds", "drafter_forward_seconds",
                     "context_update_seconds")  # fmt: skip


def _drafting_fields(runs: Sequence[Mapping[str, Any]], rounds: int) -> dict[str, Any]:
    """Drafted tokens, drafting ms per round (proposal, context update), context-state bytes, lookup rounds and the
    per-position acceptance `[P(draft 1 accepted), P(drafts 1-2 accepted), ...]` over all the runs' rounds."""

    def total(name: str) -> float:
        return sum(run.get(name, 0) for run in runs)

    def per_round(value: float) -> float | None:
        return value / rounds if rounds else None

    proposal, update = total("proposal_seconds"), total("context_update_seconds")
    histogram = merge_histograms([run.get("accepted_histogram", []) for run in runs])
    parts = DraftingStats(**{name: total(name) for name in ROUND_PART_FIELDS})
    return {
        "drafter_rounds": parts.drafter_rounds,
        "drafter_round_ms": parts.drafter_round_parts() if parts.drafter_rounds else None,
        "drafted_tokens": total("drafted_tokens"),
        "proposal_ms_per_round": per_round(1000.0 * proposal),
        "context_update_ms_per_round": per_round(1000.0 * update),
        "drafting_ms_per_round": per_round(1000.0 * (proposal + update)),
        "context_state_bytes": max(run.get("context_state_bytes", 0) for run in runs),
        "lookup_rounds": total("lookup_rounds"),
        "lookup_round_share": per_round(total("lookup_rounds")),
        "plain_rounds": total("plain_rounds"),
        "plain_round_share": per_round(total("plain_rounds")),
        "accepted_histogram": histogram,
        "acceptance_rates": DraftingStats(accepted_histogram=histogram).acceptance_rates(),
    }


def summarize_runs(runs: Sequence[Mapping[str, Any]], method: str) -> dict[str, Any]:
    """Aggregates one method's runs (one per prompt): token-weighted tau, tokens/s, ms per token, drafting time and
    target forward time per round (`verify_ms_per_round`; for plain `generate`, per decoding step), and for drafters
    the lookup rounds and per-position acceptance."""
    tokens = sum(run["new_tokens"] for run in runs)
    seconds = sum(run["seconds"] for run in runs)
    rounds = sum(run["rounds"] for run in runs)
    forwards = sum(run["target_forwards"] for run in runs)
    summary: dict[str, Any] = {
        "method": method,
        "label": METHOD_LABELS.get(method, f"LongSpark variant {method}"),
        "prompts": len(runs),
        "new_tokens": tokens,
        "seconds": seconds,
        "target_forwards": forwards,
        "rounds": rounds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "ms_per_token": 1000.0 * seconds / tokens if tokens else None,
        "tokens_per_forward": tokens / forwards if forwards else None,
    }
    if method in PLAIN_METHODS:
        summary["tau"] = 1.0  # one target forward per token, by definition
    else:
        prefill_tokens = sum(1 for run in runs if run["new_tokens"] > 0)
        summary["tau"] = tau(tokens, rounds, prefill_tokens) if rounds > 0 else None
    if all("verify_seconds" in run for run in runs):
        summary.update(_timing_fields(runs, tokens, seconds))
    if any("proposal_seconds" in run for run in runs):
        summary.update(_drafting_fields(runs, rounds))
    identical = [run["identical_to_plain"] for run in runs if run.get("identical_to_plain") is not None]
    if identical:
        summary["greedy_identical"] = all(identical)
        summary["greedy_identical_prompts"] = sum(identical)
    return summary


# (speedup field, the rate it divides, the field naming the fastest plain path by that rate)
SPEEDUPS = (("speedup", "tokens_per_s", "best_plain"), ("decode_speedup", "decode_tokens_per_s", "best_plain_decode"))


def add_speedups(summaries: Mapping[str, dict[str, Any]]) -> None:
    """Speedups of each method, end to end (`speedup`, tokens/s) and for decoding alone (`decode_speedup`, the time
    after the prefill): over plain `generate`, and over the fastest plain path (`PLAIN_METHODS`) measured in the same
    run (`speedup_vs_best_plain`, `decode_speedup_vs_best_plain`; which one it was: `best_plain`,
    `best_plain_decode`). And `drafter_round_steps`: each drafter method's drafting time per drafter round over the
    plain step of the fast path (`plain_fast`'s target forward per step), i.e. what a drafter round costs in steps."""
    for field, rate, best_field in SPEEDUPS:
        plain = summaries["plain"].get(rate)
        measured = [method for method in PLAIN_METHODS if (summaries.get(method) or {}).get(rate)]
        best = max(measured, key=lambda method: summaries[method][rate], default=None)
        best_rate = summaries[best][rate] if best is not None else None
        for summary in summaries.values():
            value = summary.get(rate)
            summary[field] = value / plain if plain and value else None
            summary[f"{field}_vs_best_plain"] = value / best_rate if best_rate and value else None
            summary[best_field] = best
    step = (summaries.get("plain_fast") or {}).get("verify_ms_per_round")
    for summary in summaries.values():
        parts = summary.get("drafter_round_ms")
        summary["drafter_round_steps"] = parts["total"] / step if parts and step else None


def _speed_cells(row: Mapping[str, Any]) -> list[str]:
    identical = "-"
    if "greedy_identical" in row:
        verdict = "yes" if row["greedy_identical"] else "NO"
        identical = f"{verdict} ({row['greedy_identical_prompts']}/{row['prompts']})"
    lookup = "-"
    if row.get("lookup_round_share") is not None:
        lookup = f"{row['lookup_rounds']} ({100 * row['lookup_round_share']:.0f}%)"
    rates = [fmt(row["tau"], ".2f")]
    for decode in ("", "decode_"):  # tokens/s, its speedup over plain and over the best plain path
        rates.append(fmt(row.get(f"{decode}tokens_per_s"), ".1f"))
        rates += [fmt(row.get(f"{decode}speedup{over}"), ".2f", "x") for over in ("", "_vs_best_plain")]
    parts = (("verify", ".1f"), ("proposal", ".2f"), ("context_update", ".2f"))
    costs = [fmt(row.get(f"{part}_ms_per_round"), spec) for part, spec in parts]
    return [row["workload"], row["mode"], row["label"], *rates, *costs, lookup, identical]


def _best_plain_notes(rows) -> list[str]:
    """Which plain path was the fastest, per workload and mode (the reference of the "vs best plain" columns)."""
    best = {}
    for row in rows:
        best.setdefault((row["workload"], row["mode"]), (row.get("best_plain"), row.get("best_plain_decode")))
    return [
        f"{workload} {mode}: {total or '-'} end to end, {decode or '-'} decoding"
        for (workload, mode), (total, decode) in best.items()
    ]


def format_acceptance(report: Mapping[str, Any]) -> str:
    """Per-position acceptance of the drafter methods as a Markdown table: `P(drafts 1..i accepted)` over all rounds,
    the rounds that proposed the lookup continuation, and those that proposed nothing (plain steps)."""
    header = ["workload", "mode", "method", "rounds", "lookup rounds", "plain rounds",
              "acceptance by position (1, 2, ...)"]  # fmt: skip
    rows = [
        [row["workload"], row["mode"], row["label"], str(row["rounds"]), str(row["lookup_rounds"]),
         str(row.get("plain_rounds", 0)), " ".join(f"{rate:.2f}" for rate in row["acceptance_rates"]) or "-"]
        for row in report["rows"] if "acceptance_rates" in row
    ]  # fmt: skip
    return "\n".join(table(header, rows, "lllrrrl")) + "\n"


def format_markdown(report: Mapping[str, Any]) -> str:
    """The speed report as Markdown: one row per workload, mode and method, the drafters' per-position acceptance,
    then the machine and settings."""
    header = ["workload", "mode", "method", "tau", "tok/s", "speedup", "vs best plain", "decode tok/s",
              "decode speedup", "decode vs best plain", "verify ms/round", "propose ms/round", "update ms/round",
              "lookup rounds", "greedy identical"]  # fmt: skip
    lines = table(header, [_speed_cells(row) for row in report["rows"]], "lll" + "r" * 11 + "l")
    machine, settings = report.get("machine", {}), report.get("settings", {})
    variants = settings.get("variants", {})
    notes = [
        f"Machine: {machine.get('cpu')} ({machine.get('cpu_cores')} cores, {machine.get('torch_threads')} torch "
        f"threads), torch {machine.get('torch')}, transformers {machine.get('transformers')}, {machine.get('device')}.",
        f"Settings: max_new_tokens={settings.get('max_new_tokens')}, sampled at T={settings.get('temperature')} "
        f"(no top-k/top-p), prompt_lookup_num_tokens={settings.get('prompt_lookup_num_tokens')}, "
        f"ignore_eos={settings.get('ignore_eos')}.",
        *(f"Variant {name}: LongSpark with {json.dumps(changed)}." for name, changed in variants.items()),
        "tau = (new tokens - 1) / verification rounds; speedup is over plain generate in the same mode, end to end "
        "(tok/s, prompt processing included) and for decoding alone (decode tok/s: the tokens after the first over "
        'the time after the prefill); "vs best plain" is over the fastest plain path measured in the same run '
        "(plain generate, on the fast verification path, with a static cache): "
        + "; ".join(_best_plain_notes(report["rows"]))
        + ". verify ms/round: target forward per round after the prefill (for plain generate, per decoding step); "
        "lookup rounds: rounds that proposed the lookup continuation instead of a drafted block; plain rounds: rounds "
        "that proposed nothing (the cost model found no source worth its cost), i.e. plain decoding steps.",
    ]
    if report.get("drafter", {}).get("trained") is False:
        notes.append(RANDOM_DRAFTER)
    acceptance = format_acceptance(report)
    if acceptance.count("\n") > 2:
        heading = "\nPer-position acceptance (P(drafts 1..i all accepted), over every verified round):\n\n"
        notes.append(heading + acceptance)
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"
