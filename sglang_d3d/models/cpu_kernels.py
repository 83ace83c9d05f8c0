"""The C++ CPU kernels in models/csrc/ (the 4-bit target's block products and its decode and
verify layers), built on first use with torch's extension loader and cached per machine (in
$TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions).

The build takes about half a minute once. It needs a C++ compiler and ninja (a dependency,
from PyPI). Where it cannot build, `load()` is False and the 4-bit target runs on torch's int4
kernel and its TorchScript path (models/exact_pass.py), which is slower and exact in the same
sense; so it does by default where the block products would run on their plain C++ loop (a
CPU without AVX2: `vectorised()` is False). The compiled code targets the CPU it is built on (-march=native), so the cache key
names that CPU's flags.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
SOURCES = ("exact_layers.cpp", "block_mm.cpp")


def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def cpu_flags() -> str:
    """The instruction sets the build targets (-march=native): /proc/cpuinfo's flags, or the
    platform's processor name where there is no such file."""
    import platform

    return cpuinfo().get("flags") or platform.processor()


def build_name() -> str:
    """One build per source, build flags, torch version and CPU."""
    files = sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h"))
    key = b"".join(p.read_bytes() for p in files) + Path(__file__).read_bytes() + torch.__version__.encode()
    key += cpu_flags().encode()
    return "d3d_cpu_" + hashlib.sha256(key).hexdigest()[:12]


def _ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH; the PyPI package's binary sits in this
    environment's bin folder, which is not on PATH where the environment is not activated."""
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def build(name: str, sources: tuple[str, ...], cflags: list[str], folder: Path = CSRC, module: bool = False):
    """Compile and load `sources` (in `folder`, csrc by default) as extension `name` (cached
    under that name), with `cflags` after -O3; raises where it cannot be built. module: the
    sources define a Python module (benchmarks' timing loops), returned; else they register
    torch operators and None is returned."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    # -fopenmp: at::parallel_for runs on torch's OpenMP threads only where the extension
    # is built with it (torch's own libgomp serves, already loaded under the same name)
    ext = cpp_extension.load(name, sources=[str(folder / s) for s in sources], is_python_module=module,
                             extra_cflags=["-O3", *cflags, "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    return ext if module else None


@functools.lru_cache(maxsize=1)
def load() -> bool:
    """Build and load the kernels (torch.ops.d3d_cpu.*); False where they cannot be built."""
    try:
        build(build_name(), SOURCES, ["-march=native"])
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: the fallback
        log.warning("C++ CPU kernels unavailable (%s: %s); the 4-bit target runs on torch's int4 "
                    "kernel and its TorchScript path", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return False
    log.info("C++ CPU kernels loaded: 4-bit block products on the %s path", torch.ops.d3d_cpu.q4_path())
    return True


def describe_cpu() -> dict:
    """The CPU as benchmarks record it: /proc/cpuinfo's model name, family and model, and the
    path the 4-bit block products take on it ("unbuilt" without the C++ kernels)."""
    info = {k: v for k, v in cpuinfo().items() if k in ("model name", "cpu family", "model")}
    info["q4_path"] = torch.ops.d3d_cpu.q4_path() if load() else "unbuilt"
    return info


def vectorised() -> bool:
    """The block products run on vector instructions here (AVX2 or better), not the plain
    C++ loop (block_mm.cpp's q4_path)."""
    return load() and torch.ops.d3d_cpu.q4_path() != "portable"


def exact_layers():
    """torch.ops.d3d_cpu.exact_layers; None where the kernels cannot be built."""
    return torch.ops.d3d_cpu.exact_layers if load() else None
