"""The C++ CPU kernels in models/csrc/, built on first use with torch's extension loader and
cached per machine (in $TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions).

The build takes about half a minute once. It needs a C++ compiler and ninja (a dependency,
from PyPI). Where it cannot build, `exact_layers()` returns None and the 4-bit target runs
its TorchScript path (models/exact_pass.py), which is slower and exact in the same sense. The
compiled code targets the CPU it is built on (-march=native), so the cache key names that
CPU's flags.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "exact_layers.cpp"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor()


def build_name() -> str:
    """One build per source, torch version and CPU."""
    key = SOURCE.read_bytes() + torch.__version__.encode() + _cpu_flags().encode()
    return "d3d_cpu_" + hashlib.sha256(key).hexdigest()[:12]


def _ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH; the PyPI package's binary sits in this
    environment's bin folder, which is not on PATH where the environment is not activated."""
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.lru_cache(maxsize=1)
def exact_layers():
    """torch.ops.d3d_cpu.exact_layers, built and loaded; None where it cannot be built."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    try:
        cpp_extension.load(build_name(), sources=[str(SOURCE)], is_python_module=False,
                           extra_cflags=["-O3", "-march=native"], verbose=False)
        return torch.ops.d3d_cpu.exact_layers
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: the fallback
        log.warning("C++ CPU kernels unavailable (%s: %s); the 4-bit target runs its "
                    "TorchScript path", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
