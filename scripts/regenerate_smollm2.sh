#!/usr/bin/env bash
# The SmolLM2 drafter's training data at scale: SmolLM2-135M-Instruct's own answers to GSM8K, MMATH (English) and
# Python-stdlib code prompts, 6 samples per training prompt (T=0.7, top-k 20, top-p 0.8; ~11K records, ~2M response
# tokens), written by vLLM's offline engine in fp32 (2.5x transformers' throughput; its greedy records equal the
# transformers engine's, tests/test_regenerate_vllm.py). Not bf16: 1.5x faster on CPUs with AVX-512 BF16, far slower
# where bf16 is emulated (AVX2), and the archives below only serve runs of the same settings, on any machine. 40
# prompts per source are held out exactly as the benchmarks hold them out (`--held-out 40 --seed 0`), so no benchmark
# prompt is trained on.
# Resumable: rerun the same command after any interruption (kill -9 included); it continues where it stopped.
# ~5 hours on a 2-vCPU AMD EPYC VM (the engine writes 103-124 response tok/s there), ~3.5 hours on a 2-vCPU Intel Xeon
# with AVX-512 (173 tok/s); run it in the background and leave the machine to it:
#   nohup setsid bash scripts/regenerate_smollm2.sh >> data/regenerate.log 2>&1 &
# Responses already sampled are rebuilt from the committed archives in regenerated/smollm2 (seconds, not hours); to
# add new ones there: longspark pack data/smollm2 regenerated/smollm2 (safe while this script still runs).
# Usage: bash scripts/regenerate_smollm2.sh [OUTPUT_DIR]   (default data/smollm2; needs scripts/install_vllm.sh)
#        bash scripts/regenerate_smollm2.sh data/smollm2-greedy greedy
#   the greedy set instead: one greedy answer per training prompt (1,870 records, 367K response tokens, ~26 minutes
#   on the Intel Xeon; archived in regenerated/smollm2-greedy), what a drafter for greedy decoding trains on.
set -euo pipefail
cd "$(dirname "$0")/.."
sampling=(--samples-per-prompt 6 --archives regenerated/smollm2)
[ "${2:-}" = greedy ] && sampling=(--samples-per-prompt 1 --temperature 0 --archives regenerated/smollm2-greedy)
for attempt in 1 2 3 4 5; do  # a dead engine (e.g. on a starved machine) costs one batch: start again
  .venv-vllm/bin/python -m transformers_longspark.cli regenerate --engine vllm --dtype float32 \
    --prompts gsm8k mmath-en stdlib-code --held-out 40 --seed 0 "${sampling[@]}" \
    --max-new-tokens 256 --batch-size 128 --output "${1:-data/smollm2}" && exit 0
  echo "regenerate stopped (attempt $attempt); resuming in 10 s" >&2; sleep 10
done
exit 1
