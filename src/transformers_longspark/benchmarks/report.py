"""Markdown tables and figures of the benchmark reports (the dicts the `run_*` functions return)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

RANDOM_DRAFTER = "**The drafter is RANDOM (untrained): its tau and speedups are not meaningful.**"


def table(header: Sequence[str], rows: Iterable[Sequence[str]], align: str) -> list[str]:
    """The lines of a Markdown table: `header`, the separator (`align`: `l` or `r` per column), then `rows`."""
    separator = "|" + "".join("---:|" if side == "r" else "---|" for side in align)
    return [f"| {' | '.join(header)} |", separator, *(f"| {' | '.join(cells)} |" for cells in rows)]


def format_length(tokens: int) -> str:
    """`8192 -> "8K"`, `131072 -> "128K"`, `1000 -> "1000"`: axis and table labels."""
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def _speed_cells(row: Mapping[str, Any]) -> list[str]:
    identical = "-"
    if "greedy_identical" in row:
        verdict = "yes" if row["greedy_identical"] else "NO"
        identical = f"{verdict} ({row['greedy_identical_prompts']}/{row['prompts']})"
    lookup = "-"
    if row.get("lookup_round_share") is not None:
        lookup = f"{row['lookup_rounds']} ({100 * row['lookup_round_share']:.0f}%)"
    rates = [_fmt(row["tau"], ".2f")]
    for decode in ("", "decode_"):  # tokens/s, its speedup over plain and over the best plain path
        rates.append(_fmt(row.get(f"{decode}tokens_per_s"), ".1f"))
        rates += [_fmt(row.get(f"{decode}speedup{over}"), ".2f", "x") for over in ("", "_vs_best_plain")]
    parts = (("verify", ".1f"), ("proposal", ".2f"), ("context_update", ".2f"))
    costs = [_fmt(row.get(f"{part}_ms_per_round"), spec) for part, spec in parts]
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


def format_drafting_cost(result: Mapping[str, Any]) -> str:
    """The drafting-cost report as a Markdown table, one row per prefix length (synthetic ones marked)."""
    header = ["prefix", "LongSpark ms/round", "full-prefix ms/round", "LongSpark state", "full-prefix state"]
    synthetic = result.get("synthetic") or [False] * len(result["prefix_lengths"])
    rows = [[f"{length}{' (synthetic)' if synthetic[i] else ''}", f"{result['longspark_ms'][i]:.2f}",
             f"{result['full_prefix_ms'][i]:.2f}", f"{result['longspark_state_bytes'][i] / 1024:.1f} KiB",
             f"{result['full_prefix_state_bytes'][i] / 2**20:.2f} MiB"]
            for i, length in enumerate(result["prefix_lengths"])]  # fmt: skip
    lines = table(header, rows, "r" * len(header))
    ratio = result.get("round_cost_ratio")
    if ratio:  # e.g. "Round cost 128K / 512 (...): LongSpark 1.00x, full-prefix 42.0x"
        names = {"longspark": "LongSpark", "full_prefix": "full-prefix"}
        parts = [f"{label} {ratio[name]:.2f}x" for name, label in names.items() if ratio.get(name) is not None]
        shortest, longest = (format_length(length) for length in ratio["lengths"])
        lines.append(
            f"\nRound cost {longest} / {shortest} (median ms per round, longest over shortest): " + ", ".join(parts)
        )
    lines += [f"\nskipped {skip['prefix_length']}: {skip['reason']}" for skip in result.get("skipped", [])]
    if any(synthetic):
        lines.append("\n(synthetic): random K/V in the selected target layers and random boundary states.")
    return "\n".join(lines) + "\n"


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
            rows[-1] += [f"{result['stock_ms'][i][j]:.2f}", f"{result['longspark_ms'][i][j]:.2f}", _fmt(ratio, ".2f")]
    note = (
        f"\nMedian of {result['repeats']} forwards after {result['warmup']} untimed ones, stock and fast "
        "interleaved; the crop back to the prefix is not timed. fast/stock-1: fast k-token forward over the "
        "stock 1-token forward (one plain decoding step)."
    )
    return "\n".join([*table(header, rows, "r" * len(header)), note]) + "\n"


def format_memory(result: Mapping[str, Any]) -> str:
    """The memory report as a Markdown table, one row per prompt length."""
    header = ["prompt tokens", "plain peak MiB", "assisted peak MiB", "extra peak MiB", "extra at run time MiB"]
    rows = [[str(row["prompt_length"]), f"{row['plain_peak_mib']:.1f}", f"{row['assisted_peak_mib']:.1f}",
             f"{row['extra_peak_mib']:+.1f}", f"{row['extra_runtime_mib']:+.1f}"]
            for row in result["lengths"]]  # fmt: skip
    note = f"\nextra peak growth from shortest to longest prompt: {result['extra_peak_growth_mib']:+.1f} MiB"
    return "\n".join([*table(header, rows, "rrrrr"), note]) + "\n"


def two_panels(figsize=(10, 3.8)):
    """`(pyplot, figure, (left, right))`: a figure of two panels, drawn off-screen (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=figsize)
    return plt, fig, axes


