#!/usr/bin/env python
"""A copy of the shipped drafter that proposes only the `--size` tokens of its draft vocabulary most frequent in the
target's regenerated answers and in the training corpus's Python files (`with_draft_vocab`; no training).

The drafter's output head is `draft_vocab_size` rows of the target's LM head and its Markov projection one row per
draft token, so a smaller draft vocabulary reads fewer weights per round; tokens it drops can no longer be drafted.
Counts come from `regenerated/smollm2/` (the target's answers to the training prompts) and
`data/corpora/code/train` (`scripts/prepare_corpora.py`), never from the benchmarks' held-out prompts. Prints the
share of those tokens the kept vocabulary covers.

    python scripts/prune_draft_vocab.py --size 8192 --output runs/drafter-vocab-8192
"""

from __future__ import annotations

import argparse
import json
import lzma
from pathlib import Path

import torch

from transformers_longspark.loading import SHIPPED_DRAFTER_DIR, load_drafter, load_target

REPO = Path(__file__).resolve().parents[1]


def answer_counts(vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for path in sorted((REPO / "regenerated" / "smollm2").glob("*.jsonl.xz")):
        with lzma.open(path, "rt") as lines:
            for line in lines:
                ids = json.loads(line).get("response_ids")
                if ids:
                    counts += torch.bincount(torch.tensor(ids), minlength=vocab_size).double()
    return counts


def python_code_counts(tokenizer, vocab_size: int, max_files: int) -> torch.Tensor:
    counts, files = torch.zeros(vocab_size, dtype=torch.float64), 0
    for path in sorted((REPO / "data" / "corpora" / "code" / "train").glob("*.jsonl")):
        with path.open() as lines:
            for line in lines:
                record = json.loads(line)
                if record["id"].endswith(".py") and files < max_files:
                    ids = tokenizer(record["text"])["input_ids"]
                    counts += torch.bincount(torch.tensor(ids), minlength=vocab_size).double()
                    files += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--max-code-files", type=int, default=400)
    args = parser.parse_args()
    target, tokenizer = load_target()
    drafter, _ = load_drafter(target, SHIPPED_DRAFTER_DIR)
    vocab_size = drafter.config.vocab_size
    sources = {
        "answers": answer_counts(vocab_size),
        "code": python_code_counts(tokenizer, vocab_size, args.max_code_files),
    }
    # Each source's frequencies weigh alike, whatever its token count.
    frequency = sum(counts / counts.sum() for counts in sources.values())
    draft_vocab = drafter.draft_vocab
    score = frequency[draft_vocab]
    eos = target.generation_config.eos_token_id
    for token in [eos] if isinstance(eos, int) else list(eos or []):
        score[draft_vocab == token] = float("inf")
    kept = draft_vocab[torch.argsort(score, descending=True)[: args.size]].sort().values
    for name, counts in sources.items():
        print(
            f"{name}: {int(counts.sum())} tokens; the shipped vocabulary covers "
            f"{counts[draft_vocab].sum() / counts.sum():.4f}, the kept {counts[kept].sum() / counts.sum():.4f}"
        )
    pruned = drafter.with_draft_vocab(kept)
    pruned.save_pretrained(args.output)
    print(f"Saved a drafter of {args.size} draft tokens to {args.output}")


if __name__ == "__main__":
    main()
