"""The training data's types: a `Sequence` (token ids, where its prompt ends, where anchors start), and the
records `longspark regenerate` writes (`load_sequences`). Packed natural text (`corpora.py`) yields the same type."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..files import read_jsonl, require_path


@dataclass
class Sequence:
    """One training sequence: a regenerated chat (`ids` = templated prompt + target response, anchors in the
    response) or packed text (`corpora.pack_documents`: anchors everywhere).

    `prompt_length` tokens are the prompt that held-out tau measurement continues; anchors `t` start at
    `anchor_start` (default: `prompt_length`, the response). `source`: a regenerated record's prompt source.
    """

    ids: torch.LongTensor
    prompt_length: int
    anchor_start: int | None = None
    source: str = ""

    def __post_init__(self):
        if self.anchor_start is None:
            self.anchor_start = self.prompt_length
        if self.anchor_start < 1:
            raise ValueError("A sequence's first anchor needs a predecessor (its boundary state): anchor_start >= 1.")


def regenerate_hint(path: str | Path) -> str:
    """How to create the missing training data `path` (the end of an error message)."""
    path = Path(path)
    output = f"{path.parent} --held-out 40" if path.name in ("train", "held_out") else path  # --held-out's layout
    return f"create it with `longspark regenerate --prompts gsm8k mmath-en stdlib-code --output {output}`."


def load_sequences(path: str | Path, max_seq_len: int) -> list[Sequence]:
    """Reads the JSONL records written by `longspark regenerate` (`prompt_ids`, `response_ids`), sorted by id."""
    path = require_path(path, "Training data", regenerate_hint(path))
    records = []
    for file in sorted(path.glob("*.jsonl")) if path.is_dir() else [path]:
        for number, record in enumerate(read_jsonl(file, "Training data"), 1):
            if not isinstance(record, dict) or not {"id", "prompt_ids", "response_ids"} <= record.keys():
                raise ValueError(f"{file}: record {number} lacks 'id', 'prompt_ids' or 'response_ids'; use the "
                                 f"records of `longspark regenerate`.")  # fmt: skip
            records.append(record)
    if not records:
        raise ValueError(f"No records in {path}; {regenerate_hint(path)}")
    records.sort(key=lambda r: r["id"])
    sequences = []
    for record in records:
        ids = (record["prompt_ids"] + record["response_ids"])[:max_seq_len]
        if len(ids) - len(record["prompt_ids"]) >= 2:
            sequences.append(Sequence(torch.tensor(ids), len(record["prompt_ids"]), source=record.get("source", "")))
    return sequences


__all__ = ["Sequence", "load_sequences", "regenerate_hint"]