def finish(plt, fig, axes, lengths, labels: Sequence[tuple[str | None, str]], path: str | os.PathLike) -> Path:
    """Puts prefix length (log scale) on both panels' x axes, their `(title, y label)`, and writes `path` (PNG...)."""
    for ax, (title, ylabel) in zip(axes, labels):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths)
        ax.set_xticklabels([format_length(t) for t in lengths])
        ax.set_xlabel("prefix length (tokens)")
        ax.grid(True, alpha=0.3)
        ax.set_ylabel(ylabel)
        if title:
            ax.set_title(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


# The drafting-cost figure's curves: drafter (its `{name}_ms` field), label, bytes-per-request field, line style.
DRAFTING_COST_CURVES = (
    ("longspark", "LongSpark (window + summary)", "longspark_state_bytes", dict(marker="o", color="tab:blue")),
    ("full_prefix", "full-prefix drafter", "full_prefix_state_bytes",
     dict(marker="s", color="tab:red", linestyle="--")),
)  # fmt: skip


def plot_drafting_cost(result: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Two panels, like the paper's Figure 1 (left): (a) drafting time per round and (b) drafter context-state
    memory (log scale) vs prefix length (log scale), LongSpark vs the full-prefix baseline. Synthetic-cache lengths are
    drawn dotted with hollow markers on a shaded range. Writes `path` (PNG, PDF, ...)."""
    lengths = result["prefix_lengths"]
    synthetic = result.get("synthetic") or [False] * len(lengths)
    plt, fig, (time_ax, mem_ax) = two_panels()
    real = [i for i, s in enumerate(synthetic) if not s]
    fake = [i for i, s in enumerate(synthetic) if s]
    for name, label, bytes_field, style in DRAFTING_COST_CURVES:
        mebibytes = [b / 2**20 for b in result[bytes_field]]
        for ax, values in ((time_ax, result[f"{name}_ms"]), (mem_ax, mebibytes)):
            if real:
                ax.plot([lengths[i] for i in real], [values[i] for i in real], label=label, **style)
            if fake:  # joined to the last real point, so that each method stays one curve
                joined = real[-1:] + fake
                hollow = dict(linestyle=":", color=style["color"], marker=style["marker"], markerfacecolor="none")
                hollow["label"] = None if real else label
                ax.plot([lengths[i] for i in joined], [values[i] for i in joined], **hollow)
    for ax in (time_ax, mem_ax):
        if fake:
            low, high = min(lengths[i] for i in fake) / 2**0.5, max(lengths) * 2**0.5
            ax.axvspan(low, high, color="0.92", zorder=0, label="synthetic cache")
        ax.legend()
    time_ax.set_ylim(bottom=0)
    mem_ax.set_yscale("log")
    labels = [
        ("(a) drafting cost per round", "drafting time per round (ms)"),
        ("(b) drafter context-state memory", "drafter context state (MiB)"),
    ]
    return finish(plt, fig, (time_ax, mem_ax), lengths, labels, path)


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


__all__ = ["format_drafting_cost", "format_markdown", "format_memory", "format_verify_cost", "plot_drafting_cost",
           "plot_verify_cost", "table"]  # fmt: skip
