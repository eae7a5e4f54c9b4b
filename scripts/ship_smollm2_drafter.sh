#!/usr/bin/env bash
# Refreshes the shipped SmolLM2 drafter from a training run: bf16 weights, the speed benchmarks on held-out long code
# and short prompts (side by side: plain generate, prompt lookup, LongSpark, the full-prefix drafter), model card.
# ~25 minutes on the 2-core VM; run it with nothing else on the machine.
# Usage: bash scripts/ship_smollm2_drafter.sh runs/smollm2-135m-cpu-corpora/final runs/smollm2-135m-cpu-corpora/log.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
final=${1:?usage: ship_smollm2_drafter.sh RUN_DIR/final RUN_DIR/log.jsonl}
log=${2:?usage: ship_smollm2_drafter.sh RUN_DIR/final RUN_DIR/log.jsonl}
card=src/transformers_longspark/drafters/longspark-smollm2-135m-instruct
python - "$final" "$card" <<'PY'
import sys, torch
from transformers_longspark import LongSparkDrafterModel
LongSparkDrafterModel.from_pretrained(sys.argv[1], dtype=torch.float32).to(torch.bfloat16).save_pretrained(sys.argv[2])
PY
cp "$log" results/smollm2-training-log-stage3.jsonl
methods=(--methods prompt_lookup prompt_lookup_fast longspark full_prefix)
longspark bench --workloads long --num-long-prompts 4 --long-lengths 4096 8192 --max-new-tokens 64 "${methods[@]}" \
    --num-threads 2 --json results/speed_long.json --markdown results/speed_long.md
longspark bench --workloads short --num-short-prompts 6 --max-new-tokens 96 "${methods[@]}" \
    --num-threads 2 --json results/speed_short.json --markdown results/speed_short.md
longspark bench tau --drafter "shipped=$card" --workloads long --by-length --long-lengths 256 512 1024 2048 4096 8192 \
    --num-long-prompts 5 --max-new-tokens 32 --drafter-alone --whole-blocks --num-threads 2 \
    --json results/long_range_curve.json \
    --plot results/long_range_curve.png
# Stage 1's log predates token counting: 291.1 is the mean length of the 352 records it trained on.
longspark card "$card" --benchmark results/speed_short.json results/speed_long.json \
    --training-config configs/smollm2-135m-cpu.yaml configs/smollm2-135m-cpu-continue.yaml \
    configs/smollm2-135m-cpu-corpora.yaml \
    --training-log results/smollm2-training-log.jsonl results/smollm2-training-log-stage2.jsonl \
    results/smollm2-training-log-stage3.jsonl --tokens-per-sequence 291.1 \
    --notes model_cards/longspark-smollm2-135m-instruct-limits.md --acceptance-curve results/long_range_curve.json
