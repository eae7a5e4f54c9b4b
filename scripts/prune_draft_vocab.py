"""Shrinks a drafter's draft vocabulary to the tokens most frequent in its training mixture (no retraining).

The LM-head rows the drafter reads are the target's own, so the logits of the tokens it keeps do not change: only
tokens outside the new vocabulary can no longer be proposed, and each round reads fewer LM-head rows (the head is
the largest part of a drafting forward on a CPU).

    python scripts/prune_draft_vocab.py src/transformers_longspark/drafters/longspark-smollm2-135m-instruct \
        runs/pruned-8192 --config configs/smollm2-135m-cpu-corpora.yaml --size 8192
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from transformers_longspark import LongSparkDrafterModel
from transformers_longspark.loading import load_target
from transformers_longspark.training.corpora import DataMixture, data_sources
from transformers_longspark.training.data import Sequence
from transformers_longspark.training.run import TrainingConfig, most_frequent_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafter", help="drafter folder with a draft vocabulary")
    parser.add_argument("output", help="folder for the pruned drafter")
    parser.add_argument("--config", required=True, help="training config whose train_data gives the frequencies")
    parser.add_argument("--size", type=int, required=True, help="tokens to keep")
    parser.add_argument("--sequences", type=int, default=400, help="training sequences to count tokens over")
    args = parser.parse_args()

    drafter = LongSparkDrafterModel.from_pretrained(args.drafter)
    current = drafter.config.draft_vocab_size
    if current is None or args.size >= current:
        raise SystemExit(f"--size must be below the drafter's draft vocabulary ({current} tokens).")
    config = TrainingConfig.from_file(args.config)
    target, tokenizer = load_target(config.target)
    mixture = DataMixture(data_sources(config.train_data), tokenizer, config.max_seq_len)
    sequences = []
    for batch in mixture.micro_batches(1, seed=config.seed):  # the mixture's own weights and order
        sequences += batch
        if len(sequences) >= args.sequences:
            break
    # Only tokens the drafter proposes today can stay (their Markov rows were trained); EOS always stays.
    outside = torch.ones(drafter.config.vocab_size, dtype=torch.bool)
    outside[drafter.draft_vocab] = False
    eos = target.generation_config.eos_token_id
    always = [eos] if isinstance(eos, int) else list(eos or [])
    counted = [Sequence(s.ids[~outside[s.ids]], 1) for s in sequences]
    keep = most_frequent_tokens(counted, args.size, drafter.config.vocab_size, always)
    kept_counts = sum(int((~outside[s.ids]).sum()) for s in sequences)
    pruned = drafter.with_draft_vocab(keep)
    pruned.save_pretrained(args.output)
    covered = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
    covered[keep] = True
    total = sum(len(s.ids) for s in sequences)
    after = sum(int(covered[s.ids].sum()) for s in sequences)
    report = {"source": args.drafter, "size": args.size, "sequences": len(sequences), "tokens": total,
              "coverage_before": kept_counts / total, "coverage_after": after / total}  # fmt: skip
    (Path(args.output) / "pruning.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
