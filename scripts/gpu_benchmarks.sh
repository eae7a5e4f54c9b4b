#!/usr/bin/env bash
# Lossless on the GPU first (tests/test_cuda.py: fast verification logits, greedy equality at batch 1 and in batches,
# the exact sampling law), then verification and drafting cost at long context with a random-weight Qwen3-8B (costs
# depend on shapes alone): test log, JSON, Markdown and plots in OUT_DIR. About 4-6 minutes on one H200; each command
# is capped at 4 minutes.
#
# Usage: bash scripts/gpu_benchmarks.sh OUT_DIR
# Overrides (e.g. a CPU smoke test): DEVICE=cpu DTYPE=float32 SYNTHETIC_TARGET=tiny bash scripts/gpu_benchmarks.sh OUT
set -uo pipefail
out=${1:?usage: gpu_benchmarks.sh OUT_DIR}
device=${DEVICE:-cuda}
dtype=${DTYPE:-bfloat16}
target=${SYNTHETIC_TARGET:-qwen3-8b}
limit=${COMMAND_TIMEOUT:-240}
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"  # works without `pip install -e .`
mkdir -p "$out"
{ nvidia-smi || true; python -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__)"; } >"$out/environment.txt" 2>&1
common=(--device "$device" --dtype "$dtype" --synthetic-target "$target")
status=0

# Exactness where the costs are measured: the test module runs on DEVICE (it is skipped on a machine without CUDA).
(cd "$root" && LONGSPARK_TEST_DEVICE="$device" timeout "$limit" python -m pytest -q -p no:cacheprovider -rs \
    tests/test_cuda.py) >"$out/cuda_tests.txt" 2>&1 || status=1
tail -3 "$out/cuda_tests.txt"

# Cached target forward of k = 1..16 tokens after 4K-32K rows: stock sdpa + concatenating cache vs the fast path.
timeout "$limit" python -m transformers_longspark.cli bench verify-cost "${common[@]}" \
    --prefix-lengths 4096 8192 16384 32768 --num-tokens 1 2 4 8 16 --repeats 7 --warmup 3 \
    --json "$out/verify_cost.json" --plot "$out/verify_cost.png" --markdown "$out/verify_cost.md" || status=1

# Drafting round vs prefix: target-prefilled prefixes up to 32K, then synthetic caches to 128K (32K on both, to
# compare a synthetic cache with a real one).
timeout "$limit" python -m transformers_longspark.cli bench drafting-cost "${common[@]}" --prefix random \
    --prefix-lengths 512 1024 2048 4096 8192 16384 32768 --synthetic-prefix-lengths 32768 65536 131072 \
    --rounds 20 --warmup 5 --prefill-chunk 4096 \
    --json "$out/drafting_cost.json" --plot "$out/drafting_cost.png" --markdown "$out/drafting_cost.md" || status=1

ls -l "$out"
exit $status
