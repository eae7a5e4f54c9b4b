"""Training-data sources and their weighted mixture: regenerated chats and plain-text corpora packed into sequences.

The loss targets are the frozen target's own distributions `p_i` at every position (the paper's Section 2.4), so any
text the target reads teaches the drafter, not only text the target wrote. A :class:`DataSource` is one of:

* ``regenerated``: the JSONL records of ``longspark regenerate`` (``prompt_ids`` + ``response_ids``); anchors lie
  in the response.
* ``text``: JSONL records with a ``text`` field, or chats with ``messages`` that include the assistant's answer
  (rendered with the target's chat template).
* ``files``: a folder of source files (``glob``), one document per file.
* ``dataset``: a ``datasets`` dataset, ``load_dataset(path, name, split=split)[text_field]``.

Text documents are tokenized with the target's tokenizer (no special tokens), joined with EOS and packed back to
back into sequences of exactly ``max_seq_len`` tokens (the last, shorter one is kept when it holds at least half
of that). Anchors then cover every position of a packed sequence. Held-out documents are split off by
:func:`is_held_out`, a hash of the document id, so that a held-out document is never trained on at any length.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..files import check_fields, read_jsonl, require_path
from .data import Sequence, load_sequences, regenerate_hint

FORMATS = ("auto", "regenerated", "text", "files", "dataset")
HELD_OUT_PERCENT = 15.0  # `scripts/prepare_corpora.py`'s default; the benchmarks' long prompts use the same split


def is_held_out(document_id: str, held_out_percent: float) -> bool:
    """Deterministic split by document: the first 8 hex digits of sha256(id) as a fraction of 2^32."""
    bucket = int(hashlib.sha256(document_id.encode()).hexdigest()[:8], 16) / 2**32
    return bucket < held_out_percent / 100


@dataclass
class DataSource:
    """One training-data source; `train_data` / `eval_data` in a training config is a path or a list of these.

    Args:
        path: a folder or JSONL file (``regenerated``, ``text``), a folder (``files``), or a dataset name/path.
        weight: relative probability that a micro-batch is drawn from this source.
        format: one of :data:`FORMATS`; ``auto`` reads the first record (or finds no JSONL: ``files``).
        glob: files to read for ``files`` (``**/*.py``, ...); binary and non-UTF-8 files are skipped.
        text_field: the text field of ``text`` records and ``dataset`` rows.
        name, split: ``datasets.load_dataset`` arguments for ``dataset``.
        max_tokens: stop reading documents once this many tokens are read (``None``: all).
    """

    path: str
    weight: float = 1.0
    format: str = "auto"
    glob: str = "**/*"
    text_field: str = "text"
    name: str | None = None
    split: str = "train"
    max_tokens: int | None = None

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"Data source {self.path}: format {self.format!r} is not one of {FORMATS}.")
        if not self.weight > 0:
            raise ValueError(f"Data source {self.path}: weight must be > 0, got {self.weight}.")

    def resolved_format(self) -> str:
        if self.format != "auto":
            return self.format
        path = require_path(self.path, "Training data", regenerate_hint(self.path))
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        if not files:
            return "files"
        first = next(iter(read_jsonl(files[0], "Training data")), None)
        if isinstance(first, dict) and "prompt_ids" in first:
            return "regenerated"
        if isinstance(first, dict) and (self.text_field in first or "messages" in first):
            return "text"
        fields = sorted(first) if isinstance(first, dict) else type(first).__name__
        raise ValueError(
            f"{files[0]}: cannot tell the format of its records (fields: {fields}); use the records "
            f"of `longspark regenerate`, '{self.text_field}' JSONL, or `format:`."
        )


def data_sources(value: str | dict | list) -> list[DataSource]:
    """The sources of a `train_data` / `eval_data` config value: a path, one mapping, or a list of either."""
    items = value if isinstance(value, list) else [value]
    sources = []
    for item in items:
        if isinstance(item, str | Path):
            sources.append(DataSource(str(item)))
        elif isinstance(item, dict):
            check_fields(DataSource, item, "data source")
            sources.append(DataSource(**item))
        else:
            raise ValueError(f"A data source is a path or a mapping such as {{path: data/x, weight: 1}}; got {item!r}.")
    if not sources:
        raise ValueError("No training data: give `train_data` a path or a list of sources.")
    return sources


def load_source(source: DataSource, tokenizer, max_seq_len: int) -> list[Sequence]:
    """The sequences of one source (see the module docstring), in a deterministic order."""
    form = source.resolved_format()
    if form == "regenerated":
        return load_sequences(source.path, max_seq_len)
    if tokenizer is None:
        raise ValueError(f"Data source {source.path} holds text, which needs the target's tokenizer; pass it.")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("The target's tokenizer has no EOS token to separate packed documents; set eos_token.")
    documents = _tokenized(_documents(source, form, tokenizer), tokenizer, source.max_tokens)
    sequences = pack_documents(documents, max_seq_len, eos)
    if not sequences:
        raise ValueError(f"Data source {source.path} holds fewer than {max_seq_len // 2} tokens of text.")
    return sequences


