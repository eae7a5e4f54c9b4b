"""The speed benchmark's arithmetic: per-method summaries of the runs, and speedups over plain `generate` and
over the fastest plain path of the same run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..inference.stats import DraftingStats, tau
from .settings import PLAIN_METHODS

METHOD_LABELS = {
    "plain": "plain generate",
    "plain_fast": "plain generate (fast verification)",
    "plain_static": "plain generate (static cache)",
    "prompt_lookup": "prompt lookup",
    "prompt_lookup_fast": "prompt lookup (fast verification)",
    "longspark": "LongSpark",
    "longspark_drafter_only": "LongSpark drafter alone (no lookup, every round drafts)",
    "longspark_lookup_only": "LongSpark lookup alone (drafter priced out)",
    "longspark_no_proposals": "LongSpark, no proposals (every round a plain step)",
    "full_prefix": "full-prefix drafter",
}


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


__all__ = ["METHOD_LABELS", "add_speedups", "merge_histograms", "summarize_runs"]
