#!/usr/bin/env bash
# The default drafter for SmolLM2-135M-Instruct, as it was made (2-core shared CPU, no GPU).
# Every step resumes where it stopped when rerun. `d3d datagen|train|prune` run the same
# functions as the `python -m sglang_d3d.training.*` entry points used here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python

# 1. Distillation data: greedy responses of the target (max 256 new tokens) to GSM8K train
#    questions and the built-in instruction/code mix, interleaved 2:1, 128 prompts per shard,
#    48 sequences in flight (continuous batching on the engine's target runner), one thread.
#    It ran in the background for the whole session; the shards it wrote are in data/distill.
$PY -m sglang_d3d.training.datagen --out-dir data/distill --batch-size 48

# 2. (once) Which target layers to start from: equal short runs, compare held-out accept_len
#    and loss at equal steps in runs/init_*/history.jsonl.
#    recipes/compare_init.sh      -> 0,10,20,29 had the lowest loss at steps 20 and 30.

# 3. Training: 4 layers copied from target layers 0,10,20,29, block 16, 16 anchors per
#    sequence, restricted head of the 16384 most frequent response tokens, bf16 autocast,
#    70 minutes of one core (cosine decay follows the time budget). Rereads data/distill each
#    epoch while datagen keeps adding shards.
$PY -m sglang_d3d.training.train --out-dir runs/train_default --layers 0,10,20,29 \
  --block-size 16 --num-anchors 16 --head-size 16384 --batch-size 8 --lr 5e-4 \
  --warmup-steps 30 --max-steps 1500 --time-budget-min 70 --eval-every 150 --ckpt-minutes 5

# 3b. Resumed the same run for 15 more minutes while pruning ran (time budget 70 -> 85 min;
#     the cosine schedule continues from 82% progress): steps 716 -> 918.
$PY -m sglang_d3d.training.train --out-dir runs/train_default --layers 0,10,20,29 \
  --block-size 16 --num-anchors 16 --head-size 16384 --batch-size 8 --lr 5e-4 \
  --warmup-steps 30 --max-steps 1500 --time-budget-min 85 --eval-every 150 --ckpt-minutes 5

# 4. Pruning table (few held-out samples and short recovery: CPU time was nearly spent).
#    It ran on the 70-minute checkpoint (step 716, copied to runs/drafter_70min).
$PY -m sglang_d3d.training.prune --drafter-path runs/drafter_70min \
  --out-dir runs/prune --results-dir benchmarks/results --eval-samples 24 --recover-steps 15 \
  --e2e-prompts 2 --e2e-max-new-tokens 64

# 5. Ship: the table chose depth 4 (the unpruned drafter), so the step-918 checkpoint ships.
mkdir -p sglang_d3d/assets/drafter
cp runs/train_default/drafter/config.json runs/train_default/drafter/model.safetensors \
  sglang_d3d/assets/drafter/
