#!/usr/bin/env bash
# Training choices compared, each arm from the untrained drafter over the same data, seed and
# 600-step schedule as recipes/default_drafter.sh step 2, stopped at step 40 and evaluated on
# the same 40 held-out samples (results: benchmarks/results/compare_formats.md and
# compare_weights.md):
#   kl   rank-32 deltas, KL to the target's distribution (the default)
#   ce   rank-32 deltas, cross-entropy on the target's greedy tokens
#   full full-rank deltas (rank 576 = hidden size: every projection free on mask slots, i.e. a
#        full fine-tune of the mask path; not shippable, its checkpoint is ~0.5 GB)
# and, with WEIGHTS=1 (measured over all 66 shards of data/distill), which slots enter the loss:
#   weights_position    draft d with probability exp(-(d-1)/7) (the default)
#   weights_confidence  each slot with the target's confidence in its block's earlier drafts
#                       (`--slot-weights confidence`, after PARD-2)
# Rerunning resumes an unfinished arm. Each arm writes runs/compare/<arm>/history.jsonl; then
#   .venv/bin/python benchmarks/compare_formats.py --runs runs/compare
#   .venv/bin/python benchmarks/compare_formats.py --runs runs/compare \
#     --arms weights_position,weights_confidence --out benchmarks/results/compare_weights
# write the tables.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
STOP=${STOP:-40}
arm() {  # name, extra flags
  local name=$1; shift
  $PY -m sglang_d3d.training.train --out-dir runs/compare/$name --block-size 16 \
    --min-block-size 4 --num-anchors 32 --gamma 7 --batch-size 4 --lr 6e-4 --warmup-steps 20 \
    --max-steps 600 --stop-at-step $STOP --eval-every $STOP --eval-samples 40 --ckpt-minutes 5 \
    --threads 1 "$@"
}
if [ "${WEIGHTS:-0}" = 1 ]; then
  arm weights_position --rank 32 --alpha 32 --loss kl
  arm weights_confidence --rank 32 --alpha 32 --loss kl --slot-weights confidence --no-initial-eval
  exit 0
fi
# The arms share their untrained start, so only the first evaluates it (step 0: 2.11).
arm kl --rank 32 --alpha 32 --loss kl
arm ce --rank 32 --alpha 32 --loss ce
arm full --rank 576 --alpha 576 --loss kl --no-initial-eval
