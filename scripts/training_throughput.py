"""Training throughput on this machine: target tokens per second of one distillation step, by precision and anchors.

One step = the target's teacher pass over one packed sequence, the drafter forward over its anchors, the loss and
the backward pass (what `longspark train` does per micro-batch). Every variant runs on the same sequences, in a
rotated order, after one warm-up step each, so the ratios are side by side.

    python scripts/training_throughput.py --data data/corpora/code/train --seq-len 4096 --anchors 128 256 512

Variants: `fp32` (no autocast), `bf16-autocast` (what `mixed_precision: bf16` does), and `bf16-target` (the frozen
target's weights cast to bf16 once, plus autocast: no per-step weight casts). Prints one JSON line per variant.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch


def main(argv: list[str] | None = None) -> None:
    from transformers_longspark import LongSparkDrafterModel
    from transformers_longspark.loading import SHIPPED_DRAFTER_DIR, load_target
    from transformers_longspark.training.corpora import DataSource, load_source
    from transformers_longspark.training.distillation import sample_anchors, sequence_loss

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="data/corpora/code/train", help="a training-data source (folder or file)")
    parser.add_argument("--drafter", default=str(SHIPPED_DRAFTER_DIR))
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--anchors", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--variants", nargs="+", default=["fp32", "bf16-autocast", "bf16-target"])
    parser.add_argument("--sequences", type=int, default=3, help="timed steps per variant")
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)

    target, tokenizer = load_target("smollm2", torch.float32, "cpu")
    target_bf16 = None
    if "bf16-target" in args.variants:
        target_bf16 = load_target("smollm2", torch.float32, "cpu")[0].to(torch.bfloat16)
    drafter = LongSparkDrafterModel.from_pretrained(args.drafter, dtype=torch.float32)
    drafter.bind_target(target)
    sequences = [s for s in load_source(DataSource(args.data), tokenizer, args.seq_len) if len(s.ids) == args.seq_len]
    sequences = sequences[: args.sequences + 1]
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=0.0)  # lr 0: timing only, the weights stay put

    def step(variant: str, sequence, anchors: int) -> float:
        teacher = target_bf16 if variant == "bf16-target" else target
        drafter.bind_target(teacher)
        autocast = torch.autocast("cpu", torch.bfloat16) if variant != "fp32" else contextlib.nullcontext()
        started = time.perf_counter()
        with autocast:
            loss = sequence_loss(teacher, drafter, sequence, sample_anchors(sequence, anchors, generator))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - started

    generator = torch.Generator().manual_seed(0)
    runs = [(v, a) for a in args.anchors for v in args.variants]
    seconds = {run: [] for run in runs}
    for run in runs:
        step(run[0], sequences[0], run[1])  # warm-up
    for i, sequence in enumerate(sequences[1:]):
        for run in runs[i % len(runs) :] + runs[: i % len(runs)]:
            seconds[run].append(step(run[0], sequence, run[1]))
    for (variant, anchors), times in seconds.items():
        mean = sum(times) / len(times)
        print(
            json.dumps(
                {
                    "variant": variant,
                    "anchors": anchors,
                    "seq_len": args.seq_len,
                    "seconds_per_step": mean,
                    "target_tokens_per_s": args.seq_len / mean,
                    "anchors_per_s": anchors / mean,
                }
            )
        )


if __name__ == "__main__":
    main()
