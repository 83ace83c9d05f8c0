#!/usr/bin/env bash
# Builds benchmarks/llama_decode.cpp, llama.cpp's own greedy decode loop (bench_peers.py's
# `llama-cpp` row), into .llama/build/llama_decode.
#
# It links the llama.cpp library that llama-cpp-python (pyproject's `peers` extra) compiled and
# installed: the same vendored sources, built with the same CMAKE_ARGS
# (benchmarks/llama_cmake_args.py), so the C++ and the Python rows run the same kernels and
# differ only by the loop that drives them. llama.h comes from that version's source package.
#
#   make bench-peers                              # installs the extra, runs this, benchmarks
#   bash scripts/build_llama_decode.sh [PYTHON]   # PYTHON: default .venv/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
OUT=.llama

if ! VERSION=$("$PY" -c "import llama_cpp; print(llama_cpp.__version__)" 2>/dev/null); then
  echo "llama-cpp-python is not installed: make bench-peers installs it (pyproject's peers extra)" >&2
  exit 1
fi
LIB=$("$PY" -c "import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parent / 'lib')")
SRC=$OUT/llama_cpp_python-$VERSION/vendor/llama.cpp
mkdir -p "$OUT/build"
if [ ! -f "$SRC/include/llama.h" ]; then
  "$PY" -m pip download -q "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$OUT"
  tar -xzf "$OUT/llama_cpp_python-$VERSION.tar.gz" -C "$OUT" \
    "llama_cpp_python-$VERSION/vendor/llama.cpp/include" "llama_cpp_python-$VERSION/vendor/llama.cpp/ggml/include"
fi
nice -n 10 "${CXX:-g++}" -O2 -std=c++17 -Wall -Wextra \
  -I "$SRC/include" -I "$SRC/ggml/include" benchmarks/llama_decode.cpp \
  -L "$LIB" -lllama -lggml -lggml-base -Wl,-rpath,"$(cd "$LIB" && pwd)" -o "$OUT/build/llama_decode"
echo "built $OUT/build/llama_decode against llama.cpp from llama-cpp-python $VERSION"
