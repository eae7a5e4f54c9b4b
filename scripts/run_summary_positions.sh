#!/usr/bin/env bash
# Summary-key positions experiment: {none, block_start} x {1K, 4K training sequences}, each continuing the shipped
# SmolLM2 drafter with the same budget, then held-out tau at 2K / 4K / 8K code prefixes for all of them, the shipped
# drafter, and the shipped drafter switched to block_start untrained. One thread, one stage at a time, so it uses
# one core. Training stops by TRAIN_DEADLINE and evaluation by DEADLINE (HH:MM UTC; `timeout`).
#
#   python scripts/prepare_long_code.py --output data/long_code --max-tokens 8192
#   nohup bash scripts/run_summary_positions.sh > runs/summary-positions.log 2>&1 &
set -u
cd "$(dirname "$0")/.."
DEADLINE=${DEADLINE:-13:38}
TRAIN_DEADLINE=${TRAIN_DEADLINE:-13:18}
left() { echo $(( $(date -u -d "${1:-$DEADLINE}" +%s) - $(date -u +%s) )); }
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
mkdir -p runs

for run in none-1k block-start-1k none-4k block-start-4k; do
  config=configs/experiments/summary-positions-$run.yaml
  echo "== $(date -u +%T) train $run ($(left "$TRAIN_DEADLINE") s left)"
  start=$(date +%s)
  timeout "$(left "$TRAIN_DEADLINE")" python -m transformers_longspark.cli train --config "$config"
  rc=$?
  echo "== $(date -u +%T) train $run done rc=$rc in $(( $(date +%s) - start )) s"
done

python - <<'EOF'
import torch
from transformers_longspark import LongSparkDrafterModel
shipped = "src/transformers_longspark/drafters/longspark-smollm2-135m-instruct"
LongSparkDrafterModel.from_pretrained(shipped, dtype=torch.float32, summary_key_positions="block_start").save_pretrained(
    "runs/shipped-as-block-start")
EOF

echo "== $(date -u +%T) eval ($(left) s left)"
drafters=(--drafter shipped=src/transformers_longspark/drafters/longspark-smollm2-135m-instruct
          --drafter shipped-as-block_start=runs/shipped-as-block-start)
for run in none-1k block-start-1k none-4k block-start-4k; do
  [ -d "runs/summary-positions-$run/final" ] && drafters+=(--drafter "$run=runs/summary-positions-$run/final")
done
timeout "$(left)" longspark bench tau "${drafters[@]}" --workloads long --long-lengths 2048 4096 8000 \
  --num-long-prompts 12 --max-new-tokens 32 --whole-blocks --num-threads 1 --json runs/summary-positions-tau.json
rc=$?
echo "== $(date -u +%T) all done rc=$rc"
