#!/usr/bin/env bash
# The one-command GPU check: the CUDA-path tests, then the scaling benchmark.
#
#   bash benchmarks/gpu_check.sh                      # one CUDA GPU, under 8 minutes on an H200
#   bash benchmarks/gpu_check.sh --device cpu --tiny  # the same script end to end on a CPU
#
# Needs torch (with CUDA), transformers, triton and pytest; no network, no sglang, fastapi or
# flashinfer (the SGLang end-to-end GPU test skips itself when sglang is absent). Models are
# random-weight, built from configs in the repo (benchmarks/gpu_shapes.py). Writes one JSON file
# (OUT, default benchmarks/results/gpu_check.json) and prints a table, the training check
# writes TRAIN_OUT (default benchmarks/results/gpu_train_check.json) and the pipeline check
# PIPE_OUT (default benchmarks/results/gpu_pipeline_check.json). Extra arguments go to
# gpu_scale.py (e.g. --shapes qwen3-8b qwen3-32b); --device and --tiny also reach the training
# check.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-benchmarks/results/gpu_check.json}
TRAIN_OUT=${TRAIN_OUT:-benchmarks/results/gpu_train_check.json}
PIPE_OUT=${PIPE_OUT:-benchmarks/results/gpu_pipeline_check.json}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

echo "== 1/4 pytest -m gpu (streams, generators, on-device verification)"
# Named files only: collecting the whole suite would import fastapi and sglang.
# A failing test does not stop the timings; its exit status is saved in the JSON and returned.
rc=0
"$PY" -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_speculative_verify_batch.py tests/test_drafting_isolation.py \
  tests/test_executor.py tests/test_sglang_gpu.py tests/test_tree.py \
  tests/test_tree_sampling.py || rc=$?

echo "== worker contract (tests/test_sglang_worker_contract.py: CPU, and CUDA where present)"
# The SGLang worker's cycle and drafter placement without sglang: the drafter shares the
# target's embedding and head on its GPU, and every verify block is as wide as SGLang reserves.
"$PY" -m pytest -q -p no:cacheprovider tests/test_sglang_worker_contract.py || rc=$?

echo "== 2/4 gpu_scale.py"
"$PY" benchmarks/gpu_scale.py --out "$OUT" --pytest-rc "$rc" "$@" || rc=$?

echo "== 3/4 gpu_train_check.py (training steps at the Qwen3-1.7B shape)"
train_args=()
prev=""
for a in "$@"; do
  [[ "$a" == "--tiny" ]] && train_args+=(--tiny)
  [[ "$prev" == "--device" ]] && train_args+=(--device "$a")
  [[ "$a" == --device=* ]] && train_args+=("$a")
  prev="$a"
done
"$PY" benchmarks/gpu_train_check.py --out "$TRAIN_OUT" ${train_args[@]+"${train_args[@]}"} || rc=$?

echo "== 4/4 gpu_pipeline_check.py (d3d datagen -> torchrun d3d train -> d3d bench, tiny target)"
pipe_args=()
for a in ${train_args[@]+"${train_args[@]}"}; do [[ "$a" != "--tiny" ]] && pipe_args+=("$a"); done
"$PY" benchmarks/gpu_pipeline_check.py --out "$PIPE_OUT" ${pipe_args[@]+"${pipe_args[@]}"} || rc=$?
exit "$rc"
