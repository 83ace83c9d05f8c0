#!/usr/bin/env bash
# The benchmark runs behind README's results (issue 9 goals), in the order they were run.
# DRAFTER defaults to the shipped drafter; TAG names the result files. Each run prints its
# table and saves JSON under benchmarks/results/. Pause background jobs first (kill -STOP).
# Code prompts: `--dataset mbpp`, the task texts of MBPP 1-64 bundled with the package
# (sglang_d3d/assets/prompts/, CC-BY-4.0); the first 10 or 20 are the ones measured before
# sitting 22 from an uncommitted runs/mbpp20.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
DRAFTER=${DRAFTER:-sglang_d3d/assets/drafter}
TAG=${TAG:-default}
BLOCK=${BLOCK:-8}
OUT=benchmarks/results
PY=.venv/bin/python
D3D=.venv/bin/d3d

# Offline held-out acceptance per block position (the target's own greedy answers).
$PY benchmarks/bench_accept.py --drafter "$DRAFTER" --dataset gsm8k --num-prompts 30 \
  --blocks 16,8 --out $OUT/accept_gsm8k_${TAG}.json
$PY benchmarks/bench_accept.py --drafter "$DRAFTER" --dataset mt_bench --num-prompts 20 \
  --blocks 16,8 --out $OUT/accept_mtbench_${TAG}.json
$PY benchmarks/bench_accept.py --drafter "$DRAFTER" --dataset mbpp --num-prompts 20 \
  --blocks 16,8 --out $OUT/accept_mbpp_${TAG}.json

# ar / sync / async interleaved prompt by prompt, batch 1, greedy (identity checked).
$D3D bench --dataset gsm8k --num-prompts 30 --max-new-tokens 128 --modes ar,sync,async,async-adaptive \
  --block-size $BLOCK --branch-budget 1 --drafter "$DRAFTER" --out $OUT/bench_gsm8k30_${TAG}.json
$D3D bench --dataset mt_bench --num-prompts 20 --max-new-tokens 128 --modes ar,sync,async,async-adaptive \
  --block-size $BLOCK --branch-budget 1 --drafter "$DRAFTER" --out $OUT/bench_mtbench20_${TAG}.json
$D3D bench --dataset mbpp --num-prompts 10 --max-new-tokens 128 \
  --modes ar,sync,async,async-adaptive --block-size $BLOCK --branch-budget 1 --drafter "$DRAFTER" \
  --out $OUT/bench_mbpp10_${TAG}.json

# Pass timings (1 and 2 threads), target and drafter.
$PY benchmarks/bench_passes.py --block $BLOCK --drafter "$DRAFTER" --json $OUT/passes_${TAG}.json

# Through the server (its defaults: block 16, adaptive controller): ar vs async, concurrency
# 1/4/16, streaming chat requests, one unmeasured warm-up round per concurrency.
$D3D bench-serving --modes ar async --datasets gsm8k mt_bench mbpp \
  --concurrency 1 4 16 --num-prompts 16 --max-tokens 64 --variants plain \
  --server-args "--drafter $DRAFTER" --out $OUT/bench_serving_${TAG}.json

# The drafter's int8 weights (the default on CPU) against its fp32 weights, side by side
# (sitting 7: bench_int8_*.json). '-full' runs a mode on the fp32 weights.
M=ar,sync-full@$BLOCK,sync@$BLOCK,async-adaptive-full@$BLOCK,async-adaptive@$BLOCK
$D3D bench --dataset gsm8k --num-prompts 30 --max-new-tokens 128 --branch-budget 1 \
  --block-size $BLOCK --modes $M --drafter "$DRAFTER" --out $OUT/bench_int8_gsm8k30_${TAG}.json
$D3D bench --dataset mt_bench --num-prompts 20 --max-new-tokens 128 --branch-budget 1 \
  --block-size $BLOCK --modes $M --drafter "$DRAFTER" --out $OUT/bench_int8_mtbench20_${TAG}.json
$D3D bench --dataset mbpp --num-prompts 10 --max-new-tokens 128 --branch-budget 1 \
  --block-size $BLOCK --modes $M --drafter "$DRAFTER" --out $OUT/bench_int8_mbpp10_${TAG}.json

# Sampled requests (temperature 0.7): token trees filled with draws, against chains (-tree0),
# side by side (sitting 12: bench_s12_sampled_*.json). Outputs follow the target's
# distribution, not token for token, so no identity check.
M=ar,sync-tree0@4,sync@4,async-adaptive-tree0@$BLOCK,async-adaptive@$BLOCK
$D3D bench --dataset gsm8k --num-prompts 20 --max-new-tokens 128 --temperature 0.7 --branch-budget 1 \
  --block-size $BLOCK --modes $M --drafter "$DRAFTER" --out $OUT/bench_s12_sampled_gsm8k20_${TAG}.json
$D3D bench --dataset mt_bench --num-prompts 20 --max-new-tokens 128 --temperature 0.7 --branch-budget 1 \
  --block-size $BLOCK --modes $M --drafter "$DRAFTER" --out $OUT/bench_s12_sampled_mtbench20_${TAG}.json
