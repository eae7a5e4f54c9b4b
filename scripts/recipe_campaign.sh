#!/usr/bin/env bash
# The recipe campaign of issue 30: each arm of configs/experiments/recipe7-*.yaml trains to STOP_STEP (150) of its
# 480-step schedule, one at a time on both cores, then stops; rerun to resume an arm that was interrupted (an arm
# with its checkpoint at STOP_STEP is skipped). The reference arm is stage 7's checkpoint 150
# (configs/smollm2-135m-cpu-stage7.yaml). Held-out tau of every arm: docs/results.md, "Recipe campaign".
#   nohup setsid bash scripts/recipe_campaign.sh [ARM ...] > runs/recipe7.log 2>&1 &
set -euo pipefail
STOP_STEP=${STOP_STEP:-150}
arms=("$@")
[ ${#arms[@]} -gt 0 ] || arms=(kl depth3 decay1 lr4e-4)
for arm in "${arms[@]}"; do
    config=configs/experiments/recipe7-$arm.yaml
    run=runs/recipe7-$arm
    checkpoint=$run/checkpoint-$(printf '%06d' "$STOP_STEP")
    [ -f "$checkpoint/trainer_state.json" ] && { echo "$arm: $checkpoint exists"; continue; }
    resume=()
    compgen -G "$run/checkpoint-*" > /dev/null && resume=(--resume)
    echo "$arm: training to step $STOP_STEP ($(date -u +%H:%M))"
    longspark train --config "$config" "${resume[@]}" &
    trainer=$!
    until [ -f "$checkpoint/trainer_state.json" ] || ! kill -0 "$trainer" 2> /dev/null; do sleep 5; done
    sleep 5  # trainer_state.json is the checkpoint's last file; let it close
    kill "$trainer" 2> /dev/null || true
    wait "$trainer" 2> /dev/null || true
    echo "$arm: stopped at $checkpoint ($(date -u +%H:%M))"
done
