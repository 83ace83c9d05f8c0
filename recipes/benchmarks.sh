#!/usr/bin/env bash
# The benchmark runs behind README's results, in the order they were run. DRAFTER defaults to
# the shipped drafter; TAG names the result files. Each run prints its table and saves JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
DRAFTER=${DRAFTER:-sglang_d3d/assets/drafter}
TAG=${TAG:-default}
OUT=benchmarks/results
D3D=.venv/bin/d3d

# MT-Bench first turns: ar / sync / async side by side (acceptance and speed).
$D3D bench --dataset mt_bench --num-prompts ${MT_PROMPTS:-10} --max-new-tokens 96 \
  --modes ar,sync,async --drafter "$DRAFTER" --out $OUT/bench_mtbench_${TAG}.json

# Which branch budget is fastest (async only, a few GSM8K prompts).
for pol in "topk 1 1" "topk 4 1" "all 1 1" "all 1 2"; do
  set -- $pol
  $D3D bench --dataset gsm8k --num-prompts ${SWEEP_PROMPTS:-4} --max-new-tokens 64 --modes async \
    --branch-policy $1 --branch-budget $2 --guesses-per-position $3 --drafter "$DRAFTER" \
    --out $OUT/branch_sweep_${TAG}_${1}${2}_g${3}.json
done

# The live server under load: ar vs async (adaptive), concurrency 1, 4, 16.
$D3D bench-serving --modes ar async --datasets gsm8k mt_bench --concurrency 1 4 16 \
  --num-prompts ${SERVE_PROMPTS:-16} --max-tokens 64 --server-args "--drafter $DRAFTER" \
  --out $OUT/bench_serving_${TAG}.json
