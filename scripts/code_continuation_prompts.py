#!/usr/bin/env python
"""Raw-text continuation prompts cut from a code corpus: for `longspark regenerate` to write the target's own
continuation of code, the situation of the long-code benchmark (a file's first tokens, continued without a chat
template) rather than a chat answer.

Each file of the corpus's training split (`scripts/prepare_corpora.py`: held-out documents are never read) whose id
starts with one of `--languages` gives one prompt: its text from the start to a line end at least `--min-tokens` and
at most `--max-tokens` tokens in (drawn with `--seed`, so the same corpus gives the same prompts), recorded as
`{"text": ..., "source": "code-<language>", "id": <document id>}`. Another `--seed` cuts the same files elsewhere;
`--exclude-records DIR` then leaves out the files whose prompts an earlier set holds out (`longspark regenerate
--held-out`), so that none of them is trained on:

    python scripts/code_continuation_prompts.py --corpus data/corpora/code/train --seed 1 \
        --exclude-records data/smollm2-code-greedy/held_out --output data/code-prompts-2.jsonl

    python scripts/code_continuation_prompts.py --corpus data/corpora/code/train --output data/code-prompts.jsonl
    .venv-vllm/bin/longspark regenerate --engine vllm --prompts data/code-prompts.jsonl --temperature 0 \
        --max-new-tokens 128 --held-out 40 --output data/smollm2-code-greedy
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from transformers_longspark.files import read_jsonl
from transformers_longspark.loading import load_tokenizer, smollm2_dir

EXCLUDE_PREFIX_CHARS = 256  # how much of a file's start identifies it (every prompt holds at least 256 tokens)


def cut_point(text: str, offsets: list[tuple[int, int]], low: int, high: int, rng: random.Random) -> int | None:
    """A character index just after a newline, between token `low` and token `high` (`offsets`: each token's
    character span), or None when the text is shorter than `low` tokens plus room for a continuation."""
    high = min(high, len(offsets) - 16)
    if high < low:
        return None
    start = offsets[rng.randint(low, high)][0]
    end = text.find("\n", start)
    return None if end < 0 or end + 1 >= len(text) else end + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, required=True, help="a corpus split folder of {'id', 'text'} JSONL")
    parser.add_argument("--output", type=Path, required=True, help="the prompts' JSONL file")
    parser.add_argument("--languages", nargs="+", default=["python"], help="document id prefixes to keep")
    parser.add_argument("--min-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=1792)
    parser.add_argument("--target", default=None, help="target folder whose tokenizer counts tokens (default: SmolLM2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exclude-records", type=Path, nargs="*", default=[],
                        help="regenerated records' folders whose prompts' files are left out")  # fmt: skip
    args = parser.parse_args()
    if not 0 < args.min_tokens <= args.max_tokens:
        parser.error(f"need 0 < --min-tokens <= --max-tokens, got {args.min_tokens} and {args.max_tokens}")
    tokenizer = load_tokenizer(args.target or smollm2_dir())
    rng = random.Random(args.seed)
    # A prompt is a file's start, so an excluded file is one whose text starts as an excluded prompt does.
    excluded = {
        record["text"][:EXCLUDE_PREFIX_CHARS]
        for folder in args.exclude_records
        for shard in sorted(folder.glob("*.jsonl"))
        for record in read_jsonl(shard, "Records")
    }
    prompts = []
    for shard in sorted(args.corpus.glob("*.jsonl")):
        for document in read_jsonl(shard, "Corpus"):
            language = document["id"].split("/", 1)[0]
            if language not in args.languages:
                continue
            text = document["text"]
            if text[:EXCLUDE_PREFIX_CHARS] in excluded:
                continue
            offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            cut = cut_point(text, offsets, args.min_tokens, args.max_tokens, rng)
            if cut is not None:
                prompts.append({"text": text[:cut], "source": f"code-{language}", "id": document["id"]})
    if not prompts:
        raise SystemExit(f"No document of {args.languages} in {args.corpus} holds {args.min_tokens} tokens.")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts), encoding="utf-8")
    print(f"{len(prompts)} prompts -> {args.output}")


if __name__ == "__main__":
    main()
