"""Benchmark prompts: held-out chat, maths and code prompts (short), and Python stdlib files (long context)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..training.corpora import HELD_OUT_PERCENT, is_held_out
from .settings import DEFAULT_LONG_LENGTHS, HELD_OUT_DIR, SHORT_SOURCES


def chat_prompt_ids(tokenizer, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """The chat-templated prompt (generation prompt added) as token ids, as ``longspark regenerate`` builds it."""
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def short_prompts(
    tokenizer,
    num_prompts: int = 6,
    held_out_dir: str | os.PathLike | None = HELD_OUT_DIR,
    sources: Sequence[str] = SHORT_SOURCES,
) -> list[dict[str, Any]]:
    """Held-out chat, maths and code prompts of `sources`, interleaved by source: the regenerated held-out records
    (``data/smollm2/held_out/*.jsonl``, chat-templated without the assistant turn), else 40 prompts of each builtin
    source held out exactly as ``longspark regenerate --held-out 40 --seed 0`` does."""
    from ..training.prompt_sources import builtin_prompt_source, interleave, normalize_record, split_prompts

    by_source: dict[str, list[dict[str, Any]]] = {}
    held_out = Path(held_out_dir) if held_out_dir is not None else None
    if held_out is not None and held_out.is_dir() and any(held_out.glob("*.jsonl")):
        origin = str(held_out)
        lines = [line for shard in sorted(held_out.glob("*.jsonl")) for line in shard.read_text("utf-8").split("\n")]
        records = sorted((json.loads(line) for line in lines if line.strip()), key=lambda record: record.get("id", 0))
        for index, record in enumerate(records):
            prompt = normalize_record(record, index)
            prompt["id"] = record.get("id", index)
            if prompt["source"] in sources:
                by_source.setdefault(prompt["source"], []).append(prompt)
    else:
        origin = "builtin sources (held-out split: 40 per source, seed 0)"
        for name in sources:
            try:
                records = [normalize_record(r, i, name) for i, r in enumerate(builtin_prompt_source(name))]
            except ValueError as error:  # the source's package is not installed
                print(f"WARNING: skipping prompt source {name}: {error}", file=sys.stderr)
                continue
            by_source[name] = split_prompts(records, 40, 0)[1]
    if not by_source:
        raise ValueError(f"No held-out short prompts of the sources {', '.join(sources)} in {origin}; choose from "
                         f"{', '.join(SHORT_SOURCES)}.")  # fmt: skip
    return [
        {
            "name": f"{prompt['source']}-{prompt.get('id', index)}",
            "source": prompt["source"],
            "origin": origin,
            "input_ids": chat_prompt_ids(tokenizer, prompt["messages"]),
        }
        for index, prompt in enumerate(interleave(*by_source.values())[:num_prompts])
    ]


def _stdlib_files(min_bytes: int, held_out_only: bool = False) -> list[Path]:
    """Top-level stdlib modules of at least `min_bytes`, by name; `held_out_only`: only those that
    `scripts/prepare_corpora.py` holds out of the training corpora (ids `python/stdlib/<name>`)."""
    files = [p for p in sorted(Path(os.__file__).parent.glob("*.py")) if p.stat().st_size >= min_bytes]
    if held_out_only:
        files = [p for p in files if is_held_out(f"python/stdlib/{p.name}", HELD_OUT_PERCENT)]
    return files


def _file_token_ids(tokenizer, path: Path) -> list[int]:
    text = path.read_text(encoding="utf-8", errors="replace")
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def stdlib_token_ids(tokenizer, num_tokens: int) -> list[int]:
    """At least ``num_tokens`` token ids of real Python code: large stdlib files, in name order, concatenated."""
    ids: list[int] = []
    for path in _stdlib_files(20_000):
        ids += _file_token_ids(tokenizer, path)
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise ValueError(f"The standard library holds fewer than {num_tokens} tokens of large files.")


def long_context_prompts(
    tokenizer,
    lengths: Sequence[int] = DEFAULT_LONG_LENGTHS,
    num_prompts: int | None = None,
    max_positions: int | None = None,
    reserve: int = 0,
    every_length: bool = False,
) -> list[dict[str, Any]]:
    """Code-continuation prompts (raw code, no chat template): Python stdlib files, one per prompt in name order, cut
    to ``lengths[i % n]`` tokens; with ``every_length``, each of ``num_prompts`` files cut at every length (an
    acceptance-vs-length curve). Each prompt records its ``length``, capped at ``max_positions - reserve`` (room for
    the new tokens and one draft block). Only files held out of the training corpora (`corpora.is_held_out`) are
    used, so no drafter trained on `scripts/prepare_corpora.py`'s data has seen them.
    """
    lengths = list(lengths)
    num_prompts = len(lengths) if num_prompts is None else num_prompts
    if max_positions is not None:
        lengths = [min(length, max_positions - reserve) for length in lengths]
    if every_length:
        lengths = sorted(set(lengths))
    files = iter(_stdlib_files(min(lengths) * 2, held_out_only=True))
    prompts: list[dict[str, Any]] = []
    for index in range(num_prompts):
        wanted = lengths if every_length else [lengths[index % len(lengths)]]
        for path in files:
            # ~3-4 characters per token for Python code; skip files that cannot reach the longest cut.
            if path.stat().st_size < 2 * max(wanted):
                continue
            ids = _file_token_ids(tokenizer, path)
            if len(ids) >= max(wanted):
                prompts += [
                    {"name": f"{path.stem}.py[:{n}]", "source": "stdlib-file", "length": n, "input_ids": ids[:n]}
                    for n in wanted
                ]
                break
        else:
            raise ValueError(
                f"No more held-out standard-library files hold {max(wanted)} tokens (found {index} files); ask for "
                "fewer or shorter long prompts."
            )
    return prompts
