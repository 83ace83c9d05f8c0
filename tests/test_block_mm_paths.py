"""Every instruction-set path of the block products gives the plain loop's bits, not only the
one this CPU's build takes: models/csrc/block_mm.cpp built again for the AVX2, AVX-VNNI and
AVX-512 VNNI paths (those this CPU can run) and the plain C++ loop, each compared bitwise with
the portable loop of this machine's build, for every kind of last octet and 1 to 9 input rows."""

from __future__ import annotations

import platform

import pytest
import torch

from sglang_d3d.models import cpu_kernels
from sglang_d3d.models.q4_linear import Q4Blocks, pack_blocks

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not cpu_kernels.load(),
    reason="the paths under test are x86's, and the C++ kernels must build here")

V3 = {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}  # x86-64-v3
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}  # x86-64-v4
# (compiler flags, the path q4_path() names, the CPU flags the build's code may use)
BUILDS = {
    "portable": (["-march=x86-64"], "portable", set()),
    "avx2": (["-march=x86-64-v3"], "avx2", V3),
    "avx-vnni": (["-march=x86-64-v3", "-mavxvnni"], "avx-vnni", V3 | {"avx_vnni"}),
    "avx512-vnni": (["-march=x86-64-v4", "-mavx512vnni"], "avx512-vnni", V4 | {"avx512_vnni"}),
}


def _ops(path: str):
    """The block products built for `path` as torch.ops.d3d_<path>; skips where this CPU
    cannot run that build's instructions."""
    flags, _, needs = BUILDS[path]
    missing = needs - set(cpu_kernels.cpu_flags().split())
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}")
    if not _compiler_takes(flags):
        pytest.skip(f"this compiler does not take {flags}")
    ns = "d3d_" + path.replace("-", "_")
    # named by the sources' hash as the main build is, so that an edit rebuilds it
    cpu_kernels.build(f"{ns}_{cpu_kernels.build_name().removeprefix('d3d_cpu_')}", ("block_mm.cpp",),
                      [*flags, f"-DD3D_OPS={ns}"])
    return getattr(torch.ops, ns)


def _compiler_takes(flags: list[str]) -> bool:
    """The C++ compiler torch's loader runs accepts these flags (older ones lack x86-64-v3)."""
    import os
    import subprocess

    cxx = os.environ.get("CXX", "c++")
    try:
        return subprocess.run([cxx, *flags, "-E", "-x", "c++", os.devnull], capture_output=True).returncode == 0
    except OSError:
        return False


# inputs of 1, 2, 3, 8, 11, 12, 18 and 48 blocks: last octets of 1 to 4 blocks and none
SHAPES = [(40, 32), (33, 64), (24, 96), (18, 256), (21, 352), (18, 384), (31, 576), (17, 1536)]


@pytest.mark.parametrize("path", sorted(BUILDS))
def test_each_paths_products_are_the_plain_loops_bits(path):
    ops = _ops(path)
    assert ops.q4_path() == BUILDS[path][1]
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        b = Q4Blocks(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                     (torch.rand(n, k // 32, generator=gen) * 0.05).half(),
                     (-torch.rand(n, k // 32, generator=gen) * 0.4).half())
        packed = pack_blocks(b)
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        d = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
        for m in (1, 2, 4, 9):
            x = torch.randn(m, k, generator=gen) * torch.rand(m, k, generator=gen)
            plain = torch.ops.d3d_cpu.q4_mm(x, *packed, portable=True)
            assert torch.equal(ops.q4_mm(x, *packed), plain), (path, n, k, m)
            coarse = torch.ops.d3d_cpu.q4_mm(x, *packed, portable=True, coarse=True)
            assert torch.equal(ops.q4_mm(x, *packed, coarse=True), coarse), (path, n, k, m)
            assert torch.equal(ops.q8_mm(x, q, d), torch.ops.d3d_cpu.q8_mm(x, q, d, portable=True)), (path, n, k, m)
