"""Long-code training and evaluation data: Python standard-library files, tokenized by the target's tokenizer.

Writes the JSONL records that `transformers_longspark.training.distillation.load_sequences` reads, one record per FILE:
`{"id": "<relative path>", "prompt_ids": first --prompt-tokens tokens, "response_ids": the rest, cut so the record
holds at most --max-tokens tokens}`. The short prompt lets training anchors cover almost the whole file. The raw code
is the target's own input distribution here (the target continues the file), so no regeneration is needed.

Files are never packed together: each record is one file, so no anchor ever sees another document's tokens. The
held-out split is by FILE and deterministic (a hash of the path relative to the standard library's folder), so a
held-out file is never trained on, whatever `--max-tokens` is.

    python scripts/prepare_long_code.py --output data/long_code --max-tokens 8192

Outputs `OUTPUT/train/part-00000.jsonl` and `OUTPUT/held_out/part-00000.jsonl`; `data/` is git-ignored.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from transformers_longspark.training.corpora import is_held_out


def stdlib_root() -> Path:
    return Path(os.__file__).parent


def stdlib_files(min_bytes: int) -> list[Path]:
    """Python sources of the standard library (top level and packages; no tests, no site-packages), by path."""
    root = stdlib_root()
    skipped = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(part in skipped or part.startswith("test") for part in parts[:-1]):
            continue
        if path.stat().st_size >= min_bytes:
            files.append(path)
    return files


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="data/long_code")
    parser.add_argument("--max-tokens", type=int, default=8192, help="tokens kept per file (prompt included)")
    parser.add_argument("--min-tokens", type=int, default=1024, help="files with fewer tokens are skipped")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--held-out-percent", type=float, default=15.0)
    parser.add_argument("--min-bytes", type=int, default=4000, help="skip smaller files without tokenizing them")
    args = parser.parse_args(argv)

    from transformers_longspark.loading import load_target

    _, tokenizer = load_target("smollm2")
    root = stdlib_root()
    splits: dict[str, list[dict]] = {"train": [], "held_out": []}
    for path in stdlib_files(args.min_bytes):
        relative = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"][: args.max_tokens]
        if len(ids) < args.min_tokens:
            continue
        record = {"id": relative, "prompt_ids": ids[: args.prompt_tokens], "response_ids": ids[args.prompt_tokens :]}
        splits["held_out" if is_held_out(relative, args.held_out_percent) else "train"].append(record)
    for split, records in splits.items():
        folder = Path(args.output) / split
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / "part-00000.jsonl").open("w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        tokens = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in records)
        full = sum(len(r["prompt_ids"]) + len(r["response_ids"]) >= args.max_tokens for r in records)
        print(f"{split}: {len(records)} files, {tokens:,} tokens, {full} of them with {args.max_tokens} tokens")


if __name__ == "__main__":
    main()
