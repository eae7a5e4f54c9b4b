"""What the benchmarks' Markdown tables and figures share (each benchmark formats its report next to its run)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
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


def fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


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
