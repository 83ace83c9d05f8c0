"""CMake arguments that build llama.cpp (llama-cpp-python, `make bench-peers`) for this CPU.

ggml's GGML_NATIVE compiles with -march=native, AMX included where the CPU reports it. On a
machine whose CPU, kernel and process all allow AMX (cpuid, /proc/cpuinfo's amx_tile, and
arch_prctl granting the tile data), llama.cpp 0.3.36's AMX matrix kernels still faulted at
their first tile instruction (`ldtilecfg`, SIGSEGV, in `ggml_backend_amx_mul_mat`). So the
instruction sets come from the compiler's -march=native, as GGML_NATIVE would take them,
without AMX; AMX serves ggml's batched prompt products, not the one-token decode steps that
`make bench-peers` compares.

    python benchmarks/llama_cmake_args.py   # -> -DGGML_NATIVE=OFF -DGGML_AVX=ON ...
"""

from __future__ import annotations

import platform
import subprocess

# the compiler's macro -> ggml's option
MACROS = {
    "__SSE4_2__": "GGML_SSE42", "__AVX__": "GGML_AVX", "__AVXVNNI__": "GGML_AVX_VNNI",
    "__AVX2__": "GGML_AVX2", "__BMI2__": "GGML_BMI2", "__FMA__": "GGML_FMA", "__F16C__": "GGML_F16C",
    "__AVX512F__": "GGML_AVX512", "__AVX512VBMI__": "GGML_AVX512_VBMI",
    "__AVX512VNNI__": "GGML_AVX512_VNNI", "__AVX512BF16__": "GGML_AVX512_BF16",
}
AMX = {"__AMX_TILE__": "GGML_AMX_TILE", "__AMX_INT8__": "GGML_AMX_INT8", "__AMX_BF16__": "GGML_AMX_BF16"}  # left out
BASE = ["-DLLAMA_CURL=OFF"]


def native_macros(cc: str = "cc") -> set[str]:
    out = subprocess.run([cc, "-march=native", "-dM", "-E", "-"], input="", capture_output=True,
                         text=True, check=True).stdout
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}


def cmake_args(macros: set[str]) -> list[str]:
    """-DGGML_NATIVE=OFF, each x86 option on where `macros` has it, AMX off."""
    args = [f"-D{opt}={'ON' if m in macros else 'OFF'}" for m, opt in MACROS.items()]
    return BASE + ["-DGGML_NATIVE=OFF"] + args + [f"-D{opt}=OFF" for opt in AMX.values()]


def main() -> None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        print(" ".join(BASE + ["-DGGML_NATIVE=ON"]))
        return
    try:
        macros = native_macros()
    except (OSError, subprocess.CalledProcessError):
        print(" ".join(BASE + ["-DGGML_NATIVE=ON"]))
        return
    print(" ".join(cmake_args(macros)))


if __name__ == "__main__":
    main()