def pack_documents(documents: Iterable[list[int]], max_seq_len: int, separator: int) -> list[Sequence]:
    """Packs token lists, each followed by `separator`, back to back into sequences of `max_seq_len` tokens.

    A packed sequence's anchors start at 1 (every position with a predecessor); its `prompt_length` (the prompt
    that held-out tau measurement continues) is its first half.
    """
    sequences, buffer = [], []

    def emit(tokens: list[int]) -> None:
        sequences.append(Sequence(torch.tensor(tokens), prompt_length=len(tokens) // 2, anchor_start=1))

    for tokens in documents:
        buffer += tokens
        buffer.append(separator)
        while len(buffer) >= max_seq_len:
            emit(buffer[:max_seq_len])
            del buffer[:max_seq_len]
    if len(buffer) >= max(4, max_seq_len // 2):
        emit(buffer)
    return sequences


def _documents(source: DataSource, form: str, tokenizer) -> Iterator[str]:
    if form == "files":
        root = require_path(source.path, "Text corpus folder", "point `path` at a folder of text or source files.")
        for file in sorted(p for p in root.glob(source.glob) if p.is_file()):
            try:
                text = file.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text and "\x00" not in text:
                yield text
    elif form == "text":
        path = Path(source.path)
        for file in sorted(path.glob("*.jsonl")) if path.is_dir() else [path]:
            for number, record in enumerate(read_jsonl(file, "Text corpus"), 1):
                yield _record_text(record, source.text_field, tokenizer, f"{file}: record {number}")
    else:
        try:
            import datasets
        except ImportError as error:
            raise ValueError(f"Data source {source.path} is a `datasets` dataset: `pip install datasets`.") from error
        for row in datasets.load_dataset(source.path, source.name, split=source.split):
            yield _record_text(row, source.text_field, tokenizer, f"{source.path}: a row")


def _record_text(record: Any, text_field: str, tokenizer, where: str) -> str:
    if isinstance(record, dict) and isinstance(record.get(text_field), str):
        return record[text_field]
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        return tokenizer.apply_chat_template(record["messages"], tokenize=False)
    raise ValueError(
        f"{where} has no string field '{text_field}' and no 'messages' chat; fix the record or set "
        f"`text_field:` in the data source."
    )


def _tokenized(texts: Iterable[str], tokenizer, max_tokens: int | None, batch: int = 64) -> Iterator[list[int]]:
    """Token ids of `texts`, tokenized `batch` at a time, until `max_tokens` tokens have been yielded."""
    total, texts = 0, iter(texts)
    while chunk := list(itertools.islice(texts, batch)):
        for ids in tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]:
            if max_tokens is not None and total >= max_tokens:
                return
            total += len(ids)
            yield ids


class DataMixture:
    """Sources and their sequences; draws micro-batches by source weight, each source in its own shuffled epochs.

    The stream depends on `(seed, process)` alone, so a resumed run that skips the micro-batches it consumed sees
    exactly the data of an uninterrupted one. Regenerated sources are re-read at each of their epochs, so that a run
    started beside `longspark regenerate` picks up the new records.
    """

    def __init__(self, sources: list[DataSource], tokenizer, max_seq_len: int):
        self.sources, self.tokenizer, self.max_seq_len = sources, tokenizer, max_seq_len
        self.sequences = [load_source(source, tokenizer, max_seq_len) for source in sources]

    def __len__(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def all_sequences(self) -> list[Sequence]:
        return [sequence for sequences in self.sequences for sequence in sequences]

    def micro_batches(self, batch: int, seed: int, process: int = 0, num_processes: int = 1) -> Iterator[list]:
        streams = [
            self._source_stream(i, batch, seed + 7919 * i, process, num_processes) for i in range(len(self.sources))
        ]
        weights = torch.tensor([source.weight for source in self.sources], dtype=torch.float64)
        chooser = torch.Generator().manual_seed(seed)
        while True:
            index = int(torch.multinomial(weights, 1, generator=chooser)) if len(streams) > 1 else 0
            yield next(streams[index])

    def _source_stream(self, index: int, batch: int, seed: int, process: int, num_processes: int) -> Iterator[list]:
        source, epoch = self.sources[index], 0
        while True:
            if epoch > 0 and source.resolved_format() == "regenerated":
                self.sequences[index] = load_source(source, self.tokenizer, self.max_seq_len)
            sequences = self.sequences[index]
            order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(seed + epoch))
            order = order[process::num_processes].tolist()
            if len(order) < batch:
                raise ValueError(
                    f"Data source {source.path} has too few sequences ({len(sequences)}) for "
                    f"{batch} per micro-batch on {num_processes} processes."
                )
            for start in range(0, len(order) - batch + 1, batch):
                yield [sequences[i] for i in order[start : start + batch]]
            epoch += 1


__all__ = [
    "FORMATS",
    "HELD_OUT_PERCENT",
    "DataMixture",
    "DataSource",
    "data_sources",
    "is_held_out",
    "load_source",
    "pack_documents",
]
