#!/usr/bin/env bash
# Refreshes the shipped SmolLM2 drafter from a training run: bf16 weights, the README's two speed benchmarks on held-out
# short prompts and long code (the commands under its results table), the acceptance-vs-length curve, the model card.
# ~25 minutes on the 2-core VM; run it with nothing else on the machine, then `python scripts/render_results.py`.
# Usage: bash scripts/ship_smollm2_drafter.sh DRAFTER_DIR LOG
#   DRAFTER_DIR: the run's `final` (or a `checkpoint-N/drafter`); LOG: its `log.jsonl`, kept as the last stage's log.
set -euo pipefail
cd "$(dirname "$0")/.."
drafter=${1:?usage: ship_smollm2_drafter.sh DRAFTER_DIR LOG}
log=${2:?usage: ship_smollm2_drafter.sh DRAFTER_DIR LOG}
card=src/transformers_longspark/drafters/longspark-smollm2-135m-instruct
# The shipped drafter's training stages, in order (docs/training.md, "The shipped SmolLM2 drafter").
configs=(configs/smollm2-135m-cpu.yaml configs/smollm2-135m-cpu-continue.yaml configs/smollm2-135m-cpu-corpora.yaml
         configs/smollm2-135m-cpu-stage5.yaml configs/smollm2-135m-cpu-stage6.yaml
         configs/experiments/recipe7-codegreedy.yaml configs/experiments/stage8-codegreedy.yaml
         configs/experiments/stage9-codegreedy.yaml configs/experiments/stage10-code2.yaml
         configs/experiments/stage11-code3.yaml configs/experiments/stage12-code4.yaml
         configs/experiments/stage13-code5.yaml configs/experiments/stage14-code6.yaml)
logs=(results/smollm2-training-log.jsonl results/smollm2-training-log-stage2.jsonl
      results/smollm2-training-log-stage3.jsonl results/smollm2-training-log-stage5.jsonl
      results/smollm2-training-log-stage6.jsonl results/recipe7-codegreedy-log.jsonl
      results/smollm2-training-log-stage8.jsonl results/smollm2-training-log-stage9.jsonl
      results/smollm2-training-log-stage10.jsonl results/smollm2-training-log-stage11.jsonl
      results/smollm2-training-log-stage12.jsonl results/smollm2-training-log-stage13.jsonl
      results/smollm2-training-log-stage14.jsonl)
python - "$drafter" "$card" <<'PY'
import sys, torch
from transformers_longspark import LongSparkDrafterModel
LongSparkDrafterModel.from_pretrained(sys.argv[1], dtype=torch.float32).to(torch.bfloat16).save_pretrained(sys.argv[2])
PY
[ "$log" -ef "${logs[-1]}" ] || cp "$log" "${logs[-1]}"
python tests/test_golden.py  # the golden logits follow the shipped weights
# The README's commands, read from under its results table, so that the two never differ.
grep -E '^longspark bench speed .*results/speed_(short|long)\.json' README.md | while read -r command; do
  eval "$command"
done
longspark bench tau --drafter "shipped=$card" --workloads long --by-length --long-lengths 256 512 1024 2048 4096 8192 \
    --num-long-prompts 5 --max-new-tokens 32 --drafter-alone --whole-blocks --num-threads 2 --quiet \
    --json results/long_range_curve.json --plot results/long_range_curve.png
# Stage 1's log predates token counting: 291.1 is the mean length of the 352 records it trained on.
longspark card "$card" --benchmark results/speed_short.json results/speed_long.json \
    --training-config "${configs[@]}" --training-log "${logs[@]}" --tokens-per-sequence 291.1 \
    --notes model_cards/longspark-smollm2-135m-instruct-limits.md --acceptance-curve results/long_range_curve.json
