#!/usr/bin/env python
"""Greedy tau of drafters, teacher-forced on the target's own greedy answers: a low-noise proxy of the drafter-alone
tau of `longspark bench tau`, for comparing training arms.

On a record that the target decoded greedily (`longspark regenerate --temperature 0`), the tokens that follow any
response position are exactly what greedy speculative decoding accepts there, and the drafter's context at an anchor
is the one inference builds (`tests/test_alignment.py`). So one target pass and one drafter forward per record give,
at every anchor `t` of the response, the number of leading draft slots whose argmax (Markov-corrected by the true
predecessor, which is the drafted one while every earlier slot matched) equals the greedy token: what a whole-block
round at `t` accepts. Chaining the rounds from the first response token (`t -> t + 1 + accepted`) gives the tau the
drafter alone reaches on the record, with whole blocks (no confidence cuts) and in the training precision (fp32)
rather than the fast path's. Every anchor of every held-out record counts, so two drafters differ by more than the
noise of a dozen prompts.

    python scripts/teacher_forced_tau.py --records data/smollm2-greedy/held_out \
        --drafter start=src/transformers_longspark/drafters/longspark-smollm2-135m-instruct \
        --drafter greedy=runs/recipe7-greedy/checkpoint-000150/drafter --json results/teacher_forced_tau.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from transformers_longspark.benchmarks.common import machine_info
from transformers_longspark.loading import load_drafter, load_target
from transformers_longspark.training.data import Sequence, load_sequences
from transformers_longspark.training.distillation import teacher_forced_batch

ANCHORS_PER_FORWARD = 128  # bounds the memory of one drafter forward (each anchor holds its own window views)


@torch.no_grad()
def block_hits(target, drafter, sequence: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """`(T, B)` whether draft slot `i` of the block at anchor `t` is the greedy token, and `(T, B)` the largest
    probability of its law (its confidence), at each anchor of the response (False / 0 elsewhere)."""
    anchors = torch.arange(sequence.anchor_start, len(sequence.ids) - 1)
    size = (len(sequence.ids), drafter.config.block_size)
    hits, confidence = torch.zeros(size, dtype=torch.bool), torch.zeros(size)
    for part in anchors.split(ANCHORS_PER_FORWARD):
        batch = teacher_forced_batch(target, drafter, sequence, part)
        logits = drafter(batch.block_ids, batch.context, batch.previous_ids).logits
        hits[part] = (logits.argmax(-1) == batch.labels) & batch.valid
        confidence[part] = logits.softmax(-1).amax(-1)
    return hits, confidence


def accepted_lengths(target, drafter, sequence: Sequence) -> torch.Tensor:
    """`(T,)` whole-block accepted drafts at each anchor `t` of the response (0 elsewhere)."""
    return block_hits(target, drafter, sequence)[0].long().cumprod(dim=1).sum(dim=1)


def chained_rounds(sequence: Sequence, accepted: torch.Tensor) -> list[int]:
    """Accepted drafts of each round of greedy decoding from the first response token to the record's end. As in
    `generate` with `max_new_tokens` at the record's length, a round leaves the last token to its verification: at
    anchor `t` it keeps at most `T - 2 - t` drafts."""
    rounds, t, last = [], sequence.anchor_start, len(sequence.ids) - 2
    while t <= last:
        rounds.append(min(int(accepted[t]), last - t))
        t += 1 + rounds[-1]
    return rounds


def summarize(rounds: list[int], anchors: list[int], block_size: int) -> dict[str, float]:
    at_least = [sum(a >= i for a in anchors) / len(anchors) for i in range(1, block_size + 1)]
    return {
        "tau": 1 + sum(rounds) / len(rounds),
        "rounds": len(rounds),
        "anchors": len(anchors),
        "mean_accepted_per_anchor": sum(anchors) / len(anchors),
        "acceptance_rates": at_least,  # P(accepted >= i) over all anchors, i = 1..B
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=Path, required=True, help="folder of greedy regenerated records (JSONL)")
    parser.add_argument("--drafter", action="append", required=True, metavar="NAME=DIR", help="a drafter to score")
    parser.add_argument("--target", default=None, help="target folder (default: the SmolLM2 demo target)")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--limit", type=int, help="only the first N records")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    drafters = dict(spec.split("=", 1) for spec in args.drafter)
    target, _ = load_target(args.target)
    records = load_sequences(args.records, args.max_seq_len)[: args.limit]
    report = {"benchmark": "teacher_forced_tau", "records": str(args.records), "num_records": len(records),
              "drafters": {}, "machine": machine_info()}  # fmt: skip
    for name, path in drafters.items():
        drafter, _ = load_drafter(target, path)
        drafter.bind_target(target)
        rounds, anchors = defaultdict(list), defaultdict(list)
        for sequence in records:
            accepted = accepted_lengths(target, drafter, sequence)
            for key in ("all", sequence.source):
                rounds[key] += chained_rounds(sequence, accepted)
                anchors[key] += accepted[sequence.anchor_start : len(sequence.ids) - 1].tolist()
        block = drafter.config.block_size
        report["drafters"][name] = {"path": path, **{k: summarize(rounds[k], anchors[k], block) for k in rounds}}
        for key, row in report["drafters"][name].items():
            if key != "path":
                print(f"{name} {key}: tau {row['tau']:.3f} in {row['rounds']} rounds, P(accepted >= i) "
                      + " ".join(f"{rate:.3f}" for rate in row["acceptance_rates"]))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
