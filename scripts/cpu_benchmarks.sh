#!/usr/bin/env bash
# Regenerates every figure of the README's "Results on this machine" (SmolLM2-135M-Instruct target, shipped drafter,
# 2 threads) into results/. About an hour on the 2-core VM; time it on an idle machine (no training running).
#
# Usage: bash scripts/cpu_benchmarks.sh [verify|drafting|long|short|batched|memory ...]   (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
out=results
threads=(--num-threads 2)
methods=(--methods prompt_lookup prompt_lookup_fast longspark full_prefix)
parts=("${@:-verify drafting long short batched memory}")
for part in ${parts[*]}; do
  case $part in
    verify)  # cached target forward of k tokens after a prefix: stock path vs the fast verification path
      longspark bench verify-cost "${threads[@]}" --json $out/verify_cost.json --plot $out/verify_cost.png \
          --markdown $out/verify_cost.md ;;
    drafting)  # one drafting round vs prefix, LongSpark vs full prefix, real prefixes to 8K, synthetic to 128K
      longspark bench drafting-cost "${threads[@]}" --rounds 30 --json $out/drafting_cost.json \
          --plot $out/drafting_cost.png --markdown $out/drafting_cost.md ;;
    long)  # long-code continuation of held-out stdlib files at 4K and 8K, side by side
      longspark bench --workloads long --num-long-prompts 4 --long-lengths 4096 8192 --max-new-tokens 64 \
          "${methods[@]}" "${threads[@]}" --json $out/speed_long.json --markdown $out/speed_long.md ;;
    short)  # held-out chat, maths and code prompts
      longspark bench --workloads short --num-short-prompts 6 --max-new-tokens 96 "${methods[@]}" "${threads[@]}" \
          --json $out/speed_short.json --markdown $out/speed_short.md ;;
    batched)  # plain batched generate vs LongSpark batched at batch 1, 2, 4, 8
      longspark bench --batch-sizes 1 2 4 8 --repeats 1 --max-new-tokens 64 --long-lengths 1024 2048 \
          "${threads[@]}" --json $out/batched.json --markdown $out/batched.md ;;
    memory)  # extra peak RSS of assisted over plain generate at 1K and 8K prompt tokens
      longspark bench memory --json $out/memory.json ;;
    *) echo "unknown part: $part" >&2; exit 2 ;;
  esac
done
