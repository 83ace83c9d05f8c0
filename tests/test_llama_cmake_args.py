"""benchmarks/llama_cmake_args.py: llama.cpp (a benchmark peer) builds for the instruction sets
the compiler sees on this CPU, never with its AMX kernels."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "llama_cmake_args.py"


def _module():
    spec = importlib.util.spec_from_file_location("llama_cmake_args", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_options_follow_the_compilers_macros_and_leave_amx_out():
    args = _module().cmake_args({"__AVX2__", "__FMA__", "__AMX_TILE__", "__AMX_INT8__"})
    assert "-DGGML_NATIVE=OFF" in args and "-DLLAMA_CURL=OFF" in args
    assert {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_AVX512=OFF"} <= set(args)
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)
    assert not any(a.startswith("-DGGML_AMX") and a.endswith("=ON") for a in args)
