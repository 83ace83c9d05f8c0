#!/usr/bin/env bash
# The CPU benchmarks behind the README's results, each writing the file that
# benchmarks/results/README.md indexes. DRAFTER defaults to the shipped drafter; OUT to
# benchmarks/results. Prompts are the bundled sets (GSM8K test, MT-Bench first turns, MBPP
# tasks 1-64); set D3D_DATASETS to read GSM8K and MT-Bench from another folder. Timings move
# with whatever else runs on the machine: run them on an otherwise idle one.
set -euo pipefail
cd "$(dirname "$0")/.."
DRAFTER=${DRAFTER:-sglang_d3d/assets/drafter}
OUT=${OUT:-benchmarks/results}
PY=.venv/bin/python
D3D=.venv/bin/d3d

# Offline accepted length per block position, on the target's own greedy answers (no timing).
$PY benchmarks/bench_accept.py --drafter "$DRAFTER" --dataset gsm8k --num-prompts 30 \
  --blocks 16,8 --threads 1 --out $OUT/accept_gsm8k.json
$PY benchmarks/bench_accept.py --drafter "$DRAFTER" --dataset mt_bench --num-prompts 20 \
  --blocks 16,8 --threads 1 --out $OUT/accept_mt_bench.json
$PY benchmarks/bench_accept.py --drafter "$DRAFTER" --dataset mbpp --num-prompts 20 \
  --blocks 16,8 --threads 1 --out $OUT/accept_mbpp.json

# ar, sync and async on the same prompts in one process, batch 1, greedy (outputs checked
# identical to ar's), then sampled at temperature 0.7.
MODES=ar,sync@4,async-adaptive@8
BENCH="$D3D bench --drafter $DRAFTER --branch-budget 1 --block-size 8 --max-new-tokens 128 --modes $MODES"
$BENCH --dataset gsm8k --num-prompts 30 --out $OUT/bench_gsm8k30.json
$BENCH --dataset mt_bench --num-prompts 20 --out $OUT/bench_mt_bench20.json
$BENCH --dataset mbpp --num-prompts 20 --out $OUT/bench_mbpp20.json
for set in gsm8k mt_bench mbpp; do
  $BENCH --dataset $set --num-prompts 20 --temperature 0.7 --out $OUT/bench_sampled_${set}20.json
done

# One forward pass of each kind, target and drafter.
$PY benchmarks/bench_passes.py --threads 2 --block 4 --drafter "$DRAFTER" --json $OUT/passes.json

# Through the server: ar against async at concurrency 1, 4 and 16, streaming chat requests,
# three rounds on new servers, each round its own prompts.
$D3D bench-serving --modes ar async --datasets gsm8k mt_bench mbpp --concurrency 1 4 16 \
  --num-prompts 16 --max-tokens 64 --variants plain --rounds 3 --fresh-servers --fresh-prompts \
  --seed 11 --server-args "--drafter $DRAFTER" --out $OUT/serving_c1c4c16.json
