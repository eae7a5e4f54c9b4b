#!/usr/bin/env bash
# Refreshes the shipped SmolLM2 drafter from a training run: bf16 weights, speed report, model card.
# Usage: bash scripts/ship_smollm2_drafter.sh runs/smollm2-135m-cpu-continue/final
set -euo pipefail
final=${1:?usage: ship_smollm2_drafter.sh RUN_DIR/final}
card=model_cards/longspark-smollm2-135m-instruct
python - "$final" "$card" <<'PY'
import sys, torch
from transformers_longspark import LongSparkDrafterModel
LongSparkDrafterModel.from_pretrained(sys.argv[1], dtype=torch.float32).to(torch.bfloat16).save_pretrained(sys.argv[2])
PY
longspark bench --workloads short --num-short-prompts 6 --max-new-tokens 96 --num-threads 2 \
    --json benchmarks/speed_short.json --markdown benchmarks/speed_short.md
# Stage 1's log predates token counting: 291.1 is the mean length of the 352 records it trained on.
longspark card "$card" --benchmark benchmarks/speed_short.json \
    --training-config configs/smollm2-135m-cpu.yaml configs/smollm2-135m-cpu-continue.yaml \
    --training-log benchmarks/smollm2-training-log.jsonl benchmarks/smollm2-training-log-stage2.jsonl \
    --tokens-per-sequence 291.1
