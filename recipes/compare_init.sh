#!/usr/bin/env bash
# Which target layers make the best drafter starting point? Short equal-time runs on the data
# available so far; compare the held-out acceptance length in runs/init_*/history.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
for layers in 0,1,2,3 0,10,20,29 0,1,28,29 26,27,28,29; do
  .venv/bin/python -m sglang_d3d.training.train --out-dir "runs/init_${layers//,/_}" \
    --layers "$layers" --max-steps 60 --warmup-steps 10 --eval-every 1000 --heldout-every 8 \
    --eval-samples 16 --time-budget-min "${MINUTES:-2.5}" --ckpt-minutes 100
done
